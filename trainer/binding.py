"""bind(): make a model compute in the arena. Parameters, gradients and BN statistics
become arena views, initialized from the model's own values."""
import torch
from torch import nn
from torch.nn import functional as F

from trainer.arena import Arena
from trainer.errors import PlanError
from trainer.planner import ModelTensors, first_conv


class HalfLinear(nn.Linear):
    """Under AMP the weight is a half view (A region) while the bias stays an fp32 master
    (no half bias region exists): the bias is cast in the forward pass, a tiny op that
    autograd carries back to the fp32 gradient."""

    def forward(self, x):
        return F.linear(x, self.weight, None if self.bias is None else self.bias.to(x.dtype))


def bind(model: nn.Module, tensors: ModelTensors, arena: Arena) -> nn.Module:
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, t in tensors.params.items():
            p = params[name]
            master = arena[t.w]
            master.copy_(p)
            for twin in (t.a, t.e, t.e16):
                if twin is not None:
                    arena[twin].copy_(master)
            # Autograd sees the tensor the forward pass computes with: the half copy under
            # AMP, else the master. Its preset .grad makes backward accumulate in place.
            p.data = arena[t.a if t.a is not None else t.w]
            p.grad = arena[t.g]
        for name, s in tensors.bn.items():
            bn = modules[name]
            for view, value in ((s.next_mean, bn.running_mean), (s.next_var, bn.running_var),
                                (s.prev_mean, bn.running_mean), (s.prev_var, bn.running_var)):
                arena[view].copy_(value)
            # Training updates NEXT; the count is the trainer's step, so no per-layer counter.
            bn.num_batches_tracked = None
        use_statistics(model, tensors, arena, "next")
    if arena.plan.config.amp:
        for m in model.modules():
            if type(m) is nn.Linear:
                m.__class__ = HalfLinear
        stem = first_conv(model)
        if type(stem) is not nn.Conv2d:
            raise PlanError(f"under AMP the first conv reads the 4-channel input buffer, which needs a plain "
                            f"nn.Conv2d, not {type(stem).__name__}")
        stem.__class__ = PaddedInputConv2d
    return model


class GradientHandover:
    """Backward without a preset .grad: autograd keeps each gradient it computes as it is, and
    one foreach copy per dtype then puts them all in the arena's G regions. With .grad preset
    to the arena slot (as bind() leaves it), autograd adds each gradient into it: one kernel
    per parameter (161 for ResNet-50), each ~1.5 us of a step on an H200. A parameter that
    got no gradient (frozen) keeps its slot as clear_grads left it. A step that needs the
    slots preset in backward (a gradient sync) calls restore() before it: gather() then
    has nothing to copy."""

    def __init__(self, model: nn.Module, tensors: ModelTensors, arena: Arena):
        self.slots: dict[torch.dtype, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        for name, p in model.named_parameters():
            grad = arena[tensors.params[name].g]
            self.slots.setdefault(grad.dtype, []).append((p, grad))

    def release(self):
        for pairs in self.slots.values():
            for p, _ in pairs:
                p.grad = None

    def gather(self):
        for pairs in self.slots.values():
            done = [(slot, p.grad) for p, slot in pairs if p.grad is not None and p.grad is not slot]
            if done:
                torch._foreach_copy_([slot for slot, _ in done], [grad for _, grad in done])
        self.restore()

    def restore(self):
        """Each .grad its arena slot again, as bind() left it."""
        for pairs in self.slots.values():
            for p, slot in pairs:
                p.grad = slot


class PaddedInputConv2d(nn.Conv2d):
    """The first conv under AMP reads the input buffer as the arena holds it: 4 channels,
    the 4th zero (the slot rule's padding). Its weight gets a zero 4th input channel in the
    forward pass (a few KB), which gives the same output and the same gradient for the 3
    real channels. Reading 3 of the 4 channels instead made cuDNN copy the whole batch into
    a packed tensor every step, and keep that copy for backward."""

    def _conv_forward(self, x, weight, bias):
        missing = x.shape[1] - weight.shape[1]
        return super()._conv_forward(x, F.pad(weight, (0, 0, 0, 0, 0, missing)) if missing else weight, bias)


def norm_output(y, residual, relu: bool, pool):
    """What a BatchNorm of trainer.norm applies after normalizing outside its training
    pass: the residual add, the ReLU, and the stem's max-pool (`pool`: its window, or None)."""
    y = y if residual is None else y + residual
    y = torch.relu(y) if relu else y
    return y if pool is None else F.max_pool2d(y, *pool)


class FoldedForward:
    """A BatchNorm folded for evaluation: x * scale + bias, from the W_EQ regions, then what
    a BatchNorm of trainer.norm applies after it (norm_output)."""

    def __init__(self, scale: torch.Tensor, bias: torch.Tensor, relu: bool, pool):
        self.scale, self.bias, self.relu, self.pool = scale.view(1, -1, 1, 1), bias.view(1, -1, 1, 1), relu, pool

    def __call__(self, x, residual=None):
        return norm_output(torch.addcmul(self.bias.to(x.dtype), x, self.scale.to(x.dtype)), residual, self.relu,
                           self.pool)


def use_statistics(model: nn.Module, tensors: ModelTensors, arena: Arena, which: str):
    """Point BatchNorm at B_NEXT (what training updates), B_PREV (the rank-averaged copy
    that evaluation reads) or "folded": evaluation through W_EQ, each BatchNorm computing
    x * scale + bias with what FOLD_BN made of B_PREV and the BN weights. A captured graph
    keeps the addresses it was captured with."""
    modules = dict(model.named_modules())
    for name, s in tensors.bn.items():
        bn = modules[name]
        if isinstance(bn.__dict__.get("forward"), FoldedForward):
            del bn.forward
        if which == "folded":
            # the same object each time: under compile=true the compiled evaluation holds on
            # to it, and a new one would make each evaluation compile again (and after eight
            # times, run uncompiled)
            if "folded_forward" not in bn.__dict__:
                bn.folded_forward = FoldedForward(arena[s.eq_scale], arena[s.eq_bias], getattr(bn, "relu", False),
                                                  getattr(bn, "pool", None))
            bn.forward = bn.folded_forward
            continue
        mean, var = (s.next_mean, s.next_var) if which == "next" else (s.prev_mean, s.prev_var)
        bn.running_mean, bn.running_var = arena[mean], arena[var]
