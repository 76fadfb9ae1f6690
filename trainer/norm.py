"""BatchNorm whose statistics and backward come from the run's kernels, with the ReLU that
follows it in a ResNet block, and the block's residual add, folded in. Under compile=true
inductor compiles BatchNorm's channel reductions (the statistics, and backward's sums) at
about half the device's bandwidth; the kernels' passes come closer to it (up to 1.9x
faster at ResNet-50's shapes), and backward finds the ReLU's mask again from the
BatchNorm input it keeps anyway. There the normalization stays plain torch, so that
inductor fuses it with the ReLU and residual add around it (docs/BENCHMARKS.md, "Session
I"). Without compile the Triton kernels normalize, add and apply the ReLU in one pass,
where ATen's BatchNorm, add and ReLU take three; there a block's shortcut hands its
gradient to the BatchNorm before the block (_NormalizedBatchNorm says why), and the
stem's BatchNorm, ReLU and max-pool are one pass."""
import sys

import torch
from torch import nn
from torch.nn.modules.utils import _pair

from kernels.reference import memory_format
from trainer import models
from trainer.binding import norm_output
from trainer.errors import PlanError
from trainer.pooling import MaxPool2d, MeanPool2d


class _BatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, relu, backward):
        ctx.save_for_backward(x, weight, bias, mean, invstd)
        ctx.relu, ctx.backward = relu, backward
        scale = weight * invstd
        shift = bias - mean * scale
        y = x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)  # in fp32 for half x
        y = torch.relu(y) if relu else y
        # no .to() that changes nothing: torch 2.11 compiles a Function whose output is
        # such an alias with every gradient zero
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, mean, invstd = ctx.saved_tensors
        grad_x, grad_weight, grad_bias = ctx.backward(grad_out, x, mean, invstd, weight, bias, ctx.relu)
        return grad_x, grad_weight.to(weight.dtype), grad_bias.to(bias.dtype), None, None, None, None


class _NormalizedBatchNorm(torch.autograd.Function):
    """Eager training's BatchNorm: the normalization, the residual add and the ReLU in one
    pass of the kernels' batch_norm_apply. Backward finds the ReLU's mask again from x,
    or, after a residual add, reads it packed 8 channels a byte, as that pass wrote it
    (`pack`: a sixteenth of the bytes, and as much more memory), or from the output,
    which the next layer keeps anyway.

    A block's input, the output of the BatchNorm before it (the previous block's last, or
    the stem's), has two gradients: its first convolution's, and its shortcut's (the
    residual's, or the downsampling convolution's). Autograd would add the two in a pass
    of its own, and the ReLU's mask would take another. Instead the shortcut hands its
    gradient to that BatchNorm's backward node (hand_back), whose first pass adds it to
    grad_out, masks the sum and keeps it; the shortcut returns no gradient to autograd.
    The edge stays, so the node's backward still waits for the shortcut's."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, residual, relu, kernels, pack):
        y, mask = kernels.batch_norm_apply(x, mean, invstd, weight, bias, residual, relu, pack)
        ctx.save_for_backward(x, weight, bias, mean, invstd, y if mask is None and residual is not None and relu
                              else mask)
        ctx.relu, ctx.backward = relu, kernels.batch_norm_block_backward
        # where the residual's gradient goes: a new tensor with the ReLU after the add, which
        # the receiving backward may overwrite (batch_norm_block_backward)
        ctx.source = source(residual) if residual is not None and relu else None
        _awaits_shortcuts(ctx)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, mean, invstd, mask = ctx.saved_tensors
        grad_out, grad_shortcut = _output_gradients(ctx, grad_out)
        grad_x, grad_weight, grad_bias, grad_z = ctx.backward(grad_out, grad_shortcut, mask, x, mean, invstd, weight,
                                                              bias, ctx.relu)
        if ctx.source is not None:
            hand_back(ctx.source, grad_z)
        return (grad_x, grad_weight.to(weight.dtype), grad_bias.to(bias.dtype), None, None,
                grad_z if ctx.needs_input_grad[5] and ctx.source is None else None, None, None, None)


class _PooledBatchNorm(torch.autograd.Function):
    """Eager training's stem: BatchNorm, its ReLU and the max-pool after them in one pass of
    the kernels' batch_norm_max_pool, which keeps only the pool's positions. Backward is the
    pool's, then BatchNorm's, which finds the ReLU's mask again from x. The first block's
    shortcut hands its gradient here, as to a _NormalizedBatchNorm, and the pool's backward
    adds it as it gathers."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, kernels, window):
        y, arg = kernels.batch_norm_max_pool(x, mean, invstd, weight, bias, *window)
        ctx.save_for_backward(x, weight, bias, mean, invstd, arg)
        ctx.kernels, ctx.window = kernels, window
        _awaits_shortcuts(ctx)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, mean, invstd, arg = ctx.saved_tensors
        grad_out, grad_shortcut = _output_gradients(ctx, grad_out)
        grad_y = ctx.kernels.max_pool_backward(grad_out, arg, list(x.shape), memory_format(x) == torch.channels_last,
                                               *ctx.window, grad_shortcut)
        grad_x, grad_weight, grad_bias = ctx.kernels.batch_norm_backward(grad_y, x, mean, invstd, weight, bias, True)
        return grad_x, grad_weight.to(weight.dtype), grad_bias.to(bias.dtype), None, None, None, None


def source(t: torch.Tensor):
    """The backward node of the _NormalizedBatchNorm or _PooledBatchNorm whose output t is,
    which takes a shortcut's gradient (hand_back), or None."""
    return t.grad_fn if isinstance(t.grad_fn, (_NormalizedBatchNorm._backward_cls,
                                               _PooledBatchNorm._backward_cls)) else None


def _awaits_shortcuts(ctx):
    """Make ctx's node one that shortcuts hand their gradients to (hand_back); autograd then
    passes None for an output gradient that no reader gave it."""
    ctx.grad_shortcut = None
    ctx.set_materialize_grads(False)


def _output_gradients(ctx, grad_out):
    """(grad_out, what shortcuts handed back or None), which ctx gives up; where every reader
    of the output handed its gradient back, that is grad_out."""
    grad_shortcut, ctx.grad_shortcut = ctx.grad_shortcut, None
    return (grad_shortcut, None) if grad_out is None else (grad_out, grad_shortcut)


def hand_back(node, grad: torch.Tensor):
    """Leave grad, a new tensor, for node's backward, which adds it to its output's gradient."""
    node.grad_shortcut = grad if node.grad_shortcut is None else node.grad_shortcut + grad


class _HandingConvolution(torch.autograd.Function):
    """A convolution whose input's gradient goes to the BatchNorm that made the input
    (_NormalizedBatchNorm says why), as aten's convolution_backward computes it."""

    @staticmethod
    def forward(ctx, x, weight, conv, node):
        ctx.save_for_backward(x, weight)
        ctx.conv, ctx.node = conv, node
        return conv._conv_forward(x, weight, None)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        c = ctx.conv
        grad_x, grad_weight, _ = torch.ops.aten.convolution_backward(
            grad_out, x, weight, None, c.stride, c.padding, c.dilation, False, [0, 0], c.groups,
            [True, ctx.needs_input_grad[1], False])
        hand_back(ctx.node, grad_x)
        return None, grad_weight, None, None


class ShortcutConv2d(nn.Conv2d):
    """A block's downsampling convolution (no bias, zero padding), which in training hands
    its input's gradient to the BatchNorm that made the input, where one of
    _NormalizedBatchNorm did."""

    def forward(self, x):
        node = source(x) if self.training and torch.is_grad_enabled() else None
        return super().forward(x) if node is None else _HandingConvolution.apply(x, self.weight, self, node)


class BatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d (affine, running statistics with a momentum), plus a residual where
    one is given, then a ReLU when `self.relu`. In training the statistics (and the running
    statistics' update) are `self.kernels`'s and so is backward; the normalization is
    theirs too when `self.normalize` (eager training), else torch ops for inductor to fuse
    with what is around them. In evaluation it is nn.BatchNorm2d's. `pool`: the window of
    the max-pool after it (a folded trainer.pooling.MaxPool2d, which passes its input
    through), which it applies after the ReLU: in eager training in one pass with the
    normalization, else as max_pool2d."""
    relu, pool = False, None

    def forward(self, x, residual=None):
        if not self.training:  # evaluation, or a frozen stem's BatchNorm
            return norm_output(super().forward(x), residual, self.relu, self.pool)
        if x.numel() <= x.shape[1]:  # as batch_norm refuses it: the unbiased variance divides by count - 1
            raise ValueError(f"BatchNorm in training needs more than 1 value per channel, got input of shape "
                             f"{list(x.shape)}")
        # the kernel also moves the running statistics, as batch_norm does; nothing here needs grad
        mean, invstd = self.kernels.batch_norm_stats_(x.detach(), self.running_statistics, self.momentum, self.eps)
        if self.num_batches_tracked is not None:  # the trainer's binding drops it: the step counts
            self.num_batches_tracked.add_(1)
        if self.pool is not None:
            return _PooledBatchNorm.apply(x, self.weight, self.bias, mean, invstd, self.kernels, self.pool)
        if self.normalize:
            return _NormalizedBatchNorm.apply(x, self.weight, self.bias, mean, invstd, residual, self.relu,
                                              self.kernels, self.pack_masks)
        # backward finds the ReLU's mask again from x only where no residual add comes before it
        y = _BatchNorm.apply(x, self.weight, self.bias, mean, invstd, self.relu and residual is None,
                             self.kernels.batch_norm_backward)
        if residual is None:
            return y
        return torch.relu(y + residual) if self.relu else y + residual


class CifarBlock(models.BasicBlock):
    """The CIFAR ResNet's block, with each BatchNorm applying the ReLU after it, and bn2 the
    residual add."""

    def forward(self, x):
        return self.bn2(self.conv2(self.bn1(self.conv1(x))), self.shortcut(x))


# block class -> (its fused twin, the BatchNorms whose ReLU (and residual add) the twin leaves to them)
_FUSED = {models.BasicBlock: (CifarBlock, ("bn1", "bn2"))}


def use_batch_norm_kernels(model: nn.Module, kernels, normalize: bool = False, pack_masks: bool = True) -> int:
    """Give the model's nn.BatchNorm2d modules the kernels' statistics and backward, and
    with `normalize` their normalization too (for eager training: without inductor to fuse
    it); fold each ReLU that a ResNet block (or torchvision's stem) applies right after one,
    and each block's residual add, into it; with `normalize`, a block's downsampling
    convolution becomes a ShortcutConv2d, the stem's max-pool (trainer.pooling's) goes
    into its BatchNorm, a mean-pool to (1, 1) becomes a MeanPool2d, and `pack_masks` says
    whether a block-end BatchNorm keeps its ReLU's mask packed (_NormalizedBatchNorm).
    Returns how many BatchNorms."""
    # torchvision's blocks only where torchvision is loaded, as a model of them loaded it
    torchvision = sys.modules.get("torchvision")
    fused = _FUSED
    if torchvision is not None:
        from trainer.torchvision_blocks import FUSED
        fused = {**FUSED, **_FUSED}
    swapped = 0
    for m in model.modules():
        if type(m) is nn.BatchNorm2d and m.affine and m.track_running_stats and m.momentum is not None:
            m.__class__, m.kernels, m.normalize, m.pack_masks = BatchNorm2d, kernels, normalize, pack_masks
            swapped += 1
            m.running_statistics = running_statistics(m)
        elif normalize and type(m) is nn.AdaptiveAvgPool2d and _pair(m.output_size) == (1, 1):
            m.__class__ = MeanPool2d
    for m in model.modules():
        twin, norms = fused.get(type(m), (None, ()))
        if twin is not None and all(type(getattr(m, n)) is BatchNorm2d for n in norms):
            m.__class__ = twin
            for n in norms:
                getattr(m, n).relu = True
            # torchvision's downsample (or None), the CIFAR block's shortcut (empty: the identity)
            shortcut = getattr(m, "downsample", None) or getattr(m, "shortcut", None)
            conv = shortcut[0] if shortcut else None
            if normalize and type(conv) is nn.Conv2d and conv.bias is None and conv.padding_mode == "zeros":
                conv.__class__ = ShortcutConv2d
    resnet = torchvision is not None and type(model) is torchvision.models.ResNet
    if resnet and type(model.bn1) is BatchNorm2d and type(model.relu) is nn.ReLU:
        model.bn1.relu, model.relu = True, nn.Identity()
        if normalize and type(model.maxpool) is MaxPool2d:  # the normalized stem is never written
            model.bn1.pool, model.maxpool.folded = model.maxpool.window(), True
    return swapped


def running_statistics(bn: nn.BatchNorm2d) -> torch.Tensor:
    """bn's running mean and variance as the rows of one (2, C) tensor, which the statistics
    kernel moves in place: a view over their two arena slots once bind() has put them there,
    else a new tensor whose rows become bn's running_mean and running_var. One tensor
    because inductor moves only one of an op's mutated inputs per storage in place: given
    the two slots of the arena's one storage, it cloned the arena from its start to the
    second slot and copied that slot back, two kernels a BatchNorm (and torch 2.11's clone
    read from the slot instead of the storage's start, so the running variances came out
    wrong). Made after bind(), over B_NEXT, which evaluation points BatchNorm away from and
    back to (use_statistics)."""
    mean, var = bn.running_mean, bn.running_var
    if var.untyped_storage().data_ptr() != mean.untyped_storage().data_ptr():
        both = torch.stack((mean, var))
        bn.running_mean, bn.running_var = both
        return both
    gap = var.storage_offset() - mean.storage_offset()
    if gap < len(mean):  # a copy would leave the arena's slots behind: training would move the copy
        raise PlanError(f"a BatchNorm's running variance must lie after its running mean in the arena, "
                        f"{gap} elements apart is fewer than its {len(mean)} channels")
    return mean.as_strided((2, len(mean)), (gap, 1))
