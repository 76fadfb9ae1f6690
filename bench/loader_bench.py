"""The input pipeline on one GPU, in one process:
1. images/s of the loader alone (DALI decoding and augmenting a JPEG tree into a buffer);
2. a training run on that tree (ResNet-50 by default), images/s of its last two epochs;
3. the same step graphs replayed on data already in the arena, images/s;
and the ratio 2/3: the loader never stalls the GPU when it is close to 1.

    python -m trainer.data.make_jpeg_tree /tmp/tree --classes 100 --per-class 130
    python bench/loader_bench.py data.root=/tmp/tree [model=resnet50 trainer.batch_size=256 ...]
"""
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.config import compose_config  # noqa: E402
from trainer.data import build_sources  # noqa: E402
from trainer.dist import Dist  # noqa: E402
from trainer.feeder import BUFFERS  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.setup import use_device  # noqa: E402

DEFAULTS = ["data=imagefolder", "model=resnet50", "trainer.batch_size=256", "amp=true", "data.num_classes=100",
            "trainer.epochs=3", "trainer.eval_every=100", "trainer.checkpoint_every=0", "trainer.log_every=1000"]


def loader_alone(cfg, device, batches: int) -> float:
    train, _ = build_sources(cfg, device, 0, 1, torch.float16 if cfg.amp else None)
    b, r = cfg.trainer.batch_size, cfg.data.resolution
    buffers = [torch.empty(b, r, r, 4 if cfg.amp else 3, dtype=torch.float16 if cfg.amp else torch.float32,
                           device=device) for _ in range(2)]
    label, mask = torch.empty(b, dtype=torch.int32, device=device), torch.empty(b, dtype=torch.int8, device=device)
    stream = torch.cuda.Stream()
    batches = min(batches, train.size // b)
    train.start_epoch(0, r)
    for i in range(2):  # warm-up: pipelines built, first batches decoded
        train.fill(buffers[i % 2], label, mask, stream)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(2, batches):
        train.fill(buffers[i % 2], label, mask, stream)
    stream.synchronize()
    return (batches - 2) * b / (time.perf_counter() - t0)


def event() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def seconds(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    end.synchronize()
    return start.elapsed_time(end) / 1000


def main(overrides: list[str]):
    cfg = compose_config(DEFAULTS + overrides)
    device = torch.device("cuda")
    use_device(device, cfg)  # as the trainer sets it first: deterministic=true crops with host-drawn windows
    alone = loader_alone(cfg, device, 60)
    trainer = Trainer(cfg, Path(tempfile.mkdtemp()), Dist())
    # Epochs queued back to back, as fit() queues them: the host does not wait for the
    # device at an epoch's end, so the loader's restart for the next epoch overlaps the
    # last steps queued, as in a run. Timed on the device from the end of the first epoch to
    # the end of the third.
    pending = [trainer.train_epoch(0)]
    start = event()
    pending += [trainer.train_epoch(epoch) for epoch in (1, 2)]
    end = event()
    for result in pending:
        result()
    steps = trainer.train_steps(1) + trainer.train_steps(2)
    fed = len(steps) * cfg.trainer.batch_size / seconds(start, end)
    start = event()
    for i in range(len(steps)):  # the same steps on the data already in the arena
        trainer.executor.run("train_base", BUFFERS[i % 2])
    resident = len(steps) * cfg.trainer.batch_size / seconds(start, event())
    print(f"| {cfg.model.name} b{cfg.trainer.batch_size} {cfg.data.resolution}px | loader alone {alone:,.0f} img/s "
          f"| training fed by the loader {fed:,.0f} img/s | data already in the arena {resident:,.0f} img/s "
          f"| ratio {fed / resident:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
