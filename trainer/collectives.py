"""Collective range ops: the gradient all-reduce over region buckets and ZeRO stage 1
sharded optimizer state.

Gradients are reduced unit by unit (planner.unit_sizes): the buckets of G_DEEP_CONV in
reverse layer order, each as soon as backward has accumulated its last gradient, then the
rest of G_BN_BIAS..G_FIRST_CONV (under AMP the weight block's half twins). A mean over ranks
makes N ranks at batch B/N compute the gradient of one rank at batch B. On a GPU every
collective runs on a communication stream of its own and is captured into the step's CUDA
graph (NCCL); on a CPU they are plain gloo calls.
"""
import functools
import itertools
import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as td

from kernels.reference import CHUNK
from trainer.errors import PeerError
from trainer.plan import Baseline as B
from trainer.plan import MemoryPlan
from trainer.planner import ModelTensors, unit_sizes
from trainer.range_ops import RangeOps
from trainer.regions import FAMILY, HALF_KINDS, Kind
from trainer.regions import Region as R

# torch 2.14 renames all_gather_into_tensor (deprecated there, with a warning a rank) to
# all_gather_single; earlier versions have only the first
all_gather = getattr(td, "all_gather_single", None) or td.all_gather_into_tensor


def _with_the_others(collective):
    """gloo's error for a rank that ended (connection reset) or hung past dist.timeout_s, which
    came as two tracebacks, as one line saying so. NCCL's come from its watchdog, which ends
    the process, not from the call."""
    @functools.wraps(collective)
    def call(self, *args):
        try:
            return collective(self, *args)
        except RuntimeError as e:
            if self.nccl:
                raise
            why = re.sub(r"^\[[^\]]*\] ", "", (str(e).splitlines() or [type(e).__name__])[0]).split(". ")[0]
            raise PeerError(f"rank {self.rank} lost the job's other ranks ({why}): one ended, or did not answer "
                            "within dist.timeout_s; their logs (run.log, run_rankN.log in the run's folder) say "
                            "why") from None
    return call


class Comm:
    """Collectives over the job's process group. On a GPU they run on their own stream:
    side() orders them after the compute enqueued so far, join() makes compute wait for them."""

    def __init__(self, rank: int, world: int, device: torch.device, backend: str):
        self.rank, self.world = rank, world
        self.nccl = backend == "nccl"  # else gloo, which has no AVG (sum, then scale) and raises what it meets
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextmanager
    def side(self):
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield

    def join(self):
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)

    def share(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's 1/world of a flat tensor."""
        n = x.numel() // self.world
        return x[self.rank * n:(self.rank + 1) * n]

    @_with_the_others
    def mean_(self, x: torch.Tensor):
        td.all_reduce(x, op=self._mean_op)
        self._scale(x)

    @_with_the_others
    def mean_share_(self, x: torch.Tensor):
        """Reduce-scatter: this rank's share of x becomes the mean over ranks of that share."""
        share = self.share(x)
        td.reduce_scatter_tensor(share, x, op=self._mean_op)
        self._scale(share)

    @_with_the_others
    def gather_shares_(self, x: torch.Tensor):
        """All-gather: every rank's share of x, from the rank that owns it."""
        all_gather(x, self.share(x))

    @_with_the_others
    def gather_(self, out: torch.Tensor, x: torch.Tensor):
        """All-gather: every rank's x, rank after rank, into out."""
        all_gather(out, x)

    @_with_the_others
    def broadcast_(self, x: torch.Tensor):
        """Rank 0's x on every rank."""
        td.broadcast(x, src=0)

    @_with_the_others
    def sum_(self, x: torch.Tensor):
        td.all_reduce(x)

    @_with_the_others
    def max_(self, x: torch.Tensor):
        td.all_reduce(x, op=td.ReduceOp.MAX)

    @property
    def _mean_op(self):
        return td.ReduceOp.AVG if self.nccl else td.ReduceOp.SUM

    def _scale(self, x: torch.Tensor):
        if not self.nccl:
            x.mul_(1.0 / self.world)


@dataclass
class Unit:
    """Consecutive tensors of one layer kind that one collective covers: elements
    [start, start + length) of W_BN_BIAS..W_DEEP_CONV, which G_BN_BIAS..G_DEEP_CONV mirrors."""
    kind: Kind
    start: int
    length: int
    tensor_ids: frozenset  # of the W DTensors, to find a parameter's unit


def units(plan: MemoryPlan) -> list[Unit]:
    base, out = plan.base[R.W_BN_BIAS], []
    for kind in Kind:
        tensors = plan.regions[FAMILY["W"][kind]]
        first = 0
        for size in unit_sizes(kind, [t.numel for t in tensors], plan.config.deep_conv_buckets):
            group, first = tensors[first:first + size], first + size
            end = group[-1].offset + group[-1].slot_bytes
            out.append(Unit(kind, (group[0].offset - base) // 4, (end - group[0].offset) // 4,
                            frozenset(t.id for t in group)))
    return out


@dataclass
class Bucket:
    name: str
    grad: torch.Tensor  # the flat gradient span one collective reduces
    tensor_ids: frozenset
    early: bool  # reduced during backward, as soon as its gradients are complete


def gradient_buckets(ops: RangeOps, sharded: bool) -> list[Bucket]:
    """G_DEEP_CONV's buckets, last layers first (backward produces them first), then the rest.
    Replicated, the rest is one span per gradient dtype; sharded, one per region, since
    each unit's share is updated with its own block's learning rate and decay."""
    amp, n_bias = ops.config.amp, ops.g_bias.numel()
    every = units(ops.arena.plan)
    deep = [u for u in every if u.kind == Kind.DEEP_CONV]
    rest = [u for u in every if u.kind != Kind.DEEP_CONV]
    groups = [[u] for u in rest] if sharded else \
        [list(group) for _, group in itertools.groupby(rest, lambda u: _half(u, amp))]
    out = []
    for i, u in reversed(list(enumerate(deep))):
        out.append(Bucket(f"{_grad_region(u, amp).name}[{i}]", _grad_span(ops, u, n_bias), u.tensor_ids, True))
    for group in groups:
        span = Unit(group[0].kind, group[0].start, sum(u.length for u in group),
                    frozenset().union(*(u.tensor_ids for u in group)))
        name = "..".join(dict.fromkeys(_grad_region(u, amp).name for u in (group[0], group[-1])))
        out.append(Bucket(name, _grad_span(ops, span, n_bias), span.tensor_ids, False))
    return out


def _half(u: Unit, amp: bool) -> bool:
    """Backward leaves the weight block's gradients in the half twins under AMP."""
    return amp and u.kind in HALF_KINDS


def _grad_region(u: Unit, amp: bool) -> R:
    return FAMILY["G16" if _half(u, amp) else "G"][u.kind]


def _grad_span(ops: RangeOps, u: Unit, n_bias: int) -> torch.Tensor:
    if _half(u, ops.config.amp):
        return ops.g_weight[u.start - n_bias:u.start - n_bias + u.length]
    return ops.g_all[u.start:u.start + u.length]


class GradSync:

    """The collective range ops of a training step, called right after backward:
    MEAN_ALLREDUCE of the gradient buckets (sharded: a reduce-scatter, each rank receiving
    the mean of its share), then the step's loss, top-1 and top-5 averaged over ranks, so
    that the logged metrics are those of the global batch."""

    def __init__(self, ops: RangeOps, comm: Comm, sharded: bool):
        self.comm, self.sharded = comm, sharded
        self.buckets = gradient_buckets(ops, sharded)
        self.results = ops.arena.flat(R.R_RESULT)
        self.loss, self.nan_seen = ops.s[B.LOSS], ops.s[B.NAN_SEEN]
        self.missing = self._expected()

    def _expected(self) -> list[int]:
        """Gradients each bucket still waits for in this step."""
        return [len(b.tensor_ids) for b in self.buckets]

    def layout(self) -> str:
        return ", ".join(f"{b.name} ({b.grad.numel()})" for b in self.buckets)

    def watch(self, model: torch.nn.Module, tensors: ModelTensors):
        """Reduce each G_DEEP_CONV bucket as soon as backward has accumulated its last
        gradient, so its all-reduce overlaps the backward of the earlier layers."""
        owner = {t: i for i, b in enumerate(self.buckets) if b.early for t in b.tensor_ids}
        for name, p in model.named_parameters():
            i = owner.get(tensors.params[name].w.id)
            if i is not None and p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _, i=i: self._arrived(i))

    def _arrived(self, i: int):
        self.missing[i] -= 1
        if self.missing[i] == 0:
            self._reduce(self.buckets[i])

    def _reduce(self, b: Bucket):
        with self.comm.side():
            (self.comm.mean_share_ if self.sharded else self.comm.mean_)(b.grad)

    def __call__(self):
        for b, missing in zip(self.buckets, self.missing):
            if missing:  # not reduced during backward: not watched, or a gradient did not come
                self._reduce(b)
        with self.comm.side():
            self.comm.mean_(self.results)
        self.comm.join()
        # a non-finite loss on any rank makes the mean non-finite
        self.nan_seen.copy_(self.nan_seen | (~torch.isfinite(self.loss)).to(self.nan_seen.dtype))
        self.missing = self._expected()


@dataclass
class Share:
    """This rank's share of one unit: the slices it updates, its moments, and the whole
    unit, which the all-gather fills with every rank's updated share."""
    weight_block: bool  # FC weight and convs (decay, LARS trust ratio) or the bias block
    w: torch.Tensor
    g: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor | None
    unit_w: torch.Tensor
    segments: torch.Tensor | None  # LARS: the tensor each 128-value chunk belongs to


class ShardedUpdate:
    """ZeRO stage 1: this rank keeps the moments of 1/world of every unit (the M_ and V_
    regions hold only that share) and updates that share of the weights from the reduce-
    scattered gradients; an all-gather per unit then gives every rank all the weights."""

    def __init__(self, ops: RangeOps, comm: Comm):
        plan, arena, self.comm = ops.arena.plan, ops.arena, comm
        moments = {k: iter(itertools.zip_longest(plan.regions[FAMILY["M"][k]], plan.regions[FAMILY["V"][k]]))
                   for k in Kind}
        n_bias = ops.g_bias.numel()
        self.shares = []
        for u in units(plan):
            m, v = next(moments[u.kind])
            unit_w, unit_g = ops.w_all[u.start:u.start + u.length], _grad_span(ops, u, n_bias)
            weight = u.kind in HALF_KINDS
            segments = None
            if weight and ops.config.optimizer == "lars":
                first = (u.start - n_bias) // CHUNK + comm.rank * m.numel // CHUNK
                segments = ops.chunk_segment[first:first + m.numel // CHUNK]
            self.shares.append(Share(weight, comm.share(unit_w), comm.share(unit_g), arena[m],
                                     arena[v] if v is not None else None, unit_w, segments))

    def agree_on_overflow(self, found: torch.Tensor):
        """Each rank checked gradients only it holds reduced: skip the step if any rank saw
        a non-finite one, so every rank skips the same steps and scales the loss alike."""
        self.comm.max_(found)

    def update(self, ops: RangeOps):
        """RangeOps' update dispatch, share by share; each share's all-gather overlaps the
        next share's update."""
        g_scale = ops.g_scale()
        if ops.config.optimizer == "lars":
            self._lars_norms(ops, g_scale)
        for sh in self.shares:
            # LARS from the whole tensors' norms
            ops.update_span(sh.w, sh.g, sh.m, sh.v, sh.weight_block, g_scale, lars=(ops.k.lars_apply_, sh.segments))
            with self.comm.side():
                self.comm.gather_shares_(sh.unit_w)
        self.comm.join()

    def _lars_norms(self, ops: RangeOps, g_scale):
        """N_: per tensor |w|^2 and |g|^2 summed over this rank's shares, then over ranks, so
        every rank has the whole tensors' norms its shares' trust ratios need."""
        ops.norms[:, :2].zero_()
        for sh in self.shares:
            if sh.segments is not None:
                ops.k.lars_norms_(sh.w, sh.g, ops.norms, sh.segments, g_scale)
        self.comm.sum_(ops.norms.view(-1))
