"""Range ops: the whole model's optimizer step, gradient zeroing, casts, EMA and loss
scaling as a handful of kernels over contiguous region ranges (the metric sums are the
loss's: trainer/loss.py counts hits before a distributed step averages them).

RangeOps binds the flat spans of one arena once; each method is one op of DESIGN.md's
list and issues the same kernels whatever the number of layers, but for Muon's update,
which copies each deep conv's filter bank into its stack and its step back. Every value
that may change during training is read from S_ scalars in the arena, so a captured step
graph replays correctly as the schedule moves.
"""
from typing import NamedTuple

import torch

from kernels.reference import CHUNK
from trainer.arena import Arena
from trainer.muon import MuonUpdate
from trainer.plan import Baseline as B
from trainer.plan import MemoryPlan
from trainer.regions import FAMILY, HALF_KINDS
from trainer.regions import Kind as K
from trainer.regions import Region as R
from trainer.schedule import Hyperparameters

GROWTH, BACKOFF = 2.0, 0.5  # dynamic loss scale: x2 after a run of clean steps, /2 on overflow


class Frozen(NamedTuple):
    """A frozen part: flat views of what it holds fixed, their stash, the step it freezes at."""
    views: list
    kept: list
    step: int


class RangeOps:
    def __init__(self, plan: MemoryPlan, arena: Arena, kernels, bias_lr_scale: float = 1.0,
                 ema_every: int = 1, ema_warmup_power: float = 0.0, lookahead: bool = False,
                 growth_interval: int = 2000, dynamic_scale: bool = True,
                 freezes: list[tuple[list[torch.Tensor], int]] = (), muon_lr_scale: float = 1.0,
                 newton_schulz_steps: int = 5):
        """freezes: (flat views of what a frozen part holds fixed: weights and running
        statistics; the step from which they stay so), one per part. The plan's freeze_stash
        keeps their values during a step. Under optimizer=muon the deep convs' step size is
        the schedule's times muon_lr_scale."""
        c = plan.config
        self.config, self.k, self.arena = c, kernels, arena
        self.bias_lr_scale, self.ema_every, self.lookahead = bias_lr_scale, ema_every, lookahead
        self.muon_lr_scale = muon_lr_scale
        self.ema_warmup_power = ema_warmup_power
        self.growth_interval, self.dynamic_scale = growth_interval, c.amp and dynamic_scale
        self.s = {b: arena[plan[b]] for b in B}
        f = arena.flat
        # The gradients backward writes: fp32, but under AMP the weight block's are half
        # precision, still scaled, and the update unscales them as it reads them (G16).
        g = FAMILY["G16" if c.amp else "G"]
        self.w_bias, self.g_bias = f(R.W_BN_BIAS, R.W_FC_BIAS), f(R.G_BN_BIAS, R.G_FC_BIAS)
        self.w_weight, self.g_weight = f(R.W_FC_WEIGHT, R.W_DEEP_CONV), f(g[K.FC_WEIGHT], g[K.DEEP_CONV])
        # g_all: every fp32 gradient; under AMP the weight regions in it are empty, so it is the bias block's
        self.w_all, self.g_all = f(R.W_BN_BIAS, R.W_DEEP_CONV), f(R.G_BN_BIAS, R.G_DEEP_CONV)
        self.m_bias = f(R.M_BN_BIAS, R.M_FC_BIAS) if c.has_momentum else None
        self.m_weight = f(R.M_FC_WEIGHT, R.M_DEEP_CONV) if c.has_momentum else None
        # The weight block SGD updates: under Muon only the FC weight and the first conv.
        self.sgd_weight = (self.w_weight, self.g_weight, self.m_weight)
        if c.optimizer == "muon":
            self.sgd_weight = (f(R.W_FC_WEIGHT, R.W_FIRST_CONV), f(g[K.FC_WEIGHT], g[K.FIRST_CONV]),
                               f(R.M_FC_WEIGHT, R.M_FIRST_CONV))
            base = plan.base[R.W_DEEP_CONV]
            convs = [((t.offset - base) // 4, t.shape[0], t.numel // t.shape[0])
                     for t in plan.regions[R.W_DEEP_CONV]]
            self.muon = MuonUpdate(f(R.W_DEEP_CONV), f(g[K.DEEP_CONV]), f(R.M_DEEP_CONV), convs,
                                   newton_schulz_steps)
        if c.has_second_moment:
            self.v_bias, self.v_weight = f(R.V_BN_BIAS, R.V_FC_BIAS), f(R.V_FC_WEIGHT, R.V_DEEP_CONV)
        if c.amp:
            self.a_weight = f(R.A_FC_WEIGHT, R.A_DEEP_CONV)
        if c.ema:
            self.e_all, self.e_weight = f(R.E_BN_BIAS, R.E_DEEP_CONV), f(R.E_FC_WEIGHT, R.E_DEEP_CONV)
            self.e16_weight = f(R.E_FC_WEIGHT_FP16, R.E_DEEP_CONV_FP16) if c.amp else None
        self.ema_in_use = False
        if c.optimizer == "lars":
            self.norms = f(R.N_FC_WEIGHT, R.N_DEEP_CONV).view(-1, CHUNK)
            self.chunk_segment = arena[next(t for t in plan.regions[R.T_TEMP_INT32]
                                            if t.name == "lars_chunk_segment")]
        self.b_next, self.b_prev = f(R.B_NEXT_MEAN, R.B_NEXT_VAR), f(R.B_PREV_MEAN, R.B_PREV_VAR)
        self.shard = None  # trainer.collectives.ShardedUpdate under ZeRO-1: this rank's share of the update
        self.freezes: list[Frozen] = []
        if freezes:
            stash = arena[next(t for t in plan.regions[R.T_TEMP_FP32] if t.name == "freeze_stash")]
            chunks = iter(stash.split([x.numel() for views, _ in freezes for x in views]))
            self.freezes = [Frozen(views, [next(chunks) for _ in views], step) for views, step in freezes]
        self._plan = plan

    # -- set-up (host writes, before capture) ---------------------------------------
    def init_scalars(self, h: Hyperparameters, lr_table, grad_scale: float):
        s = self.s
        for b, value in ((B.WEIGHT_DECAY_BIAS, h.weight_decay_bias), (B.WEIGHT_DECAY, h.weight_decay),
                         (B.MOMENTUM, h.momentum), (B.BETA1, h.momentum), (B.BETA2, h.beta2),
                         (B.EPS, h.eps), (B.LARS_ETA, h.lars_eta), (B.MUON_MOMENTUM, h.muon_momentum)):
            s[b].fill_(value)
        s[B.LR_SCHEDULE].copy_(torch.as_tensor(lr_table, dtype=torch.float64))  # rounded once, to fp32
        s[B.LOSS_SCALE].fill_(grad_scale if self.dynamic_scale else 1.0)
        if self.config.optimizer == "lars":
            segments = [t.slot_bytes // 4 // CHUNK for k in HALF_KINDS
                        for t in self._plan.regions[FAMILY["W"][k]]]
            self.chunk_segment.copy_(torch.repeat_interleave(
                torch.arange(len(segments), dtype=torch.int32), torch.tensor(segments)))

    def set_ema_decay(self, decay: float):
        self.s[B.EMA_DECAY].fill_(decay)

    # -- the ops of one training step ---------------------------------------------
    def schedule(self):
        """This step's learning rates from the table, indexed by the step counter."""
        s = self.s
        last = s[B.LR_SCHEDULE].numel() - 1
        lr = s[B.LR_SCHEDULE][s[B.STEP].clamp(max=last).long()]
        s[B.LR_WEIGHT].copy_(lr)
        s[B.LR_BIAS].copy_(lr * self.bias_lr_scale)
        if self.config.optimizer == "muon":
            s[B.LR_MUON].copy_(lr * self.muon_lr_scale)

    def clear_grads(self):
        self.g_all.zero_()
        if self.config.amp:
            self.g_weight.zero_()

    def grad_scaling(self):
        """GRAD_SCALING under AMP, CHECK_NAN without: raise OVERFLOW if any gradient is not
        finite (that step's update is then skipped) and bring the bias block's to unit scale;
        the weight block's are unscaled by the update as it reads them (g_scale). The
        update then moves the dynamic loss scale. All on the device: the host never waits."""
        s, found = self.s, self.s[B.OVERFLOW]
        found.zero_()
        if self.config.amp:
            self.k.unscale_(self.g_bias, self.g_bias, self.g_scale(), found)
            # a finite half gradient stays finite times the inverse scale
            self.k.check_finite_(self.g_weight, found)
        else:
            self.k.check_finite_(self.g_all, found)
        if self.shard is not None:
            self.shard.agree_on_overflow(found)
        s[B.OPT_STEP].add_(1 - found.to(torch.int32))

    def g_scale(self) -> torch.Tensor | None:
        """Under AMP, the inverse of the loss scale this step's gradients were computed with:
        GRAD_SCALING multiplies the bias block's by it, the update the weight block's as it
        reads them."""
        return 1.0 / self.s[B.LOSS_SCALE] if self.config.amp else None

    def _update_scale(self):
        s = self.s
        overflow = s[B.OVERFLOW].bool()
        good = torch.where(overflow, torch.zeros_like(s[B.GOOD_STEPS]), s[B.GOOD_STEPS] + 1)
        grow = good >= self.growth_interval
        scale = s[B.LOSS_SCALE]
        s[B.LOSS_SCALE].copy_(torch.where(overflow, scale * BACKOFF, torch.where(grow, scale * GROWTH, scale)))
        s[B.GOOD_STEPS].copy_(torch.where(grow, torch.zeros_like(good), good))

    def stash_frozen(self):
        """Before the update: what the frozen parts hold fixed, copied aside."""
        if self.freezes:
            torch._foreach_copy_([k for f in self.freezes for k in f.kept], [x for f in self.freezes for x in f.views])

    def hold_frozen(self, settled: bool):
        """After the update (and lookahead): frozen parts put back as stashed, so that no
        update (weight decay, momentum) nor lookahead moves them. A part frozen from step 0, or
        any part in a step where every freeze has happened (`settled`), is copied back in
        one launch; the others only from their step on, tested on the device."""
        always = [f for f in self.freezes if settled or f.step == 0]
        if always:
            torch._foreach_copy_([x for f in always for x in f.views], [k for f in always for k in f.kept])
        for f in self.freezes:
            if not (settled or f.step == 0):
                done = self.s[B.STEP] >= f.step
                for x, k in zip(f.views, f.kept):
                    x.copy_(torch.where(done, k, x))

    def update(self):
        """UPDATE_BIAS_* then UPDATE_WEIGHT_* for the configured optimizer, then the dynamic
        loss scale moves: the update has unscaled with the scale of this step."""
        if self.shard is not None:
            self.shard.update(self)
        else:
            self._update_blocks()
        if self.dynamic_scale:
            self._update_scale()

    def _update_blocks(self):
        """Muon updates the deep convs; the bias block, the FC weight and the first conv take
        Nesterov SGD."""
        s, has_v, g_scale = self.s, self.config.has_second_moment, self.g_scale()
        if self.config.optimizer == "muon":
            self.muon(s[B.LR_MUON], s[B.MUON_MOMENTUM], s[B.OVERFLOW], g_scale)
        self.update_span(self.w_bias, self.g_bias, self.m_bias, self.v_bias if has_v else None, False, g_scale)
        self.update_span(*self.sgd_weight, self.v_weight if has_v else None, True, g_scale,
                         lars=(self.k.lars_, self.chunk_segment) if self.config.optimizer == "lars" else None)

    def update_span(self, w, g, m, v, weights: bool, g_scale, lars=None):
        """The configured optimizer's update of one span of the weight block (weights: its
        learning rate and decay, and under AMP its half gradients, unscaled by g_scale as they
        are read) or of the bias block. lars: (kernel, segments) for LARS's weights, either
        lars_, which takes their norms itself, or lars_apply_, whose caller has summed them
        over the ranks' shares."""
        s, opt, skip, mu = self.s, self.config.optimizer, self.s[B.OVERFLOW], self.s[B.MOMENTUM]
        lr, wd = (s[B.LR_WEIGHT], s[B.WEIGHT_DECAY]) if weights else (s[B.LR_BIAS], s[B.WEIGHT_DECAY_BIAS])
        gs = g_scale if weights else None
        if opt in ("adam", "adamw"):
            self.k.adam_(w, g, m, v, lr, wd, s[B.BETA1], s[B.BETA2], s[B.EPS], s[B.OPT_STEP], skip, opt == "adamw", gs)
        elif opt == "lars" and weights:
            kernel, segments = lars
            kernel(w, g, m, self.norms, segments, lr, wd, mu, s[B.LARS_ETA], skip, gs)
        elif opt == "lars":
            self.k.lars_bias_(w, g, m, lr, wd, mu, skip)
        else:
            self.k.sgd_(w, g, m, lr, wd, mu, skip, opt in ("nesterov", "muon"), gs)

    def ema(self):
        """EMA_PARAM_UPDATE every ema_every steps (decay raised to that power); with
        lookahead the model then continues from the averaged weights. The BN statistics
        average along in B_PREV, which evaluation reads: EMA weights are evaluated with the
        statistics of EMA weights, and lookahead resets the running statistics with them."""
        s = self.s
        due = (s[B.STEP] % self.ema_every) == 0
        decay = s[B.EMA_DECAY] ** self.ema_every
        if self.ema_warmup_power:
            progress = s[B.STEP].float() / s[B.LR_SCHEDULE].numel()
            decay = decay * progress ** self.ema_warmup_power
        decay = torch.where(due, decay, torch.ones_like(decay))
        self.k.ema_(self.e_all, self.w_all, decay)
        self.k.ema_(self.b_prev, self.b_next, decay)
        if self.lookahead:
            self.w_all.copy_(torch.where(due, self.e_all, self.w_all))
            self.b_next.copy_(torch.where(due, self.b_prev, self.b_next))

    def cast_weights(self):
        """CAST fp32 -> half: the compute copy of the whole weight block in one pass."""
        if self.config.amp:
            self.k.cast_(self.w_weight, self.a_weight)

    def advance(self):
        self.s[B.STEP].add_(1)

    # -- between epochs -------------------------------------------------------------
    def bn_stats_to_prev(self):
        """BN_STATS: B_PREV = B_NEXT (the distributed version averages over ranks). Under
        EMA, B_PREV already holds the statistics' average and keeps it."""
        if not self.config.ema:
            self.b_prev.copy_(self.b_next)

    def fold_bn(self, eps: float):
        """FOLD_BN: W_EQ_SCALE = w / sqrt(var + eps), W_EQ_BIAS = b - mean * scale over every
        BatchNorm at once (B_PREV, W_BN_* and W_EQ_* hold one slot per layer, aligned)."""
        f = self.arena.flat
        scale = f(R.W_BN_WEIGHT) * torch.rsqrt(f(R.B_PREV_VAR) + eps)
        f(R.W_EQ_SCALE).copy_(scale)
        f(R.W_EQ_BIAS).copy_(f(R.W_BN_BIAS) - f(R.B_PREV_MEAN) * scale)

    def sema_switch(self):
        """SEMA_SWITCH: exchange live and EMA weights, so that evaluation runs on the EMA
        weights through the same graphs and addresses; a second switch restores the live
        weights bit for bit. Under AMP the half compute weights follow: E16 is refreshed
        from the EMA masters on the way in and holds the live half weights meanwhile."""
        if self.config.amp and not self.ema_in_use:
            self.k.cast_(self.e_weight, self.e16_weight)
        self.k.swap_(self.w_all, self.e_all)
        if self.config.amp:
            self.k.swap_(self.a_weight, self.e16_weight)
        self.ema_in_use = not self.ema_in_use

    def reset_sums(self, which: B):
        self.s[which].zero_()
