"""optimizer=muon: the deep convs' update against torch.optim.Muon, the rest against torch.optim.SGD."""
import dataclasses
import math

import pytest
import torch
from torch import nn

import kernels.reference as reference
from tests.helpers import arena_step, batches, bound, hyper, small_cnn
from trainer.config import compose_config
from trainer.dist import Dist
from trainer.loop import Trainer
from trainer.errors import PlanError
from trainer.muon import orthogonalize
from trainer.range_ops import RangeOps

STEPS = 12


def muon_ops(model):
    """Range ops under optimizer=muon, with a schedule falling linearly over STEPS."""
    plans, arena, _ = bound(model, steps=STEPS, optimizer="muon")
    h = dataclasses.replace(hyper(lr=0.05, wd=1e-2, momentum=0.85), lr_muon=0.03, muon_momentum=0.6)
    ops = RangeOps(plans.main, arena, reference, muon_lr_scale=h.lr_muon / h.lr_weight, newton_schulz_steps=5)
    ops.init_scalars(h, [h.lr_weight * (1 - t / STEPS) for t in range(STEPS)], 1.0)
    return ops, h


def test_padded_batch_orthogonalizes_each_matrix_as_alone():
    """Zero padding to a common shape leaves every matrix's iteration as it was: each block
    of the batched result matches torch.optim.Muon's single-matrix step."""
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 72), (16, 72), (4, 36)]
    stack = torch.zeros(len(shapes), 16, 72)
    for i, (r, c) in enumerate(shapes):
        stack[i, :r, :c] = torch.randn(r, c, generator=g)
    out = orthogonalize(stack, steps=5).float()
    for i, (r, c) in enumerate(shapes):
        p = nn.Parameter(torch.zeros(r, c))
        p.grad = stack[i, :r, :c].clone()
        torch.optim.Muon([p], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False, ns_steps=5).step()
        torch.testing.assert_close(out[i, :r, :c], -p.detach(), rtol=0, atol=0.02)
        assert out[i].count_nonzero() == out[i, :r, :c].count_nonzero(), "padding stays zero"
        s = torch.linalg.svdvals(out[i, :r, :c])
        assert 0.5 < s.min() and s.max() < 1.3, f"singular values {s.min():.2f}..{s.max():.2f}: not orthogonalized"


def test_muon_equals_torch_optim():
    """12 steps: deep convs renormalized to norm sqrt(out) then torch.optim.Muon (same momentum
    and step, lr following the schedule); bias block, FC weight and first conv torch's Nesterov SGD."""
    model = small_cnn(layers=3)
    ref = [p.detach().clone() for p in model.parameters()]
    ops, h = muon_ops(model)
    grads = [arena_step(model, ops, x, y) for x, y in batches(STEPS)]
    # Replay what the arena saw through torch.optim.
    deep = [i for i, p in enumerate(ref) if p.dim() == 4][1:]  # every conv but the first
    rest = [i for i in range(len(ref)) if i not in deep]
    matrices = {i: nn.Parameter(ref[i].reshape(len(ref[i]), -1)) for i in deep}
    others = {i: nn.Parameter(ref[i]) for i in rest}
    sgd = torch.optim.SGD([dict(params=[others[i] for i in rest if ref[i].dim() == 1], weight_decay=0.0),
                           dict(params=[others[i] for i in rest if ref[i].dim() > 1], weight_decay=h.weight_decay)],
                          lr=h.lr_weight, momentum=h.momentum, nesterov=True)
    muon = torch.optim.Muon(matrices.values(), lr=h.lr_muon, weight_decay=0.0, momentum=h.muon_momentum,
                            nesterov=True, ns_steps=5)
    for t, step_grads in enumerate(grads):
        for group, base in zip(sgd.param_groups + muon.param_groups, (h.lr_weight, h.lr_weight, h.lr_muon)):
            group["lr"] = base * (1 - t / STEPS)
        with torch.no_grad():
            for i, w in matrices.items():
                w.mul_(math.sqrt(len(w)) / w.norm())
                w.grad = step_grads[i].reshape(len(w), -1)
            for i, w in others.items():
                w.grad = step_grads[i]
        sgd.step()
        muon.step()
    for i, p in enumerate(model.parameters()):
        if i in deep:
            torch.testing.assert_close(p.detach().reshape(len(p), -1), matrices[i].detach(), rtol=0, atol=2e-3)
        else:
            torch.testing.assert_close(p.detach(), others[i].detach(), rtol=2e-5, atol=2e-6)


def test_muon_trains_the_fast_net_on_the_default_data(tmp_path):
    """A real run: the embedded data's default net learns under Muon as under Nesterov SGD."""
    cfg = compose_config(["optimizer=muon", "trainer.epochs=2", "trainer.checkpoint_every=0"])
    summary = Trainer(cfg, tmp_path, Dist()).fit()
    assert summary["val_top1"] > 0.85, summary


def test_sharded_muon_is_refused():
    with pytest.raises(PlanError, match="shard_optimizer=false"):
        bound(small_cnn(layers=3), optimizer="muon", shards=2)
