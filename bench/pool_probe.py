"""The max-pool's forward under compile=true two ways, our compiled step timed with each,
alternately, side by side in one process: the Triton kernel as a custom op that inductor
calls as it is (what the trainer runs), and the reference's torch form, which inductor
compiles itself and may fuse with the BatchNorm and ReLU before it.

    python bench/pool_probe.py model=resnet50 data.resolution=224 data.num_classes=1000 amp=true \\
        trainer.batch_size=256 compile=true
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import reference, triton_ops  # noqa: E402
from trainer import bench  # noqa: E402
from trainer.config import compose_config  # noqa: E402


def main(overrides: list[str]):
    cfg = compose_config(["mode=bench", "bench.baselines=[]", "optimizer=momentum", *overrides])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = True
    kernel = triton_ops.max_pool
    results = []
    for name, forward in [("Triton kernel", kernel), ("torch form", reference.max_pool)] * 2:
        triton_ops.max_pool = forward  # set-up hands the model's pool kernels.max_pool
        torch._dynamo.reset()
        result = bench.ours(cfg, device)
        result.method = f"{result.method}, pool forward: {name}"
        results.append(result)
        print(f"{result.method}: {result.ms:.2f} ms, peak {result.peak_gib:.3f} GiB", flush=True)
    triton_ops.max_pool = kernel
    print(bench.table(cfg, results, device))


if __name__ == "__main__":
    main(sys.argv[1:])
