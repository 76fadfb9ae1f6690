"""Where the CIFAR-10 speed recipe's time goes, on one GPU, in one process:
the captured step replayed alone (and its frozen twin, when the stem freezes part way); one fill
of a resident batch on the loader's stream; an epoch of the loop (fill beside replay); two epochs
back to back; the evaluation; and the kernels of the step (bench.profile's table over 20 replays).

    [EXP=cifar10_speed_sgd] python bench/cifar_probe.py data.root=PATH/cifar10-jpeg.tgz [compile=true ...]
"""
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.bench import profile  # noqa: E402
from trainer.config import compose_config  # noqa: E402
from trainer.dist import Dist  # noqa: E402
from trainer.feeder import BUFFERS  # noqa: E402
from trainer.loop import Trainer  # noqa: E402


def timed(fn, n: int, stream=None) -> float:
    """Device ms per call of fn(i), i < n, from events on `stream`."""
    s = stream or torch.cuda.current_stream()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record(s)
    for i in range(n):
        fn(i)
    b.record(s)
    b.synchronize()
    return a.elapsed_time(b) / n


def main(overrides: list[str]):
    cfg = compose_config(["+experiment=" + os.environ.get("EXP", "cifar10_speed"), *overrides])
    t = Trainer(cfg, Path(tempfile.mkdtemp()), Dist())
    t.train_epoch(0)()  # warm-up
    v, r, per_epoch = t.engine.variant("train_base"), cfg.data.resolution, t.per_epoch

    def epochs(first: int, count: int):
        for epoch in range(first, first + count):
            t.train_source.start_epoch(epoch, r)
            t.run_steps(t.train_steps(epoch), t.train_source)

    t.train_source.start_epoch(1, r)
    replays = {f"step replayed alone ({name})": timed(lambda i: t.executor.run(name, BUFFERS[i % 2]), 100)
               for name in ("train_base", "train_base_frozen") if (name, BUFFERS[0]) in t.executor.programs}
    rows = {
        **replays,
        "one fill on the loader's stream": timed(lambda i: t.feeder.fill(BUFFERS[i % 2], v, t.train_source),
                                                 per_epoch - 1, t.feeder.stream),
        "one epoch of the loop, per step": timed(lambda i: epochs(2, 1), 1) / per_epoch,
        "two epochs back to back, per step": timed(lambda i: epochs(3, 2), 1) / (2 * per_epoch),
        "evaluation": timed(lambda i: t.evaluate(), 1),
    }
    for name, ms in rows.items():
        print(f"| {name} | {ms:.3f} ms |")
    replay = itertools.count()
    print(profile(lambda: t.executor.run("train_base", BUFFERS[next(replay) % 2]), 20,
                  rows["step replayed alone (train_base)"], torch.device("cuda"), rows=30))


if __name__ == "__main__":
    start = time.perf_counter()
    main(sys.argv[1:])
    print(f"{time.perf_counter() - start:.0f} s")
