"""Program: the work of one step of one variant, reading one input buffer of the arena.

Calling a Program runs the step eagerly; the Executor captures the very same call into a
CUDA graph. Everything a step reads or writes lives at a fixed arena address, and the
Python decisions below (train or eval mode, which BN statistics) are fixed per Program,
so a replay does exactly what the call did.
"""
from typing import Callable

import torch
from torch import nn

from trainer import tta
from trainer.arena import Arena
from trainer.binding import GradientHandover, use_statistics
from trainer.loss import cross_entropy_
from trainer.plan import Baseline as B
from trainer.planner import ModelTensors
from trainer.range_ops import RangeOps
from trainer.variants import Variant


class Program:
    def __init__(self, variant: Variant, buffer: str, model: nn.Module, tensors: ModelTensors, arena: Arena,
                 ops: RangeOps, label_smoothing: float = 0.0, tta_level: int = 0,
                 grad_sync: Callable[[], None] | None = None, forward: nn.Module | None = None,
                 late_frozen: tuple[nn.Module, ...] = ()):
        """forward: what computes the logits, when not the bound model itself (the
        torch.compile'd model under compile=true). late_frozen: the parts that freeze after
        step 0 (the first conv, the stem's norm). A frozen variant's steps compute no gradient
        for them, so backward stops where nothing upstream trains, and run them in eval mode:
        the stem's norm normalizes with its running statistics, fixed from then on."""
        self.variant, self.buffer, self.model, self.tensors = variant, buffer, model, tensors
        self.frozen = late_frozen if variant.frozen else ()
        self.forward = model if forward is None else forward
        self.arena, self.ops = arena, ops
        self.smoothing, self.tta_level, self.grad_sync = label_smoothing, tta_level, grad_sync
        self.handover = GradientHandover(model, tensors, arena)
        # the whole input slot, channel padding included: the first conv reads it in place
        self.x = arena.view(tensors.input.data[buffer], padded=True).permute(0, 3, 1, 2)
        self.y = arena[tensors.input.label[buffer]]
        self.mask = arena[tensors.input.mask[buffer]]
        s = ops.s
        self.results = (s[B.LOSS], s[B.TOP1], s[B.TOP5])

    def __call__(self):
        if not self.variant.train:
            return self._evaluate()
        for m in self.frozen:
            m.requires_grad_(False)
        try:
            self._train()
        finally:
            for m in self.frozen:
                m.requires_grad_(True)

    def _train(self):
        ops = self.ops
        self.model.train()
        for m in self.frozen:
            m.eval()
        ops.schedule()
        ops.clear_grads()
        # released before forward, not only before backward: a compiled forward traces the
        # .grad it finds on each parameter, arena views that Dynamo traced with symbolic
        # offsets and guards (ResNet-50: 4 s of a 13 s warm set-up on a CPU)
        self.handover.release()
        try:
            self._forward_backward()
        finally:
            self.handover.gather()
        if self.grad_sync is not None:
            self.grad_sync()
        ops.grad_scaling()
        ops.stash_frozen()
        ops.update()
        # held before EMA, which then averages the frozen parts as they stay; and after it
        # with lookahead, which copies the average into the weights
        ops.hold_frozen(settled=self.variant.frozen)
        if self.arena.plan.config.ema:
            ops.ema()
            if ops.lookahead:
                ops.hold_frozen(settled=self.variant.frozen)
        ops.cast_weights()
        ops.advance()

    def _forward_backward(self):
        s, amp = self.ops.s, self.arena.plan.config.amp
        logits = self.forward(self.x)
        grad = self.arena[self.tensors.grad_slot]
        cross_entropy_(logits, self.y, self.smoothing, self.results, grad_out=grad,
                       grad_scale=s[B.LOSS_SCALE] if amp else None, nan_seen=s[B.NAN_SEEN], sums=s[B.TRAIN_SUMS])
        if self.grad_sync is not None:
            # the gradient sync reduces buckets of the arena as backward fills them: there
            # each gradient must land in its slot as it comes (the preset .grad)
            self.handover.restore()
        logits.backward(grad)

    @torch.no_grad()
    def _evaluate(self):
        self.model.eval()
        use_statistics(self.model, self.tensors, self.arena, "folded" if self.arena.plan.config.fold_bn else "prev")
        self.handover.release()  # as in training: no .grad for a compiled forward to trace
        try:
            z = tta.logits(self.forward, self.x, self.tta_level)
        finally:
            use_statistics(self.model, self.tensors, self.arena, "next")
            self.handover.restore()
        self.arena[self.tensors.features].copy_(z)
        cross_entropy_(z, self.y, 0.0, self.results, mask=self.mask, sums=self.ops.s[B.VAL_SUMS])
        self.arena[self.tensors.predictions].copy_(z.argmax(1))
