"""Where a ResNet's convolution time goes, layer by layer: each convolution's forward,
input gradient (dgrad) and weight gradient (wgrad) timed on its own at the model's shapes,
fp16, channels-last, cuDNN autotuned as the trainer's warm-up leaves it, in CUDA graphs
of 10 calls, with the rate each reaches in TFLOP/s (the H200's dense fp16 peak: 989).
The stem's input has 4 channels, as the trainer pads it; it needs no dgrad.

    python bench/conv_probe.py [resnet18_cifar | resnet50] [batch]   # the 32x32 ResNet-18 (3x3 stem, no
                                                                      # max-pool), batch 512; or ResNet-50's
"""
import sys

import torch
import torch.nn.functional as F

DEVICE = torch.device("cuda")
aten = torch.ops.aten


def timed(fn, reps: int = 10, rounds: int = 7) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(), fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2]


def resnet18_cifar():
    """(name, count, in channels, out channels, kernel, stride, input size, needs dgrad)"""
    yield "stem 3x3", 1, 4, 64, 3, 1, 32, False
    yield "stage1 3x3", 4, 64, 64, 3, 1, 32, True
    for width, size in ((128, 32), (256, 16), (512, 8)):
        yield f"{width} 3x3 s2", 1, width // 2, width, 3, 2, size, True
        yield f"{width} 3x3", 3, width, width, 3, 1, size // 2, True
        yield f"{width} 1x1 s2", 1, width // 2, width, 1, 2, size, True


def resnet50():
    """torchvision's: the stride in each stage's first 3x3 convolution."""
    yield "stem 7x7 s2", 1, 4, 64, 7, 2, 224, False
    cin = 64
    for width, size, blocks in ((64, 56, 3), (128, 28, 4), (256, 14, 6), (512, 7, 3)):
        stride = 1 if width == 64 else 2
        yield f"{width} first 1x1 in", 1, cin, width, 1, 1, size * stride, True
        yield f"{width} first 3x3" + (" s2" if stride > 1 else ""), 1, width, width, 3, stride, size * stride, True
        yield f"{width} shortcut 1x1" + (" s2" if stride > 1 else ""), 1, cin, 4 * width, 1, stride, size * stride, True
        yield f"{width} 1x1 in", blocks - 1, 4 * width, width, 1, 1, size, True
        yield f"{width} 3x3", blocks - 1, width, width, 3, 1, size, True
        yield f"{width} 1x1 out", blocks, width, 4 * width, 1, 1, size, True
        cin = 4 * width


def main(model: str, batch: int):
    torch.backends.cudnn.benchmark = True
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}, "
          f"{model}, batch {batch}, fp16, channels-last; ms per call (times the layer's count in the totals)")
    print("| layer | count | forward | dgrad | wgrad | TFLOP/s fwd / dgrad / wgrad |")
    print("|---|---|---|---|---|---|")
    totals = [0.0, 0.0, 0.0]
    for name, count, cin, cout, k, stride, size, dgrad in {"resnet18_cifar": resnet18_cifar, "resnet50": resnet50}[model]():
        x = torch.randn(batch, cin, size, size, device=DEVICE, dtype=torch.half).to(memory_format=torch.channels_last)
        w = torch.randn(cout, cin, k, k, device=DEVICE, dtype=torch.half).to(memory_format=torch.channels_last)
        y = F.conv2d(x, w, stride=stride, padding=k // 2)
        g = torch.randn_like(y)
        args = (None, (stride, stride), (k // 2, k // 2), (1, 1), False, (0, 0), 1)
        ms = [timed(lambda: F.conv2d(x, w, stride=stride, padding=k // 2)),
              timed(lambda: aten.convolution_backward(g, x, w, *args, (True, False, False))) if dgrad else 0.0,
              timed(lambda: aten.convolution_backward(g, x, w, *args, (False, True, False)))]
        flops = 2 * y.numel() * cin * k * k
        rates = " / ".join(f"{flops / (t * 1e-3) / 1e12:.0f}" if t else "-" for t in ms)
        print(f"| {name} | {count} | " + " | ".join(f"{t:.3f}" for t in ms) + f" | {rates} |")
        totals = [a + count * t for a, t in zip(totals, ms)]
    print(f"| all | | {totals[0]:.3f} | {totals[1]:.3f} | {totals[2]:.3f} | sum {sum(totals):.3f} ms |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "resnet18_cifar", int(sys.argv[2]) if len(sys.argv) > 2 else 512)
