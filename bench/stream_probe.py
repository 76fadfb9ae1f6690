"""Would running the weight gradients on a second stream pay? The backward pass of the
32x32 ResNet-18 (or ResNet-50) at the trainer's shapes, fp16 and channels-last, as a
chain of its convolutions' dgrad, wgrad and the BatchNorm+ReLU backward (the trainer's
Triton kernel) of each convolution's input, captured in a CUDA graph and timed three ways:

  one stream:  dgrad, wgrad, BatchNorm backward, layer after layer (what the step does now);
  per layer:   each wgrad on a side stream, forked when its output gradient is ready and
               joined before the next layer's dgrad (what a trainer can do while autograd
               frees each layer's tensors after its backward);
  at the end:  every wgrad on the side stream, joined once at the end (the bound).

Only the ordering is real: each layer reads its own random tensors, so the timings are
those of the kernels and their overlap, not of a trained network.

    python bench/stream_probe.py [batch] [resnet18_cifar | resnet50]

On an H200 it gained nothing at ResNet-18 b512 and ResNet-50 b256 (docs/BENCHMARKS.md, "Session S").
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernels_bench import graph_ms  # noqa: E402
from kernels import triton_ops  # noqa: E402

DEVICE = torch.device("cuda")


def resnet18_cifar():
    """(in channels, out channels, kernel, stride, input size) of each convolution."""
    convs = [(4, 64, 3, 1, 32)]
    for cin, cout, hw, stride in ((64, 64, 32, 1), (64, 128, 32, 2), (128, 256, 16, 2), (256, 512, 8, 2)):
        convs += [(cin, cout, 3, stride, hw), (cout, cout, 3, 1, hw // stride)]
        convs += [(cin, cout, 1, stride, hw)] if stride > 1 else []
        convs += [(cout, cout, 3, 1, hw // stride)] * 2
    return convs


def resnet50():
    convs, cin, hw = [(4, 64, 7, 2, 224)], 64, 56
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            s = stride if b == 0 else 1
            convs += [(cin, width, 1, 1, hw), (width, width, 3, s, hw), (width, width * 4, 1, 1, hw // s)]
            convs += [(cin, width * 4, 1, s, hw)] if b == 0 else []
            cin, hw = width * 4, hw // s
    return convs


MODELS = {"resnet18_cifar": resnet18_cifar, "resnet50": resnet50}


class Layer:
    def __init__(self, n, cin, cout, k, stride, hw):
        half = dict(device=DEVICE, dtype=torch.float16)
        out = (hw + 2 * (k // 2) - k) // stride + 1
        self.args = ([stride] * 2, [k // 2] * 2, [1, 1], False, [0, 0], 1)
        self.x = torch.randn(n, cin, hw, hw, **half).to(memory_format=torch.channels_last)
        self.gy = torch.randn(n, cout, out, out, **half).to(memory_format=torch.channels_last)
        self.w = (torch.randn(cout, cin, k, k, **half) * 0.05).to(memory_format=torch.channels_last)
        self.first = cin == 4  # the stem reads the input: no dgrad, no BatchNorm before it
        c = torch.ones(cin, device=DEVICE)
        self.stats = (c * 0.1, c, c, c * 0.1)  # mean, invstd, weight, bias of the BatchNorm before it

    def dgrad(self):
        if not self.first:
            gx = torch.ops.aten.convolution_backward(self.gy, self.x, self.w, None, *self.args,
                                                     [True, False, False])[0]
            mean, invstd, weight, bias = self.stats
            triton_ops.batch_norm_backward(gx, self.x, mean, invstd, weight, bias, True)

    def wgrad(self):
        return torch.ops.aten.convolution_backward(self.gy, self.x, self.w, None, *self.args, [False, True, False])[1]


def backward(layers, side: torch.cuda.Stream | None, join_each: bool):
    main = torch.cuda.current_stream()
    pending = None
    for layer in reversed(layers):
        if side is None:
            layer.dgrad()
            layer.wgrad()
            continue
        if join_each and pending is not None:
            main.wait_event(pending)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            layer.wgrad()
            pending = torch.cuda.Event()
            pending.record(side)
        layer.dgrad()
    if side is not None:
        main.wait_stream(side)


def main(batch: int, model: str):
    torch.backends.cudnn.benchmark = True
    layers = [Layer(batch, *conv) for conv in MODELS[model]()]
    side = torch.cuda.Stream()
    one = graph_ms(lambda: backward(layers, None, False))
    per_layer = graph_ms(lambda: backward(layers, side, True))
    at_end = graph_ms(lambda: backward(layers, side, False))
    wgrad_only = graph_ms(lambda: [layer.wgrad() for layer in layers])
    rest = graph_ms(lambda: [layer.dgrad() for layer in layers])
    print(f"{model} b{batch}, {len(layers)} convolutions, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"| schedule | backward ms |\n|---|---|\n| one stream | {one:.3f} |\n"
          f"| wgrad on a side stream, joined per layer | {per_layer:.3f} |\n"
          f"| wgrad on a side stream, joined at the end | {at_end:.3f} |\n"
          f"| wgrads alone | {wgrad_only:.3f} |\n| dgrads and BatchNorm backwards alone | {rest:.3f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 512, sys.argv[2] if len(sys.argv) > 2 else "resnet18_cifar")
