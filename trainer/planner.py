"""The planner: from a model, a PlanConfig and the variants, one MemoryPlan per variant.

Every variant's plan allocates the same tensors in the same order (only shapes that
depend on batch and resolution differ); each tensor then gets the largest slot any
variant needs, so a DTensor id has the same offset in every plan and one arena
serves all of them.
"""
from dataclasses import dataclass

from torch import nn

from trainer.dtensor import DTensor
from trainer.errors import PlanError
from trainer.plan import BNTensors, InputTensors, MemoryPlan, ParamTensors, PlanConfig
from kernels.reference import CHUNK
from trainer.regions import FAMILY, HALF_KINDS, Kind
from trainer.variants import Variant

_BN_STATS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass
class ModelTensors:
    """Handles into one variant's plan for what binding and the step program touch."""
    params: dict[str, ParamTensors]  # by qualified parameter name
    bn: dict[str, BNTensors]  # by BatchNorm module name
    input: InputTensors
    features: DTensor  # logits of an evaluation batch, summed over test-time views
    grad_slot: DTensor  # gradient of the loss with respect to the logits
    predictions: DTensor


@dataclass
class Plans:
    variants: list[Variant]
    plans: dict[str, MemoryPlan]
    tensors: dict[str, ModelTensors]

    @property
    def main(self) -> MemoryPlan:
        return self.plans[self.variants[0].name]

    @property
    def total_bytes(self) -> int:
        return self.main.total_bytes

    def fingerprint(self) -> str:
        return self.main.fingerprint()

    def to_json(self) -> dict:
        return self.main.to_json(self.variants)


def logical_shape(t) -> tuple:
    """NCHW torch shape -> the logical NHWC shape a DTensor describes."""
    return (t.shape[0], *t.shape[2:], t.shape[1]) if t.dim() == 4 else tuple(t.shape)


def bn_eps(model: nn.Module) -> set[float]:
    return {m.eps for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def first_conv(model: nn.Module) -> nn.Conv2d:
    """The conv that sees the input: the first Conv2d in module order."""
    return next(m for m in model.modules() if isinstance(m, nn.Conv2d))


def stem_norm(model: nn.Module) -> nn.Module | None:
    """The BatchNorm right after the first conv, before any other conv: the stem's
    normalization (FastNet's bias-only BatchNorm, a ResNet's bn1), if there is one."""
    convs = 0
    for m in model.modules():
        convs += isinstance(m, nn.Conv2d)
        if convs == 1 and isinstance(m, nn.modules.batchnorm._BatchNorm):
            return m
        if convs > 1:
            return None
    return None


def freezable(model: nn.Module, part: str) -> tuple[str, nn.Module]:
    """The qualified name and module of a part that can freeze: "first_conv", or "stem_norm",
    the BatchNorm right after it."""
    target = first_conv(model) if part == "first_conv" else stem_norm(model)
    if target is None:
        raise PlanError("cannot freeze the stem's norm: the model has no BatchNorm right after its first "
                        "conv (FastNet with model.stem_norm=none has none); drop trainer.stem_norm_freeze_epochs")
    return next((name, m) for name, m in model.named_modules() if m is target)


def frozen_tensors(model: nn.Module, part: str, params: dict[str, ParamTensors],
                   bn: dict[str, BNTensors]) -> list[DTensor]:
    """What freezing a part holds fixed: its parameters' weights and, for a norm, its running
    statistics (which it normalizes with once frozen). Not their moments: only the part's
    own update reads them, and the weights it moves are put back; and under ZeRO-1 a rank
    holds a share of a unit's moments, not a tensor's, so holding them would also make a
    sharded plan's stash differ from a replicated one's."""
    name, module = freezable(model, part)
    prefix = f"{name}." if name else ""
    out = [params[prefix + n].w for n, _ in module.named_parameters(recurse=False)]
    return out + ([bn[name].next_mean, bn[name].next_var] if name in bn else [])


def classify(model: nn.Module) -> tuple[list[tuple[str, Kind, tuple]], list[tuple[str, int]]]:
    """Every parameter's layer kind and every BatchNorm's channel count, in module order.
    Anything else that holds a parameter or buffer cannot be placed: all are listed at once."""
    params, bns, unplaceable, seen_conv = [], [], [], False
    for mname, module in model.named_modules():
        prefix = f"{mname}." if mname else ""
        own = list(module.named_parameters(recurse=False))
        buffers = [(n, b) for n, b in module.named_buffers(recurse=False) if b is not None]
        if isinstance(module, nn.Conv2d):
            for n, p in own:
                if n == "weight":
                    params.append((prefix + n, Kind.DEEP_CONV if seen_conv else Kind.FIRST_CONV, logical_shape(p)))
                else:
                    unplaceable.append(f"{prefix}{n} (Conv2d {n}: drop it, a BatchNorm follows)")
            seen_conv = True
        elif isinstance(module, nn.modules.batchnorm._BatchNorm):
            kinds = {"weight": Kind.BN_WEIGHT, "bias": Kind.BN_BIAS}
            params += [(prefix + n, kinds[n], tuple(p.shape)) for n, p in own]
            if module.track_running_stats:
                bns.append((mname, module.num_features))
            unplaceable += [f"{prefix}{n} ({type(module).__name__} buffer)" for n, _ in buffers if n not in _BN_STATS]
        elif isinstance(module, nn.Linear):
            kinds = {"weight": Kind.FC_WEIGHT, "bias": Kind.FC_BIAS}
            params += [(prefix + n, kinds[n], tuple(p.shape)) for n, p in own]
        else:
            unplaceable += [f"{prefix}{n} ({type(module).__name__})" for n, _ in own + buffers]
    if unplaceable:
        raise PlanError("the planner cannot place these tensors (it knows Conv2d weights, Linear, "
                        "BatchNorm): " + ", ".join(unplaceable))
    return params, bns


def unit_sizes(kind: Kind, numels: list[int], deep_conv_buckets: int) -> list[int]:
    """How many consecutive tensors of a layer kind each unit holds. A unit is what one
    gradient collective covers: the whole region, except that deep convs split into up to
    `deep_conv_buckets` buckets of about equal size, which all-reduce while backward is still
    producing the earlier layers' gradients. Sharded moments are split unit by unit."""
    parts = deep_conv_buckets if kind == Kind.DEEP_CONV else 1
    total, sizes, done, count = sum(numels), [], 0, 0
    for n in numels:
        done, count = done + n, count + 1
        if len(sizes) < parts - 1 and done * parts >= total * (len(sizes) + 1):
            sizes.append(count)
            count = 0
    return sizes + [count] if count else sizes


def _shard_moments(plan: MemoryPlan, placed: dict[str, ParamTensors]):
    """ZeRO stage 1: pad every unit to whole 128-value chunks per rank (the last tensor's slot
    grows, in every family that mirrors the weights, so the families still line up), then
    place this rank's share of the unit's moments."""
    c = plan.config
    for kind in Kind:
        params = [p for p in placed.values() if p.kind == kind]
        start = 0
        for i, size in enumerate(unit_sizes(kind, [p.w.numel for p in params], c.deep_conv_buckets)):
            unit, start = params[start:start + size], start + size
            fp32_bytes = sum(p.w.slot_bytes for p in unit)
            pad = -fp32_bytes % (c.shards * CHUNK * 4)
            last = unit[-1]
            for t in (last.w, last.g, last.e, last.a, last.e16):
                if t is not None:
                    t.slot_bytes += pad // 2 if t.dtype == "fp16" else pad
            plan.add_moment_shard(kind, f"{kind.name.lower()}.unit{i}", (fp32_bytes + pad) // 4 // c.shards)


def _allocate(plan: MemoryPlan, model: nn.Module, params, bns, variant: Variant, num_classes: int,
              in_channels: int) -> ModelTensors:
    placed = {name: plan.add_parameter(name, kind, shape) for name, kind, shape in params}
    if plan.config.shards > 1:
        _shard_moments(plan, placed)
    stats = {name: plan.add_bn_statistics(name, channels) for name, channels in bns}
    c = plan.config
    frozen = [x for part in c.freeze for x in frozen_tensors(model, part, placed, stats)]
    if frozen:
        plan.add_temp("freeze_stash", (sum(x.numel for x in frozen),), "fp32")
    if plan.config.optimizer == "lars":
        weight_block = sum(plan.region_bytes(FAMILY["W"][k]) for k in HALF_KINDS)
        plan.add_temp("lars_chunk_segment", (weight_block // 4 // CHUNK,), "int32")
    inputs = plan.add_input(variant.batch, variant.resolution, in_channels)
    logits = (variant.batch, num_classes)
    return ModelTensors(placed, stats, inputs, plan.add_features("logits", logits), plan.grad_slot(logits),
                        plan.add_predictions(variant.batch))


def build_plans(model: nn.Module, config: PlanConfig, variants: list[Variant], num_classes: int,
                in_channels: int = 3) -> Plans:
    if config.fold_bn and any(m.weight is None or m.bias is None for m in model.modules()
                              if isinstance(m, nn.modules.batchnorm._BatchNorm)):
        raise PlanError("fold_bn=true folds each BatchNorm's weight into its scale, and this model has BatchNorms "
                        "without one (the fast nets' learn only their bias): use fold_bn=false, or a ResNet")
    if config.fold_bn and len(bn_eps(model)) > 1:
        raise PlanError(f"fold_bn needs one eps for every BatchNorm, not {sorted(bn_eps(model))}")
    params, bns = classify(model)
    plans, tensors = {}, {}
    for v in variants:
        plans[v.name] = MemoryPlan(config, v)
        tensors[v.name] = _allocate(plans[v.name], model, params, bns, v, num_classes, in_channels)
    for same_id in zip(*(p.tensors for p in plans.values())):
        largest = max(t.slot_bytes for t in same_id)
        for t in same_id:
            t.slot_bytes = largest
    for p in plans.values():
        p.finalize()
    return Plans(list(variants), plans, tensors)
