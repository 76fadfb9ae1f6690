"""ResNet-50 b256's stem max-pool (fp16, channels-last, 256x64x112x112 pooled 3x3 stride 2)
normalizing its BatchNorm's input as it loads it, at several tiles, each timed in a CUDA
graph, against its parts: inductor's BatchNorm-and-ReLU kernel, then the plain max-pool.

    python bench/stem_sweep.py
"""
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernels_bench import batch_norm_inputs, graph_ms  # noqa: E402
from kernels import triton_ops  # noqa: E402
from kernels.triton_ops import PoolTiles  # noqa: E402

WINDOW = ([3, 3], [2, 2], [1, 1])
CONFIGS = [PoolTiles(*t) for t in itertools.product((8, 16, 32), (32, 64), (4, 8))]


def main():
    _, x, mean, invstd, weight, bias = batch_norm_inputs(64, 112, torch.Generator(device="cuda").manual_seed(0))
    scale = weight * invstd
    shift = bias - mean * scale

    @torch.compile(dynamic=False)
    def normalize(x):
        return torch.relu(x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)).to(x.dtype)

    normalized = normalize(x)
    y, _ = triton_ops.max_pool(x, *WINDOW, scale, shift)
    mismatch = (y != triton_ops.max_pool(normalized, *WINDOW)[0]).float().mean().item()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; pooled values that differ from the "
          f"parts' (which compare fp16-rounded values): {mismatch:.2e}", flush=True)
    parts = graph_ms(lambda: normalize(x)), graph_ms(lambda: triton_ops.max_pool(normalized, *WINDOW))
    print(f"parts: normalize {parts[0]:.4f} ms + pool {parts[1]:.4f} ms = {sum(parts):.4f} ms", flush=True)
    now, times = triton_ops.POOL_FORWARD, {}
    for config in CONFIGS:
        triton_ops.POOL_FORWARD = config
        times[config] = graph_ms(lambda: triton_ops.max_pool(x, *WINDOW, scale, shift))
        print(f"  normalizing pool {config}: {times[config]:.4f} ms", flush=True)
    triton_ops.POOL_FORWARD = now
    best = min(times, key=times.get)
    print(f"normalizing pool: now {times[now]:.4f} ms; best {times[best]:.4f} at {best}")


if __name__ == "__main__":
    main()
