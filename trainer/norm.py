"""BatchNorm whose statistics and backward come from the run's kernels, with the ReLU that
follows it in a ResNet block, and the block's residual add, folded in. Under compile=true
inductor compiles BatchNorm's channel reductions (the statistics, and backward's sums) at
about half the device's bandwidth; the kernels' passes come closer to it (up to 1.9x
faster at ResNet-50's shapes), and backward finds the ReLU's mask again from the
BatchNorm input it keeps anyway. There the normalization stays plain torch, so that
inductor fuses it with the ReLU and residual add around it (docs/BENCHMARKS.md, "Session
I"). Without compile the Triton kernels normalize, add and apply the ReLU in one pass,
where ATen's BatchNorm, add and ReLU take three."""
import torch
import torchvision
from torch import nn

from trainer import models
from trainer.errors import PlanError


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
    or, after a residual add, from the output, which the next layer keeps anyway.

    A block whose shortcut is the identity adds its input, the output of the BatchNorm
    that ends the block before it, as its residual; that input's gradient is the sum of
    the residual's and the block's first convolution's. Autograd would add the two in a
    pass of its own, and mask the sum in another: here the residual comes detached, and
    its gradient goes to that BatchNorm's backward node (`source`), whose first pass adds
    it to grad_out, masks the sum and keeps it. The node's backward runs after this one:
    it waits for the first convolution's gradient, which comes after this BatchNorm's."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, residual, relu, kernels, source):
        y = kernels.batch_norm_apply(x, mean, invstd, weight, bias, residual, relu)
        ctx.save_for_backward(x, weight, bias, mean, invstd, y if residual is not None and relu else None)
        ctx.relu, ctx.backward, ctx.source = relu, kernels.batch_norm_block_backward, source
        ctx.grad_shortcut = None  # where a later block hands back its shortcut's gradient
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, mean, invstd, y = ctx.saved_tensors
        grad_shortcut, ctx.grad_shortcut = ctx.grad_shortcut, None
        grad_x, grad_weight, grad_bias, grad_z = ctx.backward(grad_out, grad_shortcut, y, x, mean, invstd, weight,
                                                              bias, ctx.relu)
        if ctx.source is not None:
            ctx.source.grad_shortcut = grad_z if ctx.source.grad_shortcut is None else ctx.source.grad_shortcut + grad_z
        return (grad_x, grad_weight.to(weight.dtype), grad_bias.to(bias.dtype), None, None,
                grad_z if ctx.needs_input_grad[5] else None, None, None, None)


class BatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d (affine, running statistics with a momentum), plus a residual where
    one is given, then a ReLU when `self.relu`. In training the statistics (and the running
    statistics' update) are `self.kernels`'s and so is backward; the normalization is
    theirs too when `self.normalize` (eager training), else torch ops for inductor to fuse
    with what is around them. In evaluation it is nn.BatchNorm2d's. `identity_shortcut`:
    the residual is the block's input, which the block's first convolution reads too."""
    relu = identity_shortcut = False

    def forward(self, x, residual=None):
        if not self.training:
            y = super().forward(x)
            y = y if residual is None else y + residual
            return torch.relu(y) if self.relu else y
        if x.numel() <= x.shape[1]:  # as batch_norm refuses it: the unbiased variance divides by count - 1
            raise ValueError(f"BatchNorm in training needs more than 1 value per channel, got input of shape "
                             f"{list(x.shape)}")
        # the kernel also moves the running statistics, as batch_norm does; nothing here needs grad
        mean, invstd = self.kernels.batch_norm_stats_(x.detach(), self.running_statistics, self.momentum, self.eps)
        if self.num_batches_tracked is not None:  # the trainer's binding drops it: the step counts
            self.num_batches_tracked.add_(1)
        if self.normalize:
            source = residual.grad_fn if self.identity_shortcut and residual is not None else None
            if isinstance(source, _NormalizedBatchNorm._backward_cls):
                residual = residual.detach()  # its gradient goes to source (_NormalizedBatchNorm says why)
            else:
                source = None
            return _NormalizedBatchNorm.apply(x, self.weight, self.bias, mean, invstd, residual, self.relu,
                                              self.kernels, source)
        # backward finds the ReLU's mask again from x only where no residual add comes before it
        y = _BatchNorm.apply(x, self.weight, self.bias, mean, invstd, self.relu and residual is None,
                             self.kernels.batch_norm_backward)
        if residual is None:
            return y
        return torch.relu(y + residual) if self.relu else y + residual


class Bottleneck(torchvision.models.resnet.Bottleneck):
    """torchvision's, with each BatchNorm applying the ReLU after it, and bn3 the residual add."""

    def forward(self, x):
        out = self.conv3(self.bn2(self.conv2(self.bn1(self.conv1(x)))))
        return self.bn3(out, x if self.downsample is None else self.downsample(x))


class BasicBlock(torchvision.models.resnet.BasicBlock):
    """torchvision's, with each BatchNorm applying the ReLU after it, and bn2 the residual add."""

    def forward(self, x):
        return self.bn2(self.conv2(self.bn1(self.conv1(x))), x if self.downsample is None else self.downsample(x))


class CifarBlock(models.BasicBlock):
    """The CIFAR ResNet's block, with each BatchNorm applying the ReLU after it, and bn2 the
    residual add."""

    def forward(self, x):
        return self.bn2(self.conv2(self.bn1(self.conv1(x))), self.shortcut(x))


# block class -> (its fused twin, the BatchNorms whose ReLU (and residual add) the twin leaves to them)
_FUSED = {torchvision.models.resnet.Bottleneck: (Bottleneck, ("bn1", "bn2", "bn3")),
          torchvision.models.resnet.BasicBlock: (BasicBlock, ("bn1", "bn2")),
          models.BasicBlock: (CifarBlock, ("bn1", "bn2"))}


def use_batch_norm_kernels(model: nn.Module, kernels, normalize: bool = False) -> int:
    """Give the model's nn.BatchNorm2d modules the kernels' statistics and backward, and
    with `normalize` their normalization too (for eager training: without inductor to fuse
    it); fold each ReLU that a ResNet block (or torchvision's stem) applies right after one,
    and each block's residual add, into it. Returns how many BatchNorms."""
    swapped = 0
    for m in model.modules():
        if type(m) is nn.BatchNorm2d and m.affine and m.track_running_stats and m.momentum is not None:
            m.__class__, m.kernels, m.normalize = BatchNorm2d, kernels, normalize
            swapped += 1
            m.running_statistics = running_statistics(m)
    for m in model.modules():
        twin, norms = _FUSED.get(type(m), (None, ()))
        if twin is not None and all(type(getattr(m, n)) is BatchNorm2d for n in norms):
            m.__class__ = twin
            for n in norms:
                getattr(m, n).relu = True
            # torchvision's blocks have a downsample or None, the CIFAR block a shortcut, empty or not
            getattr(m, norms[-1]).identity_shortcut = getattr(m, "downsample", None) is None and not len(
                getattr(m, "shortcut", ()))
    if type(model) is torchvision.models.ResNet and type(model.bn1) is BatchNorm2d and type(model.relu) is nn.ReLU:
        model.bn1.relu, model.relu = True, nn.Identity()
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
