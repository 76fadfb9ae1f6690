"""Learning-rate schedules and the optimizer's hyperparameters in the trainer's units.

The whole schedule becomes one table in device memory that the step graph indexes
with its own step counter, so the host never writes a learning rate during training.
"""
import math
from dataclasses import dataclass

import torch

from trainer.config import OptimizerConfig, ScheduleConfig


def steps_per_epoch(examples_per_rank: int, batch: int, drop_last: bool) -> int:
    return examples_per_rank // batch if drop_last else -(-examples_per_rank // batch)


def epoch_step(epochs: float, per_epoch: int) -> int:
    """The first step at or after `epochs` epochs. Rounded first: 2.2 epochs of 25 steps are
    55.00000000000001 in floating point, whose ceiling is 56."""
    return math.ceil(round(epochs * per_epoch, 9))


def total_steps(epochs: float, per_epoch: int) -> int:
    return max(1, epoch_step(epochs, per_epoch))


def lr_multipliers(s: ScheduleConfig, steps: int, per_epoch: int) -> torch.Tensor:
    """Fraction of the peak learning rate at every step (float64): warm-up, then the decay.
    On tensors, not a Python loop: a long run's table (10^6 steps and more) takes
    milliseconds and 8 bytes a step."""
    t = torch.arange(steps, dtype=torch.float64)
    warmup = round(s.warmup_epochs * per_epoch)
    q = ((t - warmup) / max(1, steps - warmup)).clamp(min=0)  # progress through the decay, 0 -> 1
    f = s.final_fraction
    if s.name == "constant":
        decay = torch.ones_like(t)
    elif s.name == "cosine":
        decay = f + (1 - f) * 0.5 * (1 + torch.cos(math.pi * q))
    elif s.name == "linear":
        decay = 1 - (1 - f) * q
    elif s.name == "poly":
        decay = f + (1 - f) * (1 - q) ** s.power
    else:  # step: gamma to the number of milestones passed (gamma ** 0 is 1, gamma=inf too)
        passed = sum((t >= epoch_step(m, per_epoch)).to(torch.float64) for m in s.milestones)
        decay = torch.pow(s.gamma, passed)
    if not warmup:
        return decay
    rise = s.warmup_start_fraction + (1 - s.warmup_start_fraction) * t / warmup
    return torch.where(t < warmup, rise, decay)


@dataclass(frozen=True)
class Hyperparameters:
    """Peak values in the form the update rules use (torch.optim's coupled form)."""
    lr_weight: float
    lr_bias: float
    weight_decay: float
    weight_decay_bias: float
    momentum: float
    beta2: float
    eps: float
    lars_eta: float
    lr_muon: float = 0.0
    muon_momentum: float = 0.0


def hyperparameters(o: OptimizerConfig, global_batch: int) -> Hyperparameters:
    """Decoupled recipes give lr and weight decay per example and per 1024 examples of
    momentum-normalized steps (the CIFAR-10 speedruns' form); the update rules take the
    usual coupled values, so they are converted here once. The bias block's learning rate
    is scaled by bias_lr_scale while its decay per step stays that of the weights. Muon's
    step size needs neither: its update has a fixed size whatever the batch and momentum."""
    lr, wd = o.lr, o.weight_decay
    if o.nominal_batch:
        lr *= global_batch / o.nominal_batch
    if o.decoupled:
        kilostep = 1024 * (1 + 1 / (1 - o.momentum))
        lr, wd = lr * global_batch / kilostep, (wd / lr if lr else 0.0)
    lr_bias = lr * o.bias_lr_scale
    wd_bias = (wd / o.bias_lr_scale if o.bias_lr_scale else 0.0) if o.bias_weight_decay else 0.0
    return Hyperparameters(lr, lr_bias, wd, wd_bias, o.momentum, o.beta2, o.eps, o.lars_eta, o.muon_lr,
                           o.muon_momentum)
