"""Our compiled step timed two ways, alternately (each twice), side by side in one process,
where one change is in question:

    python bench/step_probe.py stem model=resnet50 data.resolution=224 data.num_classes=1000 \\
        amp=true trainer.batch_size=256 compile=true

pool: the max-pool's forward as the Triton kernel, a custom op that inductor calls as it
is (what the trainer runs), or as the reference's torch form, which inductor compiles
itself and may fuse with the BatchNorm and ReLU before it.
stem: torchvision's stem as one op each way (trainer.norm's BatchNorm2d.pooled: what the
trainer runs), or as the BatchNorm with its ReLU, then the max-pool.
"""
import contextlib
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import reference, triton_ops  # noqa: E402
from trainer import bench, norm  # noqa: E402
from trainer.config import compose_config  # noqa: E402

PROBES = {  # probe -> (variant, what changes the trainer into it)
    "pool": [("pool forward: Triton kernel", contextlib.nullcontext),
             # set-up hands the model's pool kernels.max_pool
             ("pool forward: torch form", lambda: mock.patch.object(triton_ops, "max_pool", reference.max_pool))],
    "stem": [("stem: one op each way", contextlib.nullcontext),
             ("stem: BatchNorm, then max-pool",
              lambda: mock.patch.object(norm.BatchNorm2d, "pooled", lambda self, x, pool: pool(self(x))))],
}


def main(probe: str, overrides: list[str]):
    cfg = compose_config(["mode=bench", "bench.baselines=[]", "optimizer=momentum", *overrides])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = True
    results = []
    for name, variant in PROBES[probe] * 2:
        with variant():
            torch._dynamo.reset()
            result = bench.ours(cfg, device)
        result.method = f"{result.method}, {name}"
        results.append(result)
        print(f"{result.method}: {result.ms:.2f} ms, peak {result.peak_gib:.3f} GiB", flush=True)
    print(bench.table(cfg, results, device))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
