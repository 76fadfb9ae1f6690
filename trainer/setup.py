"""From a validated configuration to the objects of the data flow: model, variants, plans."""
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from kernels import load as load_kernels
from kernels import reference
from trainer.arena import Arena
from trainer.binding import bind
from trainer.compile_cache import use_compile_cache, use_torch_ptxas
from trainer.config import TrainConfig, compile_options, freeze_epochs, plan_config
from trainer.data import dataset_sizes, val_batch
from trainer.errors import ConfigError
from trainer.executor import Executor
from trainer.feeder import BUFFERS
from trainer.models import build_model
from trainer.norm import use_batch_norm_kernels
from trainer.planner import Plans, build_plans, freezable, frozen_tensors
from trainer.pooling import use_max_pool_kernel
from trainer.program import Program
from trainer.range_ops import RangeOps
from trainer.schedule import hyperparameters, lr_multipliers, steps_per_epoch, total_steps
from trainer.variants import Variant, derive_variants


def use_device(device: torch.device, cfg: TrainConfig):
    """The process's settings for a run on `device`, first thing: the current device, cuDNN's
    autotuning as cfg.model.cudnn_benchmark says, one ptxas for every Triton kernel,
    torch.compile's caches in cfg.compile_cache, and under cfg.deterministic only kernels
    that sum in a fixed order: cuDNN's deterministic algorithms, picked by its heuristic
    (the autotuning may pick another in the process that resumes), torch's deterministic
    kernels (an op without one stops the run, naming it; inductor then also keeps the
    reduction configurations that change sums fixed) and cuBLAS with one workspace."""
    torch.backends.cudnn.benchmark = cfg.model.cudnn_benchmark and not cfg.deterministic
    torch.backends.cudnn.deterministic = cfg.deterministic
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before any GEMM
    if cfg.deterministic or torch.are_deterministic_algorithms_enabled():  # a sweep's earlier job may have set it
        torch.use_deterministic_algorithms(cfg.deterministic)  # imports inductor: a second or two of start-up
    if device.type == "cuda":
        if device.index is not None:  # torch 2.11 refuses a bare "cuda"
            torch.cuda.set_device(device)
        use_torch_ptxas()
    if cfg.compile_cache:
        use_compile_cache(Path(cfg.compile_cache))


def make_model(cfg: TrainConfig) -> nn.Module:
    m = cfg.model
    try:
        model = build_model(m.name, m.num_classes, m.depth, m.width, m.widths, m.stem, m.stem_norm, m.logit_scale,
                            m.head_std)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    return model.to(memory_format=torch.channels_last)


def freeze_steps(cfg: TrainConfig, per_epoch: int) -> dict[str, int]:
    """The step from which each frozen part stays fixed."""
    return {part: round(epochs * per_epoch) for part, epochs in freeze_epochs(cfg).items() if epochs >= 0}


def make_variants(cfg: TrainConfig, world: int = 1, sizes: tuple[int, int] | None = None) -> tuple[list[Variant], int]:
    """The variants and the training steps of a full epoch, from the per-rank data size (of
    the data set, or `sizes`: examples to train and evaluate on)."""
    train_size, val_size = sizes or dataset_sizes(cfg.data)
    t = cfg.trainer
    per_rank_train, per_rank_val = train_size // world, -(-val_size // world)
    if per_rank_train == 0:  # whatever the batch size: a rank with no examples has no batch to train on
        raise ConfigError(f"the {train_size} training examples are fewer than the job's {world} ranks: raise "
                          "data.train_size, or start fewer processes")
    if per_rank_train < t.batch_size and t.drop_last:
        raise ConfigError(f"trainer.batch_size={t.batch_size} is larger than the {per_rank_train} training "
                          f"examples per rank; lower it or set trainer.drop_last=false")
    per_epoch = steps_per_epoch(per_rank_train, t.batch_size, t.drop_last)
    variants = derive_variants(per_rank_train, per_rank_val, t.batch_size, val_batch(t, val_size, world),
                               cfg.data.resolution, t.lowres_resolution, t.lowres_epochs, t.drop_last,
                               late_freeze=any(freeze_steps(cfg, per_epoch).values()))
    return variants, per_epoch


def check_inputs_fit(model: nn.Module, cfg: TrainConfig, variants: list[Variant]):
    """The model forward on one image at each training variant's resolution: an image its
    downsampling shrinks to nothing, or a batch that leaves a BatchNorm one value a channel
    to normalize over, is refused here, by its settings, instead of torch's error at the
    first step. Up to 512x512 the model itself runs a zero image on the CPU, in eval mode
    (nothing learned or counted changes), in a fraction of a second; larger images go
    through a copy on the meta device (shapes only), whose Python decompositions import
    torch._dynamo, a second of start-up that a run without compile=true otherwise spares."""
    resolutions = sorted({v.resolution for v in variants if v.train})
    if resolutions[-1] > 512:
        with torch.device("meta"):
            model = make_model(cfg)
    device = next(model.parameters()).device
    values = {}  # per resolution, per image, at each BatchNorm's input: H*W
    hooks = [m.register_forward_pre_hook(lambda m, args: values[resolution].append(args[0][0, 0].numel()))
             for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    training = model.training
    model.eval()
    try:
        for resolution in resolutions:
            values[resolution] = []
            with torch.no_grad():
                model(torch.zeros(1, 3, resolution, resolution, device=device))
    except RuntimeError as e:
        raise ConfigError(f"{resolution}x{resolution} images are too small for model={cfg.model.name} "
                          f"({str(e).splitlines()[0]}); raise data.resolution (or trainer.lowres_resolution)") from None
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    for v in variants:
        # evaluation plans a training batch for the arena's shape alone and runs no training step, where
        # a BatchNorm would normalize over the batch: its trainer.batch_size is the evaluation batch
        if v.train and cfg.mode != "eval" and v.batch * min(values[v.resolution], default=2) == 1:
            raise ConfigError(
                f"a training batch of one image ({v.name}: trainer.batch_size={cfg.trainer.batch_size}, "
                f"trainer.drop_last={cfg.trainer.drop_last}) leaves model={cfg.model.name}'s BatchNorms at "
                "1x1 one value a channel to normalize over; change " + (
                    "the data size, or set trainer.drop_last=true" if v.batch != cfg.trainer.batch_size
                    else "trainer.batch_size"))


def make_plans(cfg: TrainConfig, world: int = 1, sizes: tuple[int, int] | None = None) -> tuple[nn.Module, Plans, int]:
    """The model, its plans and the training steps of a full epoch on each rank (`sizes`: see
    make_variants)."""
    model = make_model(cfg)
    variants, per_epoch = make_variants(cfg, world, sizes)
    check_inputs_fit(model, cfg, variants)
    steps = total_steps(cfg.trainer.epochs, per_epoch)
    return model, build_plans(model, plan_config(cfg, steps, world), variants, cfg.model.num_classes), per_epoch


def compiled(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """The model under torch.compile: inductor fuses forward and backward, and the Executor
    captures its kernels in the step graph. AOTAutograd's cache is let take graphs with
    custom autograd Functions (trainer/norm.py's BatchNorm, trainer/pooling.py's max-pool),
    which it leaves out by default: without it every process traced and partitioned
    forward and backward again, and only inductor's part of the compile came from the
    cache. Their backward is traced into the graph that keys the cache."""
    from torch._functorch import config as aot_config
    aot_config.autograd_cache_allow_custom_autograd_functions = True
    return torch.compile(model, dynamic=False, options=compile_options(cfg))


@dataclass
class Engine:
    """Everything a step needs, bound together: the model computing in the arena, the range
    ops over it, one Program per (variant, input buffer) and the Executor that runs them."""
    model: nn.Module
    plans: Plans
    arena: Arena
    ops: RangeOps
    programs: dict
    executor: Executor
    per_epoch: int  # training steps of a full epoch on each rank
    settle_step: int | None  # from this step on the `_frozen` variants train: every freeze has happened

    def variant(self, name: str) -> Variant:
        return next(v for v in self.plans.variants if v.name == name)


def assemble(cfg: TrainConfig, device: torch.device, world: int = 1,
             init_model: Callable[[nn.Module], None] | None = None, grad_sync_factory=None,
             sizes: tuple[int, int] | None = None) -> Engine:
    """model -> plans -> arena -> bind -> range ops -> programs -> executor. `init_model`
    may change the model's initial values (data-dependent init) before they enter the arena;
    `sizes`: see make_variants."""
    t = cfg.trainer
    model, plans, per_epoch = make_plans(cfg, world, sizes)
    model.to(device)
    if init_model is not None:
        init_model(model)
    arena = Arena(plans.main, device)
    bind(model, plans.tensors[plans.variants[0].name], arena)
    steps = plans.main.config.schedule_steps
    tensors = plans.tensors[plans.variants[0].name]
    freezes, late_frozen = [], []  # late: frozen after step 0, by the `_frozen` variants' programs
    for part, step in freeze_steps(cfg, per_epoch).items():
        views = [arena.view(x, padded=True).view(-1) for x in frozen_tensors(model, part, tensors.params, tensors.bn)]
        freezes.append((views, step))
        module = freezable(model, part)[1]
        if step:
            late_frozen.append(module)
        else:  # frozen from the start: backward never computes its gradients
            module.requires_grad_(False)
    h = hyperparameters(cfg.optimizer, t.batch_size * world)
    kernels = load_kernels(cfg.kernels, device)
    use_max_pool_kernel(model, kernels)
    # Inductor fuses the normalization with what is around it; without it the Triton kernels
    # do, while the reference's torch form (the CPU's) is slower than ATen's BatchNorm
    if cfg.compile or kernels is not reference:
        use_batch_norm_kernels(model, kernels, normalize=not cfg.compile, pack_masks=cfg.model.pack_relu_masks)
    ops = RangeOps(plans.main, arena, kernels, bias_lr_scale=cfg.optimizer.bias_lr_scale,
                   ema_every=t.ema_every, ema_warmup_power=t.ema_warmup_power, lookahead=t.lookahead,
                   growth_interval=t.grad_scale_growth_interval, dynamic_scale=cfg.amp_dtype == "fp16",
                   freezes=freezes, muon_lr_scale=h.lr_muon / h.lr_weight if h.lr_weight else 0.0,
                   newton_schulz_steps=cfg.optimizer.newton_schulz_steps)
    ops.init_scalars(h, h.lr_weight * lr_multipliers(cfg.schedule, steps, per_epoch), t.grad_scale_init)
    ops.set_ema_decay(cfg.ema_decay)
    grad_sync = grad_sync_factory(ops) if grad_sync_factory is not None else None
    forward = compiled(model, cfg) if cfg.compile else model
    programs = {(v.name, b): Program(v, b, model, plans.tensors[v.name], arena, ops, t.label_smoothing,
                                     cfg.data.tta, grad_sync, forward, tuple(late_frozen))
                for v in plans.variants for b in BUFFERS}
    settle_step = max(step for _, step in freezes) if late_frozen else None
    return Engine(model, plans, arena, ops, programs, Executor(programs, arena, cfg.graphs), per_epoch,
                  settle_step)
