"""Shared builders for tests: a small CNN bound into an arena with its range ops; readers of
what the trainer prints."""
import torch
from torch import nn
from torch.nn import functional as F

import kernels.reference as reference
from trainer.arena import Arena
from trainer.binding import bind
from trainer.plan import PlanConfig
from trainer.planner import build_plans
from trainer.range_ops import RangeOps
from trainer.schedule import Hyperparameters
from trainer.variants import derive_variants


def small_cnn(layers: int = 2, seed: int = 0, width: int = 8, classes: int = 5) -> nn.Module:
    torch.manual_seed(seed)
    mods, cin = [], 3
    for _ in range(layers):
        mods += [nn.Conv2d(cin, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        cin = width
    return nn.Sequential(*mods, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes))


def bound(model: nn.Module, steps: int = 20, batch: int = 4, resolution: int = 8, classes: int = 5,
          kernels=reference, device="cpu", **config):
    """(plans, arena, ops) for `model` bound into a fresh arena on `device`."""
    plans = build_plans(model, PlanConfig(schedule_steps=steps, **config),
                        derive_variants(16 * batch, 4 * batch, batch, batch, resolution), classes)
    arena = Arena(plans.main, device)
    bind(model, plans.tensors["train_base"], arena)
    return plans, arena, RangeOps(plans.main, arena, kernels)


def hyper(lr=0.05, wd=1e-2, momentum=0.9, beta2=0.999, eps=1e-8, eta=0.001) -> Hyperparameters:
    return Hyperparameters(lr, lr, wd, 0.0, momentum, beta2, eps, eta)


def batches(n: int, batch=4, classes=5, seed=1) -> list:
    """n random (8x8 image batch, labels) pairs for small_cnn."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(n)]


def arena_step(model, ops, x, y) -> list[torch.Tensor]:
    """One training step through the range ops; returns the gradients it applied, for a
    reference fed the same (gradients depend on the weights, so the update rule is compared)."""
    ops.schedule()
    ops.clear_grads()
    F.cross_entropy(model(x).float(), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    ops.grad_scaling()
    ops.update()
    ops.cast_weights()
    ops.advance()
    return grads


def serve(source, sizes, resolution, channels=3, dtype=torch.float32, mask=False, epoch=0) -> list:
    """One epoch of a Source: (data, label, mask) of each batch of `sizes`, in fresh tensors."""
    source.start_epoch(epoch, resolution)
    out = []
    for n in sizes:
        data = torch.empty(n, resolution, resolution, channels, dtype=dtype)
        label = torch.empty(n, dtype=torch.int32)
        m = torch.empty(n, dtype=torch.int8) if mask else None
        source.fill(data, label, m, None)
        out.append((data, label, m))
    return out


def table_rows(markdown: str) -> dict[str, list[str]]:
    """A markdown table's body rows by their first cell: the other cells, stripped."""
    return {cells[1].strip(): [c.strip() for c in cells[2:-1]]
            for cells in (line.split("|") for line in markdown.splitlines() if line.startswith("| "))}


def profile_share(profile: str) -> float:
    """The share of the measured step that a bench profile's kernels (or operators) add up to."""
    total = next(v for k, v in table_rows(profile).items() if k.startswith("all, against the measured"))
    return float(total[2].rstrip("%")) / 100


def persistent_state(arena: Arena) -> dict:
    """Every persistent byte of an arena by region, as a checkpoint keeps them (copies)."""
    from trainer import checkpoint
    return {r: checkpoint._region_bytes(arena, r).clone() for r in checkpoint.STATE_REGIONS}


def assert_same_state(first: dict, *others: dict):
    """Each persistent_state is the first one, byte for byte."""
    for other in others:
        for region, data in first.items():
            assert torch.equal(other[region], data), region
