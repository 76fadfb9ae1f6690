"""The input pipeline on one GPU, in one process:
1. images/s of the loader alone (DALI decoding and augmenting a JPEG tree into a buffer);
2. a training run on that tree (ResNet-50 by default), images/s of its last epoch;
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


def main(overrides: list[str]):
    cfg = compose_config(DEFAULTS + overrides)
    device = torch.device("cuda")
    alone = loader_alone(cfg, device, 60)
    trainer = Trainer(cfg, Path(tempfile.mkdtemp()), Dist())
    seconds = []
    for epoch in range(3):
        before = trainer.train_seconds
        trainer.train_epoch(epoch)()
        seconds.append(trainer.train_seconds - before)
    steps = trainer.train_steps(2)
    fed = len(steps) * cfg.trainer.batch_size / seconds[-1]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(len(steps)):
        trainer.executor.run("train_base", BUFFERS[i % 2])
    end.record()
    end.synchronize()
    resident = len(steps) * cfg.trainer.batch_size / (start.elapsed_time(end) / 1000)
    print(f"| {cfg.model.name} b{cfg.trainer.batch_size} {cfg.data.resolution}px | loader alone {alone:,.0f} img/s "
          f"| training fed by the loader {fed:,.0f} img/s | data already in the arena {resident:,.0f} img/s "
          f"| ratio {fed / resident:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
