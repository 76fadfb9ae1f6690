"""The max-pool kernels' tiles at ResNet-50 b256's stem (fp16, channels-last), each pass
timed in a CUDA graph at every configuration, against what it must move at the device's
copy rate; and the forward as inductor compiles it: max_pool2d alone, and the reference's
max_pool (values and int8 positions), which is what compile=true runs.

    python bench/max_pool_sweep.py
"""
import itertools
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernels_bench import graph_ms, pool_pass_bytes, stem_pool_inputs  # noqa: E402
from kernels import reference, triton_ops  # noqa: E402
from kernels.triton_ops import PoolTiles  # noqa: E402

CONFIGS = [PoolTiles(*t) for t in itertools.product((8, 16, 32, 64), (64,), (4, 8))]


def main():
    x, grad, window = stem_pool_inputs(torch.Generator(device="cuda").manual_seed(0))
    y, arg = triton_ops.max_pool(x, *window)
    copy = torch.empty_like(x)
    copy_gbps = 2 * x.numel() * 2 / graph_ms(lambda: copy.copy_(x)) / 1e6
    nbytes = pool_pass_bytes(x, y)
    passes = {"POOL_FORWARD": lambda: triton_ops.max_pool(x, *window),
              "POOL_BACKWARD": lambda: triton_ops.max_pool_backward(grad, arg, list(x.shape), True, *window)}
    pool, positions = torch.compile(lambda x: F.max_pool2d(x, *window)), torch.compile(reference.max_pool)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; a copy moves {copy_gbps:.0f} GB/s; "
          f"inductor's max_pool2d {graph_ms(lambda: pool(x)):.4f} ms, reference.max_pool "
          f"{graph_ms(lambda: positions(x, *window)):.4f} ms", flush=True)
    if not all(torch.equal(a, b) for a, b in zip(positions(x, *window), (y, arg))):
        raise AssertionError("inductor's max_pool differs from the kernel's")
    for tiles, step in passes.items():
        now, times = getattr(triton_ops, tiles), {}
        for config in CONFIGS:
            setattr(triton_ops, tiles, config)
            times[config] = graph_ms(step)
            print(f"  {tiles} {config}: {times[config]:.4f} ms, {nbytes / times[config] / 1e6:.0f} GB/s", flush=True)
        setattr(triton_ops, tiles, now)
        best = min(times, key=times.get)
        print(f"{tiles}: now {times[now] if now in times else graph_ms(step):.4f} ms; best {times[best]:.4f} at {best}; "
              f"floor at the copy's rate {nbytes / copy_gbps / 1e6:.4f}")


if __name__ == "__main__":
    main()
