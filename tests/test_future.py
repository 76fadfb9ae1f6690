"""TensorFuture: values reach the host only when asked for."""
import pytest
import torch

from tests.helpers import bound, small_cnn
from trainer.future import TensorFuture
from trainer.plan import Baseline as B
from trainer.regions import Region as R


def test_future_holds_the_value_at_enqueue_time():
    x = torch.arange(4.0)
    f = TensorFuture(x)
    x.add_(10)  # later work does not change what the future reports
    assert f.is_ready()
    assert torch.equal(f.get(), torch.arange(4.0))


def test_arena_to_host_async_of_a_dtensor_and_of_a_region():
    plans, arena, ops = bound(small_cnn())
    ops.s[B.STEP].fill_(7)
    assert arena.to_host_async(plans.main[B.STEP]).get().tolist() == [7]
    region = arena.to_host_async(R.W_DEEP_CONV).get()
    assert torch.equal(region, arena.flat(R.W_DEEP_CONV))
    span = arena.to_host_async((R.G_BN_BIAS, R.G_DEEP_CONV)).get()
    assert span.numel() == arena.flat(R.G_BN_BIAS, R.G_DEEP_CONV).numel()


class NotYet(TensorFuture):
    """A step result the device has not produced yet: asking for it would block the host."""

    def __init__(self):
        super().__init__(torch.zeros(3))
        self.ready = False

    def is_ready(self) -> bool:
        return self.ready

    def get(self) -> torch.Tensor:
        assert self.ready, "the host waited for a step of a later epoch"
        return super().get()


def test_an_epoch_record_waits_only_for_that_epochs_steps(tmp_path):
    """The loop writes epoch k's record once epoch k+1 is queued: waiting there for epoch k+1's
    logged steps too would leave the device idle while the host prepares epoch k+2."""
    import json

    from trainer.metrics import MetricsLog
    log = MetricsLog(tmp_path)
    lr = TensorFuture(torch.ones(1))
    log.step(10, 1, "train_base", 100, TensorFuture(torch.ones(3)), lr)
    later = NotYet()
    log.step(20, 2, "train_base", 200, later, lr)
    log.epoch({"epoch": 1, "train_loss": 1.0})
    later.ready = True
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("step", "epoch record") for r in rows] == [10, "epoch record", 20]


def test_records_write_a_non_finite_number_as_null(tmp_path):
    """A diverged loss: NaN and Infinity are not JSON, and a reader would refuse the files."""
    import json

    from trainer.metrics import MetricsLog, write_summary
    strict = dict(parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    write_summary(tmp_path, {"val_loss": float("nan"), "train_loss": float("inf"), "val_top1": 0.1})
    assert json.loads((tmp_path / "summary.json").read_text(), **strict) == \
        {"val_loss": None, "train_loss": None, "val_top1": 0.1}
    log = MetricsLog(tmp_path)
    log.epoch({"epoch": 1, "val_loss": float("-inf")})
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text(), **strict) == {"epoch": 1, "val_loss": None}
