"""Max-pooling whose backward finds each window's maximum again from the pooled input
(kernels' max_pool_backward) instead of reading the int64 indices that max_pool2d keeps.
ResNet's stem pool (3x3, stride 2) pools a ReLU output that autograd keeps anyway; the
indices take as many bytes as that fp16 input, and the backward that reads them, ATen's
or inductor's, took 1.6-1.8 ms of a 36-54 ms ResNet-50 step (docs/BENCHMARKS.md). The
Triton kernel finds the maxima in one pass and scatters in a second; the torch reference
recomputes the indices with max_pool2d."""
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.utils import _pair


class _MaxPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, backward, kernel, stride, padding):
        ctx.save_for_backward(x)
        ctx.backward, ctx.window = backward, (kernel, stride, padding)
        return F.max_pool2d(x, kernel, stride, padding)

    @staticmethod
    def backward(ctx, grad_out):
        x, = ctx.saved_tensors
        return ctx.backward(grad_out, x, *ctx.window), None, None, None, None


class MaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d (no dilation, floor mode) whose backward is `self.backward_kernel`."""

    def forward(self, x):
        stride = self.stride if self.stride else self.kernel_size  # nn.MaxPool2d's default
        return _MaxPool.apply(x, self.backward_kernel, list(_pair(self.kernel_size)), list(_pair(stride)),
                              list(_pair(self.padding)))


def use_max_pool_kernel(model: nn.Module, kernels) -> int:
    """Give the model's nn.MaxPool2d modules the kernels' backward. Returns how many."""
    swapped = 0
    for m in model.modules():
        if type(m) is nn.MaxPool2d and _pair(m.dilation) == (1, 1) and not m.ceil_mode and not m.return_indices:
            m.__class__, m.backward_kernel = MaxPool2d, kernels.max_pool_backward
            swapped += 1
    return swapped
