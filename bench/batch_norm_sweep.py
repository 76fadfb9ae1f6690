"""BatchNorm's passes over all 53 of ResNet-50's BatchNorms at 224x224, batch 256 (or the 20
of the 32x32 CIFAR ResNet-18's at batch 512 with --model resnet18_cifar; or --batch N;
fp16, channels-last, each layer's own tensors), each shape's calls timed together in one
CUDA graph: the kernels of kernels/triton_ops at every tile configuration of a sweep, and
with --inductor, inductor's compiled statistics and backward (what compile=true ran before
trainer.norm).

    python bench/batch_norm_sweep.py [--model resnet50|resnet18_cifar] [--batch N] [--inductor]
        [--passes statistics,sums,gradient,normalize]

Each pass (the statistics; backward's sums; its gradient; eager training's
normalization, timed with a residual add and the ReLU, as a block's last BatchNorm runs
it) is swept over the same configurations. Prints, per shape, each configuration's ms, then the network's
totals per pass: now, with the best configuration for each shape, and with the best
single one.
"""
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernels_bench import batch_norm_inputs, graph_ms  # noqa: E402
from kernels import reference, triton_ops  # noqa: E402
from kernels.triton_ops import BnTiles  # noqa: E402

# model -> (batch, {(channels, height = width): how many of its BatchNorms see such an input});
# ResNet-50 is torchvision's (the stride in conv2) at 224x224, ResNet-18 the CIFAR one at 32x32
MODELS = {"resnet50": (256, {(64, 112): 1, (64, 56): 6, (256, 56): 4, (128, 56): 1, (128, 28): 7, (512, 28): 5,
                             (256, 28): 1, (256, 14): 11, (1024, 14): 7, (512, 14): 1, (512, 7): 5, (2048, 7): 4}),
          "resnet18_cifar": (512, {(64, 32): 5, (128, 16): 5, (256, 8): 5, (512, 4): 5})}
BATCH, SHAPES = MODELS[sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else "resnet50"]
BATCH = int(sys.argv[sys.argv.index("--batch") + 1]) if "--batch" in sys.argv else BATCH
# configurations: every combination of (channels, elements, warps, programs per SM, stages)
CONFIGS = [BnTiles(*t) for t in itertools.product((64, 128), (2048, 4096, 8192), (4, 8), (2, 4), (3,))]
# pass -> the triton_ops tiles it reads
PASSES = {"statistics": "BN_STATS", "sums": "BN_SUMS", "gradient": "BN_GRADIENT", "normalize": "BN_NORMALIZE"}
if "--passes" in sys.argv:
    PASSES = {name: PASSES[name] for name in sys.argv[sys.argv.index("--passes") + 1].split(",")}


def layers(c, hw, count, gen):
    """`count` layers' arguments to batch_norm_backward, each in its own memory: the step
    never finds a BatchNorm's input in L2."""
    return [batch_norm_inputs(c, hw, gen, BATCH) for _ in range(count)]


def sums(inputs):
    """ms of backward's first pass alone over every layer (with the ReLU)."""
    def run():
        for g, x, m, s, w, b in inputs:
            triton_ops._bn_reduce(triton_ops._rows(x), triton_ops._rows(g), m, s, w, b, torch.empty_like(m),
                                  torch.empty_like(m), relu=True, backward=True)
    return graph_ms(run, calls=2)


def statistics(impl, inputs):
    """ms of every layer's statistics, each moving running statistics of its own."""
    running = [torch.stack((m, s)) for _, _, m, s, *_ in inputs]
    return graph_ms(lambda: [impl.batch_norm_stats_(x, r, 0.1, 1e-5) for (_, x, *_), r in zip(inputs, running)],
                    calls=2)


def backward(impl, inputs):
    return graph_ms(lambda: [impl.batch_norm_backward(*args, True) for args in inputs], calls=2)


def normalize(inputs):
    """ms of every layer's normalization with a residual add (grad_out stands in for it) and the ReLU, its
    mask packed as a block's last BatchNorm writes it."""
    return graph_ms(lambda: [triton_ops.batch_norm_apply(x, m, s, w, b, g, True, True) for g, x, m, s, w, b in inputs],
                    calls=2)


def timed(name, inputs):
    """ms of one pass over every layer at triton_ops' tiles as they are set; the gradient
    pass is backward less its sums."""
    if name == "statistics":
        return statistics(triton_ops, inputs)
    if name == "normalize":
        return normalize(inputs)
    return sums(inputs) if name == "sums" else backward(triton_ops, inputs) - sums(inputs)


def main():
    torch._dynamo.config.recompile_limit = 64  # inductor compiles each shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    compiled = type("Compiled", (), {fn: staticmethod(torch.compile(getattr(reference, fn), dynamic=False))
                                     for fn in ("batch_norm_stats_", "batch_norm_backward")})
    current = {name: getattr(triton_ops, tiles) for name, tiles in PASSES.items()}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {BATCH}; now {current}")
    inductor, times = [0.0, 0.0], {}  # times[pass][shape][config] = ms; config None: as it is now
    for (c, hw), count in SHAPES.items():
        inputs = layers(c, hw, count, gen)
        if "--inductor" in sys.argv:
            inductor = [inductor[0] + statistics(compiled, inputs), inductor[1] + backward(compiled, inputs)]
        for name, tiles in PASSES.items():
            row = times.setdefault(name, {}).setdefault((c, hw), {})
            for config in CONFIGS + [None]:
                setattr(triton_ops, tiles, current[name] if config is None else config)
                row[config] = timed(name, inputs)
                print(f"  C={c} {hw}x{hw} {name} {config or 'now'}: {row[config]:.4f}", flush=True)
            setattr(triton_ops, tiles, current[name])
            best = min(CONFIGS, key=row.get)
            print(f"C={c:4d} {hw:3d}x{hw:<3d} x{count:2d} {name}: now {row[None]:.3f} ms, best {row[best]:.3f} at "
                  f"{best}", flush=True)
        del inputs
    if "--inductor" in sys.argv:
        print(f"\nall {sum(SHAPES.values())} BatchNorms: inductor statistics {inductor[0]:.3f} ms, backward {inductor[1]:.3f}")
    for name in PASSES:
        total = {config: sum(row[config] for row in times[name].values()) for config in CONFIGS + [None]}
        per_shape = sum(min(row[config] for config in CONFIGS) for row in times[name].values())
        best = min(CONFIGS, key=total.get)
        print(f"{name}: now {total[None]:.3f} ms; best per shape {per_shape:.3f}; best single {total[best]:.3f} "
              f"at {best}")


if __name__ == "__main__":
    main()
