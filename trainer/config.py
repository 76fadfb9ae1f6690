"""The configuration schema. Hydra composes conf/ onto these dataclasses, so a misspelled
key or a value of the wrong type fails at composition; validate() then rejects values
that type-check but cannot work. Both end in one message and a non-zero exit."""
import difflib
import math
import os
import re
from dataclasses import dataclass, field, fields, is_dataclass
from functools import reduce
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.default_element import GroupDefault
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import II, MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.errors import ConfigError
from trainer.plan import OPTIMIZERS, PlanConfig
from trainer.run_dir import ranks


@dataclass
class ModelConfig:
    name: str = MISSING  # resnet18 | resnet34 | resnet50 | resnet101 | cifar_resnet | fastnet
    num_classes: int = II("data.num_classes")  # the data's: give data.num_classes
    depth: int = 20  # cifar_resnet: 6n+2
    width: int = 16  # cifar_resnet: first stage's channels (16 is the paper's; more is "wide")
    widths: list[int] = field(default_factory=lambda: [64, 256, 256])  # fastnet: channels per group
    stem: str = "imagenet"  # torchvision ResNets: imagenet (7x7, max-pool) | cifar (3x3, no max-pool)
    stem_norm: str = "bias"  # fastnet: after the stem conv, bias (a bias-only BatchNorm) | none
    logit_scale: float = 1 / 9  # fastnet: scales the logits, applied to the head's input (airbench94_muon: 1/256)
    head_std: float = 0.0  # fastnet: the head's initial weight std; 0 keeps torch's (1/sqrt(3 fan_in))
    # on a GPU, warm-up times cuDNN's algorithms for each of the model's convolution shapes
    # and keeps the fastest; false takes cuDNN's heuristic choice, for a shorter first step
    # where that choice is as fast (conf/model/resnet50.yaml)
    cudnn_benchmark: bool = True
    # without compile, a ResNet block's last BatchNorm keeps its ReLU's mask packed 8 channels a
    # byte, which backward reads in place of the block's output (16 times the bytes); false reads
    # the output and keeps no mask: a sixteenth of the block outputs less memory at the step's
    # peak (conf/model/resnet18_cifar.yaml)
    pack_relu_masks: bool = True


@dataclass
class OptimizerConfig:
    name: str = MISSING  # sgd | momentum | nesterov | adam | adamw | lars | muon
    lr: float = 0.1  # peak learning rate, at the nominal batch size below (muon: of the non-Muon part)
    momentum: float = 0.9  # momentum for SGD variants and LARS; beta1 for Adam
    beta2: float = 0.999  # Adam's second-moment decay
    eps: float = 1e-8  # Adam's denominator term
    weight_decay: float = 5e-4  # the weight block's (adamw: decoupled from the gradient); bias_weight_decay below
    bias_weight_decay: bool = False  # decay the bias block (BN and FC biases, BN weights) too
    bias_lr_scale: float = 1.0  # the bias block's lr multiplier; its weight decay is divided by it (lr x decay kept)
    lars_eta: float = 0.001  # LARS trust coefficient
    # Muon for the deep convs (the bias block, FC weight and first conv take Nesterov SGD with the
    # values above): the step of each filter bank, whose norm is kept at sqrt(out channels), so
    # neither weight decay nor the decoupled form applies; it follows the schedule.
    muon_lr: float = 0.02
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    newton_schulz_steps: int = 5  # iterations of the orthogonalization
    # Decoupled form (airbench's units): lr and weight decay per 1024 examples of steps normalized
    # by 1 + 1/(1 - momentum), so a recipe keeps its meaning when the batch size changes; the
    # steady move per 1024 examples still varies with momentum by a few percent (m/(1+m), m = 1/(1-mu)).
    decoupled: bool = False
    nominal_batch: int = 0  # lr scales linearly with batch / nominal_batch; 0: no scaling


@dataclass
class ScheduleConfig:
    name: str = "cosine"  # constant | cosine | linear | step | poly
    warmup_epochs: float = 0.0  # linear warm-up from warmup_start_fraction of the peak
    warmup_start_fraction: float = 0.0  # of the peak, where the warm-up starts
    final_fraction: float = 0.0  # where the decay ends, after the last step, as a fraction of the peak
    milestones: list[float] = field(default_factory=list)  # step: epochs where lr is multiplied by gamma
    gamma: float = 0.1  # step: the factor at each milestone
    power: float = 2.0  # poly


@dataclass
class DataConfig:
    name: str = "synthetic"  # synthetic | cifar10 | imagefolder
    # a folder with train/ and val/ of class folders of .jpg/.jpeg/.png images (their subfolders
    # are not read); cifar10 takes test/ for val/, reads it as a .tgz/.tar too, and CIFAR's python batches
    root: str = ""
    num_classes: int = 10  # the model's logits follow it (model.num_classes)
    resolution: int = 32  # training crop and evaluation size
    # synthetic: examples to generate; others: examples to take from the split, 0 all (cifar10:
    # CIFAR-10's full 50,000 / 10,000, which the data must hold exactly)
    train_size: int = 0
    val_size: int = 0  # as train_size, of the evaluation split
    crop_padding: int = 4  # small-image random crop: pad by this, crop back
    flip: str = "random"  # random | alternating | none
    cutout: int = 0  # cifar10 training: a square of this side (pixels of the stored image), centered at random, set to the mean; 0 off
    val_resize: float = 1.14  # imagefolder evaluation: resize the short side to resolution*this, center crop
    min_crop_area: float = 0.25  # imagefolder training: random-resized crop area range [this, 1]
    threads: int = 0  # DALI decoding and file-reading threads per rank; 0: the cores shared among local ranks
    host_decode: float = 0.0  # imagefolder on a GPU: the share of each batch decoded by the CPU, the rest by the GPU
    decode_cache: str = ""  # cifar10 archives: a folder keeping what they decode to, for later runs; "" off
    # imagefolder: look at both ends of every JPEG (or PNG under a .jpg name) before training (seconds per million files)
    # (false: a damaged file stops the run only when it is read, or crashes DALI's JPEG parser, a segfault)
    check_files: bool = True
    seed_offset: int = 0  # added to trainer.seed for the data's order and augmentation alone
    tta: int = 0  # evaluation views: 0 none, 1 flip, 2 flip and one-pixel translations


@dataclass
class TrainerConfig:
    epochs: float = 8.0  # fractional: the last epoch stops part way
    batch_size: int = 128  # per GPU
    val_batch_size: int = 0  # 0: batch_size; one larger than a rank's share of the evaluation set is that share, one batch
    drop_last: bool = True  # training: leave out an epoch's last partial batch (evaluation always takes every example)
    # (false: under torchrun the epoch's last (size % ranks) examples are still left out, a different few each
    # epoch, so that every rank takes as many steps of as many examples)
    seed: int = 0  # the model's initial weights, and with data.seed_offset the data's order and augmentation
    label_smoothing: float = 0.0  # the loss's target: 1 - this on the label, this spread over every class
    lowres_epochs: int = 0  # progressive resizing: train these first epochs at lowres_resolution
    lowres_resolution: int = 0  # progressive resizing: the first epochs' crop size
    first_conv_init: str = "default"  # default | whiten (from the training data's patches)
    first_conv_freeze_epochs: float = -1.0  # freeze the first conv after this many epochs; -1 never
    # freeze the BatchNorm right after the first conv (the stem's norm) after this many epochs (-1
    # never): its parameters and running statistics stay fixed and it normalizes with the latter.
    # With the first conv frozen by then, backward stops at the first group from that step on.
    stem_norm_freeze_epochs: float = -1.0
    ema_every: int = 1  # EMA update every this many steps (with the decay raised to that power)
    ema_warmup_power: float = 0.0  # decay grows as (step / steps)^power: young averages forget fast
    lookahead: bool = False  # copy EMA weights back into the model at each EMA update
    checkpoint_every: int = 1  # epochs between checkpoints; 0: only at the end
    keep_checkpoints: int = 2  # the newest checkpoints kept, at least the one a resume reads
    resume: str = ""  # a checkpoint file, or a run directory (its newest checkpoint), to continue from
    stop_after_epoch: int = 0  # end this run after that epoch (as if preempted); resume continues
    log_every: int = 50  # steps between metric reads
    eval_every: int = 1  # epochs between evaluations (the last epoch is always evaluated)
    grad_scale_init: float = 65536.0  # amp with fp16: the loss scale training starts from; halved on an overflow
    grad_scale_growth_interval: int = 2000  # steps without an overflow after which the loss scale doubles


@dataclass
class DistConfig:
    backend: str = "auto"  # auto (nccl on GPUs, gloo on CPU) | nccl | gloo
    shard_optimizer: bool = False  # ZeRO stage 1: each rank keeps and updates a share of M/V (N: replicated)
    deep_conv_buckets: int = 4  # all-reduce buckets over G_DEEP_CONV, issued in reverse layer order
    timeout_s: int = 600  # how long a rank waits for the others in a collective before the job ends
    # mode=plan: the plan of one rank of a job of this many processes, its share of the data
    # and (under shard_optimizer) of the moments; 0: this job's (torchrun's WORLD_SIZE, else 1)
    plan_ranks: int = 0


@dataclass
class BenchConfig:
    steps: int = 40  # timed steps; the median is reported
    warmup: int = 10  # untimed steps before them
    # the hand-written PyTorch loops timed beside ours
    baselines: list[str] = field(default_factory=lambda: ["eager_bf16", "eager_fp16", "compile_bf16"])
    # the plain loops autotune cuDNN, as a loop written for speed does; false leaves them
    # torch's default, cuDNN's heuristic choice (the loop the baselines were timed with)
    baseline_autotune: bool = True
    optimizers: list[str] = field(default_factory=lambda: ["momentum"])  # our step, once per optimizer
    out: str = ""  # also append the table to this markdown file
    profile: int = 0  # also profile this many steps of each method: where its time goes, kernel by kernel
    profile_rows: int = 25  # the largest kernels (operators on a CPU) each profile lists


@dataclass
class TrainConfig:
    mode: str = "train"  # train | plan | eval | export | bench
    amp: bool = False  # mixed precision: forward and backward in half precision (amp_dtype), fp32 master weights
    amp_dtype: str = "fp16"  # fp16 (dynamic loss scaling) | bf16
    ema: bool = False  # keep an exponential moving average of the weights, which evaluation and export read
    ema_decay: float = 0.999  # the average's decay a step
    fold_bn: bool = False  # evaluate with BatchNorm folded into a per-channel scale and bias
    graphs: bool = True  # on a GPU, replay captured CUDA graphs; false runs the same program eagerly
    # the same bits in every run of a configuration, and a resumed run the bits of an
    # uninterrupted one, on a GPU too: deterministic kernels only (trainer/setup.py)
    deterministic: bool = False
    # auto | torch | triton: implementation of the range ops and the model ops (max-pool,
    # BatchNorm); triton (auto's choice on a GPU) also normalizes a ResNet's BatchNorms
    # with their residual add and ReLU in one pass without compile (the stem's with its
    # max-pool, and each shortcut's gradient handed to them), torch keeps ATen's
    kernels: str = "auto"
    compile: bool = False  # run inductor on forward and backward inside the captured step
    # inductor settings for compile=true, over INDUCTOR_DEFAULTS, e.g.
    # +compile_options.coordinate_descent_tuning=false for a shorter first compile
    compile_options: dict[str, Any] = field(default_factory=dict)
    # compile=true: a folder for torch.compile's caches (inductor's and Triton's), to carry
    # or share between machines (trainer/compile_cache.py); "" leaves them where they are
    compile_cache: str = ""
    device: str = "auto"  # auto | cpu | cuda
    checkpoint: str = ""  # eval / export: the checkpoint to read (default: the newest of the run)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)


def register():
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def compose_config(overrides) -> TrainConfig:
    """The validated config that run.py builds from these overrides, for code that makes a
    Trainer itself (benchmarks, tests)."""
    register()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return validate(OmegaConf.to_object(compose("train", overrides=list(overrides))))


_CHOICES = {
    "mode": ("train", "plan", "eval", "export", "bench"),
    "amp_dtype": ("fp16", "bf16"),
    "kernels": ("auto", "torch", "triton"),
    "device": ("auto", "cpu", "cuda"),
    "model.stem": ("imagenet", "cifar"),
    "model.stem_norm": ("bias", "none"),
    "optimizer.name": OPTIMIZERS,
    "schedule.name": ("constant", "cosine", "linear", "step", "poly"),
    "data.name": ("synthetic", "cifar10", "imagefolder"),
    "data.flip": ("random", "alternating", "none"),
    "trainer.first_conv_init": ("default", "whiten"),
    "dist.backend": ("auto", "nccl", "gloo"),
    "data.tta": (0, 1, 2),
}
_POSITIVE = ("model.logit_scale", "optimizer.lars_eta", "trainer.epochs", "trainer.batch_size", "data.resolution", "data.num_classes",
             "trainer.log_every", "optimizer.eps", "trainer.grad_scale_init", "trainer.grad_scale_growth_interval",
             "trainer.ema_every", "trainer.eval_every", "trainer.keep_checkpoints", "dist.deep_conv_buckets", "dist.timeout_s",
             "bench.steps", "bench.profile_rows", "optimizer.newton_schulz_steps", "schedule.power")
_NON_NEGATIVE = ("model.head_std", "optimizer.lr", "optimizer.muon_lr", "trainer.ema_warmup_power", "data.threads",
                 "optimizer.weight_decay", "optimizer.bias_lr_scale", "trainer.val_batch_size",
                 "trainer.lowres_epochs", "trainer.checkpoint_every",
                 "trainer.stop_after_epoch", "schedule.warmup_epochs", "data.train_size", "data.val_size",
                 "data.crop_padding", "data.cutout", "bench.warmup", "bench.profile", "optimizer.nominal_batch",
                 "dist.plan_ranks")
FP32_MAX = 3.4028234663852886e38
EPOCHS_MAX = 1e12  # an epoch count (a run's, a warm-up's, a freeze's) whose steps stay within int64
_FRACTIONS = ("optimizer.momentum", "optimizer.muon_momentum", "optimizer.beta2", "ema_decay", "trainer.label_smoothing",
              "schedule.final_fraction", "schedule.warmup_start_fraction")
_CLOSED_FRACTIONS = ("data.host_decode",)


def _parent(cfg, dotted: str):
    """The node that holds a dotted key's option, and the option's name in it."""
    *parents, last = dotted.split(".")
    return reduce(getattr, parents, cfg), last


def _get(cfg, dotted: str):
    return getattr(*_parent(cfg, dotted))


def options(cfg: TrainConfig) -> dict[str, Any]:
    """Every option of cfg by its dotted key; lists and compile_options are values."""
    def leaves(node, prefix):
        for f in fields(node):
            value = getattr(node, f.name)
            yield from leaves(value, f"{prefix}{f.name}.") if is_dataclass(value) else [(prefix + f.name, value)]
    return dict(leaves(cfg, ""))


# The options of the run that wrote a checkpoint which evaluating it needs: what shapes the
# model and its tensors in the arena (the training batch too, which must fit the training
# set), and the images it was trained on: their size, their classes and, for the embedded
# set, which normalizes by its training images' statistics, the training set's size.
# Evaluation and export take them where their command line does not give them.
CHECKPOINT_OPTIONS = ("amp", "amp_dtype", "ema", "fold_bn", "data.name", "data.root", "data.num_classes",
                      "data.resolution", "data.train_size", "data.val_size", "data.val_resize", "data.tta",
                      "trainer.batch_size", *(f"model.{f.name}" for f in fields(ModelConfig)))
# What one command asks, not what its run is: a resumed run takes every other option from
# its checkpoint where its command line does not give it, so that it trains on as it began.
_INVOCATION = ("mode", "checkpoint", "trainer.resume", "trainer.stop_after_epoch", "dist.plan_ranks")
# What the machine running the command has, which a run resumed on another machine takes
# from there: its cores, its folders, its network; none changes what the run computes.
_MACHINE = ("data.threads", "data.decode_cache", "compile_cache", "dist.timeout_s")
# What a stopped sweep, run again in its folder to go on, may give otherwise than it was
# started with: where its jobs stop next, and the machine's own options.
GOING_ON = ("trainer.stop_after_epoch", *_MACHINE)
RUN_OPTIONS = tuple(key for key in options(TrainConfig())
                    if key not in _INVOCATION + _MACHINE and not key.startswith("bench."))


def take_options(cfg: TrainConfig, written: dict[str, Any], keys, given: set[str]) -> dict[str, Any]:
    """Sets those of cfg's options among `keys` to their `written` values but for those
    `given`; returns those that changed."""
    changed = {key: value for key, value in written.items()
               if key in keys and key not in given and _get(cfg, key) != value}
    for key, value in changed.items():
        setattr(*_parent(cfg, key), value)
    return changed


def given_changes(cfg: TrainConfig, written: dict[str, Any], keys, given: set[str]) -> dict[str, tuple]:
    """Those of cfg's options among `keys` and `given` whose value is not the `written` one:
    (written, cfg's)."""
    return {key: (written[key], _get(cfg, key)) for key in sorted(given)
            if key in keys and key in written and written[key] != _get(cfg, key)}


def given_options(cfg: TrainConfig, named, defaults: TrainConfig) -> set[str]:
    """The options a command line gives: those it names (`named`: keys as it names them; a
    group's choice, model=..., names all of the group's keys, and data=... or
    data.num_classes the model's, which follows it; chosen_keys adds those the chosen group
    options set) and those it changes from `defaults`, the options composed without it."""
    named = set(named) | ({"model.num_classes"} if {"data", "data.num_classes"} & set(named) else set())
    before = options(defaults)
    return {key for key, value in options(cfg).items()
            if value != before.get(key) or any(key == name or key.startswith(name + ".") for name in named)}


def chosen_keys(choices: dict[str, str]) -> set[str]:
    """The keys that the group options a command line chooses (model=..., +experiment=...) set
    in their files, and the groups their defaults lists choose: given as well, as a preset sets
    some to the defaults' own values (+experiment=cifar10_resnet18's optimizer.momentum=0.9),
    which a comparison with the defaults does not see. Hydra's config search path must be set
    up (in a run, or under hydra.initialize)."""
    repository, keys = GlobalHydra.instance().config_loader().repository, set()
    for group, option in choices.items():
        if not (repository.group_exists(group) and repository.config_exists(f"{group}/{option}")):
            continue
        found = repository.load_config(f"{group}/{option}")
        package = found.header.get("package") or group
        keys |= set(_dotted(found.config, "" if package == "_global_" else f"{package}."))
        keys |= {choice.group.lstrip("/") for choice in found.defaults_list if isinstance(choice, GroupDefault)}
    return keys


def _dotted(node, prefix: str):
    for key, value in node.items():
        yield from _dotted(value, f"{prefix}{key}.") if isinstance(value, DictConfig) else [prefix + str(key)]


# Paths a command line gives: the shell leaves a ~ after key= as it is (not an assignment)
PATHS = ("data.root", "data.decode_cache", "compile_cache", "checkpoint", "trainer.resume", "bench.out")


def expand_paths(cfg):
    """cfg's PATHS made absolute, ~ the home folder; cfg a TrainConfig or Hydra's DictConfig
    of one, whose interpolations (${hydra:runtime.cwd}/data) are left to resolve later. A
    checkpoint keeps its run's options, and a resume or evaluation started in another folder
    would read a relative data.root there: another data set, or none."""
    for key in PATHS:
        node, last = _parent(cfg, key)
        if not (isinstance(node, DictConfig) and OmegaConf.is_interpolation(node, last)):
            setattr(node, last, absolute(getattr(node, last)))
    return cfg


def absolute(path: str) -> str:
    """A path given as an option, absolute ('' stays '': not given), from the folder the command
    was started in: a sweep's job under hydra.job.chdir=true runs in its own folder."""
    if not path:
        return path
    started_in = HydraConfig.get().runtime.cwd if HydraConfig.initialized() else os.getcwd()
    return os.path.normpath(os.path.join(started_in, os.path.expanduser(path)))


def recorded(written: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's options as this version keeps them: its paths absolute. Older checkpoints
    kept them as given, relative to the folder their run was started in, which is unknown;
    they are read from this process's, as before, and compared with its absolute ones."""
    return {key: absolute(value) if key in PATHS else value for key, value in written.items()}


def validate(cfg: TrainConfig) -> TrainConfig:
    """Values that type-check but cannot work; the first one found is the message."""
    expand_paths(cfg)
    unknown = _unknown_keys(cfg)
    if unknown:
        raise ConfigError(no_such_key("+" + unknown[0]))
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"{key}={_get(cfg, key)!r} is not one of: {', '.join(map(str, choices))}")
    for key in (*_POSITIVE, *_NON_NEGATIVE):  # nan and inf pass the comparisons below
        if not math.isfinite(_get(cfg, key)):
            raise ConfigError(f"{key}={_get(cfg, key)} must be a finite number")
    for key in _POSITIVE:
        if not _get(cfg, key) > 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be positive")
    for key in _NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must not be negative")
    for key, value in options(cfg).items():  # the fp32 scalars and int64 step counts they become
        epochs = key.endswith("epochs")
        if isinstance(value, float) and math.isfinite(value) and abs(value) > (EPOCHS_MAX if epochs else FP32_MAX):
            raise ConfigError(f"{key}={value:g} is too large: "
                              + (f"at most {EPOCHS_MAX:g} epochs" if epochs else f"fp32 holds at most {FP32_MAX:.2g}"))
    if cfg.fold_bn and cfg.model.name == "fastnet":  # checked here too, for a sweep's jobs before the first
        raise ConfigError("fold_bn=true folds each BatchNorm's weight into its scale, and model=fastnet's BatchNorms "
                          "learn only their bias: use fold_bn=false, or a ResNet")
    if cfg.amp and cfg.amp_dtype == "fp16" and cfg.trainer.grad_scale_init < 1:
        raise ConfigError(f"trainer.grad_scale_init={cfg.trainer.grad_scale_init:g} must be at least 1: fp16 "
                          "gradients scaled down underflow to zero, and the scale grows back only every "
                          "trainer.grad_scale_growth_interval steps")
    if cfg.data.threads > 1024:  # DALI aborts the process, without a message, when it cannot start them
        raise ConfigError(f"data.threads={cfg.data.threads}: at most 1024 threads a rank (0: this host's cores)")
    for key in _FRACTIONS:
        if not 0 <= _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)} must lie in [0, 1)")
    if not 0 < cfg.data.min_crop_area < 1:
        raise ConfigError(f"data.min_crop_area={cfg.data.min_crop_area} must lie in (0, 1): the smallest share of the "
                          f"image a training crop covers")
    if not cfg.data.val_resize >= 1:  # DALI takes a negative size for a flip, and a smaller side cannot be cropped
        raise ConfigError(f"data.val_resize={cfg.data.val_resize} must be at least 1: evaluation resizes an image's "
                          f"short side to data.resolution times it, then crops data.resolution from its center")
    for key in _CLOSED_FRACTIONS:
        if not 0 <= _get(cfg, key) <= 1:
            raise ConfigError(f"{key}={_get(cfg, key)} must lie in [0, 1]")
    if cfg.data.num_classes < 2:  # one class: the loss is 0 whatever the weights, and top-1 is 1
        raise ConfigError(f"data.num_classes={cfg.data.num_classes}: a classifier needs at least 2 classes")
    if cfg.model.num_classes != cfg.data.num_classes:  # fewer: a label past the logits; more: logits no label has
        raise ConfigError(f"model.num_classes={cfg.model.num_classes} with data.num_classes={cfg.data.num_classes}: the "
                          f"model has a logit for each of the data's classes; set data.num_classes, which it follows")
    m = cfg.model  # the shape keys of the model named: torch would fail on them later, or warn and build no layer
    if m.name == "fastnet" and not (m.widths and min(m.widths) > 0):
        raise ConfigError(f"model.widths={m.widths}: model=fastnet needs one or more groups, each of a positive "
                          f"number of channels")
    if m.name == "cifar_resnet" and (m.depth < 8 or (m.depth - 2) % 6):
        raise ConfigError(f"model.depth={m.depth}: model=cifar_resnet's depth is 6n+2 for n >= 1 "
                          f"(8, 14, 20, 32, 44, 56, 110)")
    if m.name == "cifar_resnet" and m.width <= 0:
        raise ConfigError(f"model.width={m.width}: model=cifar_resnet needs a positive number of channels in its "
                          f"first stage")
    if cfg.dist.plan_ranks and cfg.mode != "plan":
        raise ConfigError(f"dist.plan_ranks={cfg.dist.plan_ranks} only applies to mode=plan; a job's ranks are "
                          f"the processes torchrun starts (--nproc_per_node, --nnodes)")
    t = cfg.trainer
    if t.lowres_epochs and not 0 < t.lowres_resolution <= cfg.data.resolution:
        raise ConfigError(f"trainer.lowres_epochs={t.lowres_epochs} needs trainer.lowres_resolution in "
                          f"(0, data.resolution={cfg.data.resolution}], not {t.lowres_resolution}")
    if t.stem_norm_freeze_epochs >= 0 and not 0 <= t.first_conv_freeze_epochs <= t.stem_norm_freeze_epochs:
        raise ConfigError(f"trainer.stem_norm_freeze_epochs={t.stem_norm_freeze_epochs}: the frozen stem norm "
                          f"normalizes with its running statistics, which describe its input only once the "
                          f"first conv is frozen; set trainer.first_conv_freeze_epochs between 0 and "
                          f"{t.stem_norm_freeze_epochs}")
    if t.stem_norm_freeze_epochs == 0:
        raise ConfigError("trainer.stem_norm_freeze_epochs=0: the stem norm needs some training to gather its "
                          "running statistics before it freezes with them; use a positive number of epochs or -1")
    if t.lookahead and not cfg.ema:
        raise ConfigError("trainer.lookahead=true copies the EMA weights back into the model at each EMA update, "
                          "and ema=false keeps none: add ema=true, or drop trainer.lookahead")
    if cfg.data.cutout and cfg.data.name != "cifar10":
        raise ConfigError(f"data.cutout={cfg.data.cutout}: cutout is applied to small images kept on the device "
                          f"(data=cifar10, here data={cfg.data.name}); set data.cutout=0 or use data=cifar10")
    if not -2 ** 63 <= cfg.trainer.seed < 2 ** 64:  # torch's generator takes 64 bits (the data's, the seed mod 2**32)
        raise ConfigError(f"trainer.seed={cfg.trainer.seed} must lie in [-2**63, 2**64)")
    if cfg.optimizer.decoupled and cfg.optimizer.name in ("adam", "adamw"):
        raise ConfigError(f"optimizer.decoupled=true with optimizer={cfg.optimizer.name}: its units are SGD's with "
                          f"momentum (a step's size follows the gradient's), and Adam's step does not; drop it")
    if cfg.optimizer.decoupled and cfg.optimizer.nominal_batch:
        raise ConfigError(f"optimizer.nominal_batch={cfg.optimizer.nominal_batch} with optimizer.decoupled=true, whose "
                          f"learning rate is per example and already scales with the batch: drop one of them")
    if cfg.optimizer.name == "sgd" and cfg.optimizer.momentum:
        raise ConfigError(f"optimizer.momentum={cfg.optimizer.momentum} with optimizer=sgd, which keeps no momentum "
                          f"buffer and would ignore it: use optimizer=momentum or optimizer=nesterov for momentum, or "
                          f"set optimizer.momentum=0")
    if cfg.optimizer.name == "muon" and cfg.optimizer.lr == 0:
        raise ConfigError("optimizer=muon with optimizer.lr=0: lr is the schedule's peak, which Muon's step "
                          "follows too (optimizer.muon_lr at the peak); set a positive lr")
    if cfg.data.name != "synthetic" and not cfg.data.root and cfg.mode not in ("plan", "bench"):
        held = "a folder or .tgz of the data set" if cfg.data.name == "cifar10" else "a folder of train/ and val/"
        raise ConfigError(f"data={cfg.data.name} needs data.root=PATH ({held})")
    if cfg.data.name == "synthetic" and cfg.data.root:  # else the run would train on the embedded set, not on root
        raise ConfigError(f"data.root={cfg.data.root} with data=synthetic, which generates its images and reads no "
                          "files: add data=cifar10 or data=imagefolder to train on it, or drop data.root")
    for name in cfg.bench.baselines:
        if name not in ("eager_bf16", "eager_fp16", "compile_bf16"):
            raise ConfigError(f"bench.baselines: {name!r} is not one of eager_bf16, eager_fp16, compile_bf16")
    for name in cfg.bench.optimizers:
        if name not in OPTIMIZERS:
            raise ConfigError(f"bench.optimizers: {name!r} is not one of {', '.join(OPTIMIZERS)}")
    for key, names in (("bench.baselines", cfg.bench.baselines), ("bench.optimizers", cfg.bench.optimizers)):
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:  # a second row of one name: the ratio columns read the later eager_bf16, the earlier one not 1.00x
            raise ConfigError(f"{key}=[{','.join(names)}] names {', '.join(twice)} more than once: each method is "
                              "timed once; list it once")
    if cfg.mode == "bench" and not (cfg.bench.baselines or cfg.bench.optimizers):  # an empty table, written
        raise ConfigError("bench.baselines and bench.optimizers are both empty: mode=bench has nothing to time; give "
                          "either a method")
    if cfg.mode == "bench" and cfg.bench.out:  # before minutes of timing, whose table it would lose
        out = Path(cfg.bench.out)
        if out.is_dir():
            raise ConfigError(f"bench.out={out} is a folder: give a file to append the table to")
        if not out.parent.is_dir():
            raise ConfigError(f"bench.out={out}: its folder {out.parent} does not exist; make it, or give a file in "
                              "a folder that does")
    _validate_compile_options(cfg)
    if cfg.schedule.name == "step" and not cfg.schedule.milestones:
        raise ConfigError("schedule=step needs schedule.milestones, e.g. [30,60,80]")
    if math.isnan(cfg.schedule.gamma):  # inf is allowed: a test makes a run diverge with it
        raise ConfigError(f"schedule.gamma={cfg.schedule.gamma} is not a number")
    if not cfg.schedule.gamma >= 0:
        raise ConfigError(f"schedule.gamma={cfg.schedule.gamma} must not be negative: the learning rate would turn "
                          "negative and climb the loss")
    if any(isinstance(m, bool) or not isinstance(m, (int, float)) for m in cfg.schedule.milestones):
        raise ConfigError(f"schedule.milestones={cfg.schedule.milestones}: each is a number of epochs")
    if any(math.isnan(m) for m in cfg.schedule.milestones):
        raise ConfigError(f"schedule.milestones={cfg.schedule.milestones}: nan is not a number of epochs")
    if any(not m >= 0 for m in cfg.schedule.milestones):
        raise ConfigError(f"schedule.milestones={cfg.schedule.milestones} must be epochs, not negative")
    if cfg.trainer.resume and cfg.mode in ("plan", "bench"):
        raise ConfigError(f"trainer.resume={cfg.trainer.resume} is read by mode=train (and eval, export); mode="
                          f"{cfg.mode} takes the options given on its command line, not a checkpoint's: drop it")
    if cfg.checkpoint and cfg.mode not in ("eval", "export"):
        raise ConfigError(f"checkpoint={cfg.checkpoint} is read by mode=eval and mode=export only; to continue "
                          f"training from it use trainer.resume={cfg.checkpoint}")
    return cfg


CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("model", "optimizer", "schedule", "data", "experiment")  # conf/'s folders


def refused_override(overrides: list[str]) -> str | None:
    """What to say of the first command-line override that Hydra would refuse: a key the
    configuration does not have (Hydra's message advises +key=value, which the schema then
    refuses as well), a group option that conf/ does not have (where the command line names
    no other folder of configs), or a value of the wrong type for its key (Hydra's messages
    take five to fifteen lines for these), or one Hydra's grammar cannot read (its message
    ends in advice on tracebacks, exit 1); None where there is none."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    if {"-sc", "--shell-completion"} & set(overrides):  # its install=bash, query=bash are Hydra's to read
        return None
    parser, defaults, schema = OverridesParser.create(), options(TrainConfig()), None
    known = set(defaults)
    multirun = bool({"-m", "--multirun", "hydra.mode=MULTIRUN"} & set(overrides))
    # group options may also come from another folder of configs, which Hydra searches
    elsewhere = any(text.lstrip("+").startswith(("--config-dir", "-cd", "--config-path", "-cp", "hydra.searchpath"))
                    for text in overrides)
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException:
            if "=" not in text or text.startswith("-"):  # not an override: "-m", a flag's value
                continue
            key, _, value = text.partition("=")
            quote = '"' if "'" in value else "'"
            return (f"{text}: Hydra's grammar cannot read this override; a value with other characters than ASCII letters, "
                    f"digits and / . - _ goes in quotes: {key}={quote}{value}{quote} (inside the shell's own quotes)")
        key = override.key_or_group
        if key.startswith("compile_options.") and not (override.is_add() or override.is_force_add()
                                                       or override.is_delete() or elsewhere):
            return (f"{text}: compile_options starts empty, and takes an inductor option given with a + in front "
                    f"(+{text})")
        if override.is_delete() and override.package is None and not elsewhere and (
                "." in key and key in known or key in GROUPS and _chosen_by_name(key)):  # Hydra's seven lines
            return (f"{text}: a run needs its {key}; choose another with {key}=... (one of conf/{key}/)" if key in GROUPS
                    else f"{text}: a key of {key.rsplit('.', 1)[0]} cannot be removed; give it another value instead "
                         f"({key}=...)")
        if override.package is not None or override.is_delete() or override.is_hydra_override() \
                or key.startswith("compile_options."):
            continue
        if override.is_sweep_override() and not multirun:  # Hydra's "Ambiguous value", in six lines
            value = text.partition("=")[2]
            quote = '"' if "'" in value else "'"
            return (f"{text} sweeps over values, which only a sweep runs: add -m (--multirun) for a job each"
                    + (f", or give a list in brackets: {key}='[...]'" if isinstance(defaults.get(key), list) else "")
                    # a folder's name may hold a comma (/data/set,v2): quoted, it is one value
                    + (f", or quote a path that holds a comma: {key}={quote}{value}{quote} (inside the shell's own "
                       "quotes)" if key in PATHS else ""))
        try:
            values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        except HydraException:  # an interval, or a glob over a group's options: Hydra's sweeper reads them
            continue
        if key in GROUPS:
            if elsewhere:
                continue
            have = sorted(path.stem for path in (CONF / key).glob("*.yaml"))
            for value in values:
                name = value.removesuffix(".yaml") if isinstance(value, str) else None  # Hydra takes either
                if name is None:  # null, a number: Hydra's traceback ("must be a string or a list")
                    return f"{text}: choose one of {', '.join(have)} (conf/{key}/)"
                if name not in have:
                    near = difflib.get_close_matches(name, have, n=1, cutoff=0.6)
                    return (f"{text}: conf/{key}/ has no {name}.yaml; choose one of {', '.join(have)}"
                            + (f" (did you mean {override.get_key_element()}={near[0]}?)" if near else ""))
            continue
        option = re.sub(r"(\.\d+)+$", "", key)  # schedule.milestones.1=50 sets one item of a list
        if option not in known:
            return no_such_key(override.get_key_element())
        if option != key:  # an item of a list the schema leaves empty (a group's file fills it)
            continue
        schema = schema or OmegaConf.structured(TrainConfig)
        for value in values:
            try:  # as Hydra merges it into the composed configuration, whose types are the schema's
                OmegaConf.update(schema, key, value, merge=True)
            except (OmegaConfBaseException, ValueError) as e:
                return f"{text}: {first_line(e)}"
    return None


def _chosen_by_name(group: str) -> bool:
    """Whether the schema leaves the group's name to its choice (model, optimizer), which
    removing the choice (~model) leaves missing; ~schedule and ~data fall back to the schema's.
    A root key removed (~ema) takes the schema's default; one in a group's node (~trainer.epochs)
    cannot be removed."""
    schema = OmegaConf.structured(TrainConfig)
    return group in schema and OmegaConf.is_missing(schema[group], "name")  # experiment: a preset, no node


def first_line(e: Exception) -> str:
    """An error's message in one line: OmegaConf's own (its msg, without the key and types it
    lists after it), else the error's text, else its repr."""
    return (str(getattr(e, "msg", None) or e).splitlines() or [repr(e)])[0]


def no_such_key(key: str) -> str:
    """The message for a key the configuration does not have, with the nearest one it has."""
    near = difflib.get_close_matches(key.lstrip("+"), options(TrainConfig()), n=1, cutoff=0.8)
    return (f"{key}: the configuration has no such key (trainer/config.py lists every one); "
            + (f"did you mean {near[0]}?" if near else "check its spelling"))


def _unknown_keys(node, prefix: str = "") -> list[str]:
    """Keys a + override added beside the schema's (OmegaConf keeps them on the dataclasses)."""
    names = {f.name for f in fields(node)}
    return [prefix + k for k in vars(node) if k not in names] + [
        key for f in fields(node) if is_dataclass(v := getattr(node, f.name))
        for key in _unknown_keys(v, f"{prefix}{f.name}.")]


# What compile=true asks of inductor unless compile_options says otherwise: tuning each
# fused kernel's launch configuration, 3% off ResNet-50's compiled step on an H200
# (docs/BENCHMARKS.md, session N). It makes a machine's first compile longer (57-73
# against 46 s); inductor's cache keeps what it found for the processes after it.
# Triton's own launcher instead of inductor's static one: torch 2.11 loads statically
# launched kernels from its cache without the tuned configuration (pytorch#172819), so
# every process tuned again, 2.5-6.2 s of ResNet-50's first step. The static launcher
# only shortens each launch, and the step replays them from a CUDA graph.
INDUCTOR_DEFAULTS = {"coordinate_descent_tuning": True, "use_static_cuda_launcher": False}


def _given_options(cfg: TrainConfig) -> dict[str, Any]:
    """compile_options as inductor names them: nested groups joined with dots, so that
    +compile_options.triton.persistent_reductions=false reaches triton.persistent_reductions."""
    def flat(options, prefix=""):
        for key, value in options.items():
            yield from flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(prefix + key, value)]
    return dict(flat(cfg.compile_options))


def compile_options(cfg: TrainConfig) -> dict[str, Any]:
    """The inductor settings of compile=true: INDUCTOR_DEFAULTS, overridden by compile_options."""
    return INDUCTOR_DEFAULTS | _given_options(cfg)


def _validate_compile_options(cfg: TrainConfig):
    """Each key names an inductor setting and its value has that setting's type; inductor
    would otherwise fail (or ignore it) only at the first compilation, after set-up."""
    if cfg.compile_options and not cfg.compile:
        raise ConfigError("compile_options only apply with compile=true; add compile=true or drop them")
    if cfg.compile_cache:
        if not cfg.compile:
            raise ConfigError("compile_cache only applies with compile=true; add compile=true or drop it")
        folder = Path(cfg.compile_cache)
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"compile_cache={folder} is a file; give a folder (made if missing)")
        try:  # made now: the compilers would fail only at the first compile, after set-up
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"compile_cache={folder}: cannot make the folder ({e.strerror}); give one "
                              f"this process can write") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(f"compile_cache={folder}: this process cannot write there; give a folder it can write")
        for part in ("inductor", "triton"):  # the compilers' own folders in it (compile_cache.use_compile_cache)
            if (folder / part).exists() and not (folder / part).is_dir():
                raise ConfigError(f"compile_cache={folder} holds a file named {part}, where the {part} cache goes; "
                                  "move it, or give another folder")
    given = _given_options(cfg)
    if not given:  # inductor's import takes a second or two of every start-up; only its settings need it
        return
    from torch._inductor import config as inductor
    settings = inductor.get_config_copy()
    for key, value in given.items():
        if key not in settings:
            raise ConfigError(f"compile_options.{key}: not an inductor setting (see torch/_inductor/config.py)")
        default = settings[key]
        kind = (int, float) if isinstance(default, float) else type(default)
        if default is not None and not isinstance(value, kind):
            raise ConfigError(f"compile_options.{key}={value!r}: inductor expects a {type(default).__name__} "
                              f"(it is {default!r} now)")


def freeze_epochs(cfg: TrainConfig) -> dict[str, float]:
    """The parts of the model that can be frozen, and after how many epochs (-1: never)."""
    return {"first_conv": cfg.trainer.first_conv_freeze_epochs, "stem_norm": cfg.trainer.stem_norm_freeze_epochs}


def unreached(cfg: TrainConfig, per_epoch: int, steps: int) -> list[str]:
    """What a run of `steps` steps, `per_epoch` an epoch, never reaches of what its options
    set for later, said before it trains: a preset's warm-up (schedule=poly's 5 epochs) or
    milestones (schedule=step's 30, 60, 80), an EMA update interval, low-resolution epochs or
    a freeze set for a longer run than this one. Warm-up, milestones and EMA are counted in
    steps, as the schedule rounds them: 0.9 epochs of warm-up in a run of one 4-step epoch
    is all 4 steps."""
    s, t, out = cfg.schedule, cfg.trainer, []
    warmup = round(s.warmup_epochs * per_epoch)
    if warmup and warmup >= steps:
        out.append(f"schedule.warmup_epochs={s.warmup_epochs:g} is {warmup} steps, not fewer than the run's {steps} "
                   f"(trainer.epochs={t.epochs:g}): the learning rate climbs through the whole run and never reaches its "
                   f"peak")
    # the first milestone's step, as schedule.epoch_step rounds it, after the last step
    if s.name == "step" and s.milestones and round(min(s.milestones) * per_epoch, 9) > steps - 1:
        out.append(f"schedule.milestones={list(s.milestones)} fall after the run's end (trainer.epochs={t.epochs:g}): the "
                   f"learning rate stays at its peak")
    if cfg.ema and t.ema_every >= steps > 1:  # the average is updated at steps 0, ema_every, 2 ema_every, ...
        out.append(f"trainer.ema_every={t.ema_every} is not fewer than the run's {steps} steps: the average is updated at "
                   f"the first step alone, and evaluation, the checkpoints and an export carry the weights after it")
    if t.lowres_epochs >= t.epochs:
        out.append(f"trainer.lowres_epochs={t.lowres_epochs} is not fewer than trainer.epochs={t.epochs:g}: the run never "
                   f"trains at data.resolution={cfg.data.resolution}, which it is evaluated at")
    for part, epochs in freeze_epochs(cfg).items():
        if round(epochs * per_epoch) >= steps:  # the step it freezes from, as setup.freeze_steps rounds it
            out.append(f"trainer.{part}_freeze_epochs={epochs:g} is not fewer than the run's {steps} steps "
                       f"(trainer.epochs={t.epochs:g}): the {part.replace('_', ' ')} never freezes")
    return out


# Options that only some configurations read, with what reads them: set in another, they
# would be ignored without a word. Said before training rather than refused, as a sweep
# crossing ema=true,false with ema_decay=0.99 sets one in each job.
_READ_ONLY_WITH = {
    "amp_dtype": (lambda c: c.amp, "amp=true"),
    **{key: (lambda c: c.ema, "ema=true") for key in ("ema_decay", "trainer.ema_every", "trainer.ema_warmup_power")},
    **{key: (lambda c: c.amp and c.amp_dtype == "fp16", "amp=true and amp_dtype=fp16 (dynamic loss scaling)")
       for key in ("trainer.grad_scale_init", "trainer.grad_scale_growth_interval")},
    "trainer.lowres_resolution": (lambda c: c.trainer.lowres_epochs > 0, "trainer.lowres_epochs > 0"),
    **{key: (lambda c: c.optimizer.name in ("adam", "adamw"), "optimizer=adam or adamw")
       for key in ("optimizer.beta2", "optimizer.eps")},
    "optimizer.lars_eta": (lambda c: c.optimizer.name == "lars", "optimizer=lars"),
    **{key: (lambda c: c.optimizer.name == "muon", "optimizer=muon")
       for key in ("optimizer.muon_lr", "optimizer.muon_momentum", "optimizer.newton_schulz_steps")},
    **{key: (lambda c: c.schedule.name == "step", "schedule=step") for key in ("schedule.milestones", "schedule.gamma")},
    "schedule.power": (lambda c: c.schedule.name == "poly", "schedule=poly"),
    "schedule.final_fraction": (lambda c: c.schedule.name in ("cosine", "linear", "poly"),
                                "schedule=cosine, linear or poly"),
    "schedule.warmup_start_fraction": (lambda c: c.schedule.warmup_epochs > 0, "schedule.warmup_epochs > 0"),
    **{f"model.{key}": (lambda c: c.model.name == "cifar_resnet", "a cifar_resnet model (model=cifar_resnet20 ...)")
       for key in ("depth", "width")},
    **{f"model.{key}": (lambda c: c.model.name == "fastnet", "a fastnet model (model=fastnet, fastnet_tiny)")
       for key in ("widths", "stem_norm", "logit_scale", "head_std")},
    "model.stem": (lambda c: c.model.name.startswith("resnet"), "a torchvision ResNet (model=resnet18 ... resnet101)"),
    "model.pack_relu_masks": (lambda c: c.model.name != "fastnet", "a ResNet"),
    **{f"dist.{key}": (lambda c: ranks()[1] > 1 or c.dist.plan_ranks > 1,
                       "several ranks (a torchrun job, or mode=plan with dist.plan_ranks=N)")
       for key in ("backend", "shard_optimizer", "deep_conv_buckets")},
    **{f"data.{key}": (lambda c: c.data.name == "imagefolder", "data=imagefolder")
       for key in ("min_crop_area", "val_resize", "host_decode", "check_files")},
    "data.crop_padding": (lambda c: c.data.name in ("cifar10", "synthetic"), "data=cifar10 or synthetic (small images)"),
    "data.decode_cache": (lambda c: c.data.name == "cifar10", "data=cifar10"),
}


# What the modes that read a checkpoint's weights do not read: evaluation trains nothing (its order of the
# evaluation set, its views and its data draw nothing from a seed, and it runs no backward, which reads the packed
# ReLU masks); export builds the model alone, on the CPU, and neither trains nor evaluates it: of the data set and
# the trainer's options it reads the number of classes (the model's) and the checkpoint alone. mode=plan and
# mode=bench read no checkpoint, feed no image from the data set and keep no run's course (its seed, checkpoints,
# logs): plan lays out the arena, of the optimizer's options reading its choice alone, and runs nothing; bench times
# steps on random input, whose time the run's length does not change. Keys and groups (optimizer=..., data=...);
# given to the mode, each is said, as ignored() says an option its configuration does not read (a sweep may cross
# one with it), and the configuration is composed without it (app._read_by_mode).
_TRAINING = ("optimizer", "schedule", "ema_decay", "dist.shard_optimizer", "dist.deep_conv_buckets",
             "model.pack_relu_masks",
             *(f"data.{key}" for key in ("crop_padding", "flip", "cutout", "min_crop_area", "seed_offset")),
             *(f"trainer.{key}" for key in ("epochs", "drop_last", "seed", "label_smoothing", "lowres_epochs",
                                            "lowres_resolution", "first_conv_init", "first_conv_freeze_epochs",
                                            "stem_norm_freeze_epochs", "ema_every", "ema_warmup_power", "lookahead",
                                            "checkpoint_every", "keep_checkpoints", "stop_after_epoch", "log_every",
                                            "eval_every", "grad_scale_init", "grad_scale_growth_interval")))
# where and how the model's steps run: export copies the weights out on the CPU and runs none
_RUNNING = ("device", "graphs", "kernels", "compile", "compile_options", "compile_cache", "deterministic",
            "model.cudnn_benchmark")
# how the data set's images are read and augmented, and the course of a run: plan and bench read neither
_FEEDING = (*(f"data.{key}" for key in ("crop_padding", "flip", "cutout", "min_crop_area", "seed_offset", "threads",
                                        "decode_cache", "host_decode", "check_files", "val_resize", "tta")),
            *(f"trainer.{key}" for key in ("seed", "first_conv_init", "checkpoint_every", "keep_checkpoints",
                                           "stop_after_epoch", "log_every", "eval_every")))
_UNREAD_BY_MODE = {"eval": (_TRAINING, (), "it evaluates the checkpoint's weights and trains nothing"),
                   "export": (_TRAINING + _RUNNING + ("data", "trainer", "dist"), ("data.num_classes", "trainer.resume"),
                              "it writes out the checkpoint's weights, on the CPU, and neither trains nor evaluates "
                              "them"),
                   "plan": (_FEEDING + _RUNNING + ("optimizer", "schedule", "ema_decay", "model.pack_relu_masks",
                                                   "dist.backend", "dist.timeout_s",
                                                   *(f"trainer.{key}" for key in (
                                                       "label_smoothing", "ema_every", "ema_warmup_power", "lookahead",
                                                       "grad_scale_init", "grad_scale_growth_interval"))),
                            ("optimizer", "optimizer.name"), "it lays out the arena and runs nothing"),
                   "bench": (_FEEDING + ("trainer.epochs",), (),
                             "it times training steps on random input, with no data set, checkpoint or log")}


def unread_in(mode: str, key: str) -> bool:
    """Whether `mode` reads the option or group `key` in no configuration (optimizer= evaluating, data= exporting)."""
    unread, read, _ = _UNREAD_BY_MODE.get(mode, ((), (), ""))
    return any(key == name or key.startswith(name + ".") for name in unread) and key not in read


def unread_by_mode(cfg: TrainConfig, given: dict[str, str]) -> list[str]:
    """Those of the options a command line gives (`given`: its keys and values as written,
    optimizer=lars as such) that cfg's mode does not read at all: training's in mode=eval."""
    return [f"{key}={value} has no effect with mode={cfg.mode}: {_UNREAD_BY_MODE[cfg.mode][2]}"
            for key, value in given.items() if unread_in(cfg.mode, key)]


def read_by(cfg: TrainConfig, key: str) -> bool:
    """Whether this configuration reads the option `key` (model.widths only a fastnet model; data.tta
    any mode but export)."""
    return (key not in _READ_ONLY_WITH or _READ_ONLY_WITH[key][0](cfg)) and not unread_in(cfg.mode, key)


def ignored(cfg: TrainConfig, given: set[str] | None = None) -> list[str]:
    """The options set away from the schema's defaults that this configuration does not read
    (schedule.gamma without schedule=step, ema_decay without ema=true), and bench's outside
    mode=bench. The group files set only what their own choice reads. `given`: those alone,
    the options a command line gives (a resume's, whose run's own were said as it started)."""
    now, defaults = options(cfg), options(TrainConfig())
    out = [(key, f"{key}={now[key]} has no effect: it is read only with {which}")
           for key, (reads, which) in _READ_ONLY_WITH.items()
           # unread_by_mode says those the mode reads in no configuration
           if now[key] != defaults[key] and not reads(cfg) and not unread_in(cfg.mode, key)]
    out += [(key, f"{key}={value} has no effect: it is read only with mode=bench") for key, value in now.items()
            if key.startswith("bench.") and cfg.mode != "bench" and value != defaults[key]]
    return [why for key, why in out if given is None or key in given]


# Options that set only where training starts, which a checkpoint's state replaces: given to a
# resume (or an evaluation) otherwise than its run's, they change nothing. Said, not refused, as
# nothing goes wrong; a new run is what uses them.
INITIAL_VALUES = {"model.head_std": "the head's initial weights",
                  "trainer.first_conv_init": "the first conv's initial weights",
                  "trainer.grad_scale_init": "the loss scale training starts from"}


def replaced_by_checkpoint(path: str, changed: dict[str, tuple]) -> list[str]:
    """Those of the options a command line changes from the run that wrote the checkpoint at `path`
    (`changed`: its value and this run's, by key) that the checkpoint's state replaces."""
    return [f"{key}={now} has no effect: it sets {INITIAL_VALUES[key]}, and {path} holds its run's own; start a new "
            "run to use it" for key, (_, now) in changed.items() if key in INITIAL_VALUES]


def plan_config(cfg: TrainConfig, schedule_steps: int, world: int = 1) -> PlanConfig:
    return PlanConfig(amp=cfg.amp, amp_dtype=cfg.amp_dtype, ema=cfg.ema, fold_bn=cfg.fold_bn,
                      optimizer=cfg.optimizer.name, schedule_steps=schedule_steps,
                      freeze=tuple(part for part, epochs in freeze_epochs(cfg).items() if epochs >= 0),
                      shards=world if cfg.dist.shard_optimizer else 1,
                      deep_conv_buckets=cfg.dist.deep_conv_buckets)
