"""Max-pooling that keeps, for its backward, each window's maximum as an int8 position in
the window (kernels' max_pool) instead of max_pool2d's int64 indices or the pooled input.
ResNet-50's stem pool at batch 256 would keep 411 MB of indices, or its 411 MB fp16 input;
the positions take 51 MB, and the backward (kernels' max_pool_backward) reads them and
grad_out and writes the input's gradient in one pass. ATen's or inductor's backward, which
read the indices, took 1.6-1.8 ms of a 36-54 ms step (docs/BENCHMARKS.md)."""
import torch
from torch import nn
from torch.nn.modules.utils import _pair

from kernels.reference import memory_format


class _MaxPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pool, backward, kernel, stride, padding):
        y, arg = pool(x, kernel, stride, padding)
        ctx.save_for_backward(arg)
        ctx.backward, ctx.window = backward, (kernel, stride, padding)
        ctx.input = (list(x.shape), memory_format(x) == torch.channels_last)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        arg, = ctx.saved_tensors
        return ctx.backward(grad_out, arg, *ctx.input, *ctx.window), None, None, None, None, None


class MaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d (no dilation, floor mode) computed by `self.pool_kernel`, whose
    positions `self.backward_kernel` reads. `folded`: the BatchNorm before it pools
    (trainer.norm), and it passes its input through."""
    folded = False

    def forward(self, x):
        if self.folded:
            return x
        return _MaxPool.apply(x, self.pool_kernel, self.backward_kernel, *self.window())

    def window(self) -> tuple[list[int], list[int], list[int]]:
        """(kernel, stride, padding), each as [height, width]."""
        stride = self.stride if self.stride else self.kernel_size  # nn.MaxPool2d's default
        return list(_pair(self.kernel_size)), list(_pair(stride)), list(_pair(self.padding))


def use_max_pool_kernel(model: nn.Module, kernels) -> int:
    """Give the model's nn.MaxPool2d modules the kernels' max-pool. Returns how many."""
    swapped = 0
    for m in model.modules():
        if type(m) is nn.MaxPool2d and _pair(m.dilation) == (1, 1) and not m.ceil_mode and not m.return_indices:
            m.__class__ = MaxPool2d
            m.pool_kernel, m.backward_kernel = kernels.max_pool, kernels.max_pool_backward
            swapped += 1
    return swapped


class _MeanPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x.mean((2, 3), keepdim=True)

    @staticmethod
    def backward(ctx, grad_out):
        return (grad_out / (ctx.shape[2] * ctx.shape[3])).expand(ctx.shape)


class MeanPool2d(nn.AdaptiveAvgPool2d):
    """nn.AdaptiveAvgPool2d to (1, 1) (ATen's is the same mean), whose input's gradient is
    a value per image and channel broadcast over (H, W), not written out as ATen's mean
    backward writes it: the BatchNorm kernels' backward reads it so (trainer.norm), and
    ResNet's last block reads no whole gradient of its output."""

    def forward(self, x):
        return _MeanPool.apply(x)
