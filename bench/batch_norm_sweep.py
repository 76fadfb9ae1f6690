"""BatchNorm's reductions over all 53 of ResNet-50's BatchNorms at batch 256 (fp16,
channels-last, each layer's own tensors): inductor's compiled statistics and backward
(what compile=true ran before trainer.norm) against kernels/triton_ops at every tile
configuration of a sweep, each shape's calls timed together in one CUDA graph.

    python bench/batch_norm_sweep.py

Prints, per shape, inductor's ms and the kernels' now and at every configuration, then the
network's totals per pass (statistics; backward's sums; backward's gradient): now, with
the best configuration for each shape, and with the best single one.
"""
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernels_bench import batch_norm_inputs, graph_ms  # noqa: E402
from kernels import reference, triton_ops  # noqa: E402

# (channels, height = width): how many of ResNet-50's BatchNorms (torchvision's, the stride in
# conv2) see such an input at 224x224
SHAPES = {(64, 112): 1, (64, 56): 6, (256, 56): 4, (128, 56): 1, (128, 28): 7, (512, 28): 5, (256, 28): 1,
          (256, 14): 11, (1024, 14): 7, (512, 14): 1, (512, 7): 5, (2048, 7): 4}
BATCH = 256
PASSES = ("BN_STATS", "BN_SUMS", "BN_GRADIENT")  # the kernels' tiles for each pass
CONFIGS = [triton_ops.BnTiles(channels, elements, warps, per_sm) for channels, elements, warps, per_sm
           in itertools.product((64, 128), (4096, 8192, 16384), (4, 8), (1, 2, 4))]


def layers(c, hw, count, gen):
    """`count` layers' arguments to batch_norm_backward, each in its own memory: the step
    never finds a BatchNorm's input in L2."""
    return [batch_norm_inputs(c, hw, gen, BATCH) for _ in range(count)]


def timed(impl, inputs):
    """ms of every layer's statistics, of their backward with the ReLU, and of backward's
    first pass alone (its sums; the gradient pass is the difference)."""
    def sums():
        for g, x, m, s, w, b in inputs:
            triton_ops._bn_reduce(triton_ops._rows(x), triton_ops._rows(g), m, s, w, b, torch.empty_like(m),
                                  torch.empty_like(m), relu=True, backward=True)
    stats = graph_ms(lambda: [impl.batch_norm_stats(x) for _, x, *_ in inputs], calls=2)
    backward = graph_ms(lambda: [impl.batch_norm_backward(*args, True) for args in inputs], calls=2)
    first = graph_ms(sums, calls=2) if impl is triton_ops else 0.0
    return stats, first, backward - first


def main():
    torch._dynamo.config.recompile_limit = 64  # inductor compiles each shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    compiled = type("Compiled", (), {fn: staticmethod(torch.compile(getattr(reference, fn), dynamic=False))
                                     for fn in ("batch_norm_stats", "batch_norm_backward")})
    current = {p: getattr(triton_ops, p) for p in PASSES}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; now {current}")
    inductor, times = [0.0, 0.0], {}  # times[shape][config] = (statistics, sums, gradient) ms
    for (c, hw), count in SHAPES.items():
        inputs = layers(c, hw, count, gen)
        stats, _, backward = timed(compiled, inputs)
        inductor = [inductor[0] + stats, inductor[1] + backward]
        times[c, hw] = {}
        for config in CONFIGS + [None]:  # None: each pass as it is now
            for p in PASSES:
                setattr(triton_ops, p, current[p] if config is None else config)
            times[c, hw][config] = timed(triton_ops, inputs)
            print(f"  C={c} {hw}x{hw} {config or 'now'}: statistics {times[c, hw][config][0]:.4f} "
                  f"sums {times[c, hw][config][1]:.4f} gradient {times[c, hw][config][2]:.4f}", flush=True)
        print(f"C={c:4d} {hw:3d}x{hw:<3d} x{count:2d}: inductor statistics {stats:.3f} ms, backward {backward:.3f}; "
              f"kernels now {times[c, hw][None][0]:.3f}, {sum(times[c, hw][None][1:]):.3f}", flush=True)
        del inputs
    for p in PASSES:
        setattr(triton_ops, p, current[p])
    print(f"\nall 53 BatchNorms: inductor statistics {inductor[0]:.3f} ms, backward {inductor[1]:.3f}")
    for j, p in enumerate(PASSES):
        total = {config: sum(times[shape][config][j] for shape in times) for config in CONFIGS + [None]}
        per_shape = sum(min(times[shape][config][j] for config in CONFIGS) for shape in times)
        best = min(CONFIGS, key=total.get)
        print(f"{p}: now {total[None]:.3f} ms; best per shape {per_shape:.3f}; best single {total[best]:.3f} at {best}")


if __name__ == "__main__":
    main()
