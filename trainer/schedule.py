"""Learning-rate schedules and the optimizer's hyperparameters in the trainer's units.

The whole schedule becomes one table in device memory that the step graph indexes
with its own step counter, so the host never writes a learning rate during training.
"""
import math
from dataclasses import dataclass

from trainer.config import OptimizerConfig, ScheduleConfig


def steps_per_epoch(examples_per_rank: int, batch: int, drop_last: bool) -> int:
    return examples_per_rank // batch if drop_last else -(-examples_per_rank // batch)


def total_steps(epochs: float, per_epoch: int) -> int:
    return max(1, math.ceil(epochs * per_epoch))


def lr_multipliers(s: ScheduleConfig, steps: int, per_epoch: int) -> list[float]:
    """Fraction of the peak learning rate at every step: warm-up, then the decay."""
    warmup = round(s.warmup_epochs * per_epoch)
    out = []
    for t in range(steps):
        if t < warmup:
            out.append(s.warmup_start_fraction + (1 - s.warmup_start_fraction) * t / warmup)
            continue
        q = (t - warmup) / max(1, steps - warmup)  # progress through the decay, 0 -> 1
        f = s.final_fraction
        out.append({
            "constant": lambda: 1.0,
            "cosine": lambda: f + (1 - f) * 0.5 * (1 + math.cos(math.pi * q)),
            "linear": lambda: 1 - (1 - f) * q,
            "poly": lambda: f + (1 - f) * (1 - q) ** s.power,
            "step": lambda: s.gamma ** sum(t >= m * per_epoch for m in s.milestones),
        }[s.name]())
    return out


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
