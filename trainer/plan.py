"""MemoryPlan: where every persistent tensor lives, decided before training.

Callers allocate through semantic calls (a parameter of a layer kind, BN statistics,
input buffers, ...) and never name a region, so a BN bias cannot land among the
weights. finalize() walks the regions in order with one cursor, writes every offset,
validates the layout and freezes the plan.
"""
import hashlib
import json
from dataclasses import asdict, dataclass
from enum import IntEnum

from trainer.dtensor import DTensor, slot_bytes
from trainer.errors import PlanError
from trainer.regions import CONTIGUOUS_RANGES, FAMILY, HALF_KINDS, Kind, Region, storage_dtype

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw", "lars", "muon")
_WIDE_WEIGHT_GRADS = tuple(FAMILY["G"][k] for k in HALF_KINDS)


@dataclass(frozen=True)
class PlanConfig:
    """What decides which regions are enabled (DESIGN.md, "Regions")."""
    amp: bool = False
    amp_dtype: str = "fp16"  # what the 2-byte float regions hold: fp16 or bf16
    ema: bool = False
    fold_bn: bool = False
    optimizer: str = "momentum"
    schedule_steps: int = 1  # length of the learning-rate table the step graph indexes
    # parts ("first_conv", "stem_norm") held fixed from some step: a stash keeps their values
    freeze: tuple[str, ...] = ()
    # ZeRO stage 1: the moments (M_, V_) are split over this many ranks, each holding 1/shards
    # of every unit (a region, or one bucket of G_DEEP_CONV); 1 keeps them replicated.
    shards: int = 1
    deep_conv_buckets: int = 1  # gradient buckets over G_DEEP_CONV (shard units when sharded)

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.amp_dtype not in ("fp16", "bf16"):
            raise PlanError(f"amp_dtype must be fp16 or bf16, not {self.amp_dtype!r}")
        if self.shards < 1 or self.deep_conv_buckets < 1:
            raise PlanError(f"shards ({self.shards}) and deep_conv_buckets ({self.deep_conv_buckets}) must be >= 1")
        if self.shards > 1 and not self.has_momentum:
            raise PlanError("sharded optimizer state needs an optimizer that keeps some: sgd has none; "
                            "use momentum, nesterov, adam, adamw or lars, or dist.shard_optimizer=false")
        if self.shards > 1 and self.optimizer == "muon":
            raise PlanError("optimizer=muon orthogonalizes whole filter banks, so every rank needs their whole "
                            "momentum: set dist.shard_optimizer=false")

    @property
    def has_momentum(self) -> bool:
        return self.optimizer != "sgd"

    @property
    def has_second_moment(self) -> bool:
        return self.optimizer in ("adam", "adamw")

    def enabled(self, region: Region) -> bool:
        name = region.name
        if name.startswith("W_EQ_"):
            return self.fold_bn
        if name.startswith("E_"):
            return self.ema and (self.amp or not name.endswith("_FP16"))
        if name.startswith("A_") or name in ("S_SCALAR_FP16",) or (
                name.startswith(("G_", "F_")) and name.endswith("_FP16")):
            return self.amp
        if region in _WIDE_WEIGHT_GRADS:  # under AMP the weight block's gradients are its half twins only
            return not self.amp
        if name.startswith("F_"):
            return not self.amp
        if name.startswith("M_"):
            return self.has_momentum
        if name.startswith("V_"):
            return self.has_second_moment
        if name.startswith("N_"):
            return self.optimizer == "lars"
        return True

    def sharded(self, region: Region) -> bool:
        """Does each rank hold only its share of this region? The moments, under sharding.
        N_ stays replicated: it holds whole-tensor norms, summed over the ranks' shares."""
        return self.shards > 1 and region.name.startswith(("M_", "V_"))


class Baseline(IntEnum):
    """Tensors every plan allocates first, so their ids are the same in every run."""
    # S_SCALAR_FP32: hyperparameters the step graph reads from device memory
    LR_BIAS = 0
    LR_WEIGHT = 1
    WEIGHT_DECAY_BIAS = 2
    WEIGHT_DECAY = 3
    MOMENTUM = 4
    BETA1 = 5
    BETA2 = 6
    EPS = 7
    LARS_ETA = 8
    EMA_DECAY = 9
    LOSS_SCALE = 10
    LR_SCHEDULE = 11  # the learning rate of every step, indexed by STEP inside the graph
    LR_MUON = 12  # Muon's step size for the deep convs
    MUON_MOMENTUM = 13
    # S_SCALAR_INT32
    STEP = 14  # training steps taken (the schedule's clock)
    OPT_STEP = 15  # optimizer updates applied (Adam's bias correction); skipped steps don't count
    GOOD_STEPS = 16  # clean steps since the loss scale last changed
    # S_SCALAR_INT8
    OVERFLOW = 17  # this step's gradients were not finite: its update was skipped
    NAN_SEEN = 18  # sticky: some step of the run had a non-finite loss (training stops on it)
    # R_RESULT
    LOSS = 19
    TOP1 = 20
    TOP5 = 21
    # R_RESULT_ACCUMULATED: sums of loss, top-1 hits, top-5 hits, examples
    TRAIN_SUMS = 22
    VAL_SUMS = 23


_BASELINE_REGION = {
    **{b: Region.S_SCALAR_FP32 for b in list(Baseline)[:Baseline.STEP]},
    **{b: Region.S_SCALAR_INT32 for b in (Baseline.STEP, Baseline.OPT_STEP, Baseline.GOOD_STEPS)},
    **{b: Region.S_SCALAR_INT8 for b in (Baseline.OVERFLOW, Baseline.NAN_SEEN)},
    **{b: Region.R_RESULT for b in (Baseline.LOSS, Baseline.TOP1, Baseline.TOP5)},
    Baseline.TRAIN_SUMS: Region.R_RESULT_ACCUMULATED, Baseline.VAL_SUMS: Region.R_RESULT_ACCUMULATED,
}
MAX_GRAD_SLOTS = 4


@dataclass
class ParamTensors:
    """One model parameter's tensors across the families that hold it. g is the gradient
    backward writes: fp32, or under AMP for the weight block its half twin in G_*_FP16,
    which the update unscales as it reads it (no fp32 copy of it is ever kept)."""
    kind: Kind
    w: DTensor
    g: DTensor
    a: DTensor | None = None
    m: DTensor | None = None
    v: DTensor | None = None
    n: DTensor | None = None
    e: DTensor | None = None
    e16: DTensor | None = None


@dataclass
class BNTensors:
    prev_mean: DTensor
    prev_var: DTensor
    next_mean: DTensor
    next_var: DTensor
    eq_scale: DTensor | None = None
    eq_bias: DTensor | None = None


@dataclass
class InputTensors:
    """Per buffer name ("A" | "B"): labels, data and the mask of real (not padding) examples."""
    label: dict
    data: dict
    mask: dict


class MemoryPlan:
    def __init__(self, config: PlanConfig, variant=None):
        self.config = config
        self.variant = variant
        self.tensors: list[DTensor] = []
        self.regions: dict[Region, list[DTensor]] = {r: [] for r in Region}
        self.base: dict[Region, int] = {}
        self.total_bytes: int | None = None
        self._grad_slots: dict[tuple, DTensor] = {}
        for b in Baseline:
            shape = (4,) if b in (Baseline.TRAIN_SUMS, Baseline.VAL_SUMS) else (
                (config.schedule_steps,) if b == Baseline.LR_SCHEDULE else (1,))
            self._place(_BASELINE_REGION[b], b.name.lower(), shape)

    @property
    def frozen(self) -> bool:
        return self.total_bytes is not None

    def __getitem__(self, id_: int) -> DTensor:
        return self.tensors[id_]

    # -- semantic allocation -------------------------------------------------------
    def add_parameter(self, name: str, kind: Kind, shape: tuple) -> ParamTensors:
        """A trainable tensor of a layer kind: master weight, gradient, and whatever the
        configuration adds (half compute weights, moments, LARS norms, EMA)."""
        c = self.config
        half = kind in HALF_KINDS
        p = ParamTensors(kind, w=self._place(FAMILY["W"][kind], name, shape),
                         g=self._place(FAMILY["G16" if c.amp and half else "G"][kind], name + ".grad", shape))
        if c.amp and half:
            p.a = self._place(FAMILY["A"][kind], name + ".half", shape)
        if c.has_momentum and c.shards == 1:  # sharded moments are placed per shard unit
            p.m = self._place(FAMILY["M"][kind], name + ".momentum", shape)
        if c.has_second_moment and c.shards == 1:
            p.v = self._place(FAMILY["V"][kind], name + ".second_moment", shape)
        if c.optimizer == "lars" and half:
            p.n = self._place(FAMILY["N"][kind], name + ".norms", (2,))  # |w|, |g|
        if c.ema:
            p.e = self._place(FAMILY["E"][kind], name + ".ema", shape)
            if c.amp and half:
                p.e16 = self._place(FAMILY["E16"][kind], name + ".ema_half", shape)
        return p

    def add_moment_shard(self, kind: Kind, name: str, elements: int) -> tuple[DTensor, DTensor | None]:
        """This rank's share of the moments of one shard unit: `elements` fp32 values each."""
        m = self._place(FAMILY["M"][kind], name + ".momentum_shard", (elements,))
        v = self._place(FAMILY["V"][kind], name + ".second_moment_shard", (elements,)) \
            if self.config.has_second_moment else None
        return m, v

    def add_bn_statistics(self, name: str, channels: int) -> BNTensors:
        shape = (channels,)
        t = BNTensors(*(self._place(r, f"{name}.{what}", shape) for r, what in (
            (Region.B_PREV_MEAN, "running_mean.prev"), (Region.B_PREV_VAR, "running_var.prev"),
            (Region.B_NEXT_MEAN, "running_mean"), (Region.B_NEXT_VAR, "running_var"))))
        if self.config.fold_bn:
            t.eq_scale = self._place(Region.W_EQ_SCALE, name + ".folded_scale", shape)
            t.eq_bias = self._place(Region.W_EQ_BIAS, name + ".folded_bias", shape)
        return t

    def add_input(self, batch: int, resolution: int, channels: int = 3) -> InputTensors:
        """The double buffer: the loader fills one while the step reads the other."""
        t = InputTensors({}, {}, {})
        for buf, (lr, dr) in {"A": (Region.I_A_LABEL, Region.I_A_DATA),
                              "B": (Region.I_B_LABEL, Region.I_B_DATA)}.items():
            t.label[buf] = self._place(lr, f"input_{buf}.label", (batch,))
            t.data[buf] = self._place(dr, f"input_{buf}.data", (batch, resolution, resolution, channels))
            t.mask[buf] = self.add_mask(f"input_{buf}.mask", (batch,))
        return t

    def add_features(self, name: str, shape: tuple) -> DTensor:
        return self._place(Region.F_FEATURE_FP16 if self.config.amp else Region.F_FEATURE_FP32, name, shape)

    def grad_slot(self, shape: tuple) -> DTensor:
        """A gradient buffer for an activation; requests of the same shape and dtype share one."""
        region = Region.F_GRAD_SLOT_FP16 if self.config.amp else Region.F_GRAD_SLOT_FP32
        key = (tuple(shape), storage_dtype(region, self.config.amp))
        if key not in self._grad_slots:
            if len(self._grad_slots) == MAX_GRAD_SLOTS:
                raise PlanError(f"gradient slot {key} would be the {MAX_GRAD_SLOTS + 1}th; at most "
                                f"{MAX_GRAD_SLOTS} distinct (shape, dtype) gradient slots: "
                                f"{sorted(self._grad_slots)}")
            self._grad_slots[key] = self._place(region, f"grad_slot{len(self._grad_slots)}", shape)
        return self._grad_slots[key]

    def add_predictions(self, batch: int) -> DTensor:
        return self._place(Region.R_PREDICTED_LABEL, "predicted_label", (batch,))

    def add_mask(self, name: str, shape: tuple) -> DTensor:
        return self._place(Region.S_MASK, name, shape)

    def add_temp(self, name: str, shape: tuple, dtype: str) -> DTensor:
        region = {"fp32": Region.T_TEMP_FP32, "fp16": Region.T_TEMP_FP16,
                  "int32": Region.T_TEMP_INT32, "int8": Region.T_TEMP_INT8}[dtype]
        return self._place(region, name, shape)

    def _place(self, region: Region, name: str, shape: tuple) -> DTensor:
        if self.frozen:
            raise PlanError(f"plan is finalized: cannot allocate {name!r} in {region.name}")
        if not self.config.enabled(region):
            raise PlanError(f"region {region.name} is disabled by this configuration: cannot hold {name!r}")
        shape = tuple(int(s) for s in shape)
        if not shape or min(shape) <= 0:
            raise PlanError(f"tensor {name!r} has an empty shape {shape}")
        dtype = storage_dtype(region, self.config.amp)
        t = DTensor(len(self.tensors), name, shape, dtype, region, slot_bytes(shape, dtype, region))
        self.tensors.append(t)
        self.regions[region].append(t)
        return t

    # -- layout --------------------------------------------------------------------
    def finalize(self) -> "MemoryPlan":
        """Write every offset in one pass over the regions, validate, freeze."""
        if self.frozen:
            raise PlanError("plan is already finalized")
        cursor = 0
        for region in Region:
            self.base[region] = cursor
            for t in self.regions[region]:
                t.offset = cursor
                cursor += t.slot_bytes
        self.validate()
        self.total_bytes = cursor
        return self

    def validate(self):
        """The four checks of the design: order, contiguity, layer correspondence, alignment."""
        prev, prev_end = None, 0
        for region in Region:
            base = self.base[region]
            if prev is not None and base < self.base[prev]:
                raise PlanError(f"region order: {region.name} starts at {base}, below "
                                f"{prev.name} at {self.base[prev]}")
            if base < prev_end:
                raise PlanError(f"region order: {region.name} starts at {base}, inside {prev.name}, "
                                f"whose tensors end at {prev_end}")
            cursor = base
            for t in self.regions[region]:
                if t.offset != cursor:
                    raise PlanError(f"tensor {t.name!r} (id {t.id}) in {region.name} is at offset "
                                    f"{t.offset}, expected {cursor}: tensors of a region must be packed")
                cursor += t.slot_bytes
            prev, prev_end = region, cursor
        for start, end in CONTIGUOUS_RANGES:
            for r in range(start, end):
                here, after = Region(r), Region(r + 1)
                if self.base[here] + self.region_bytes(here) != self.base[after]:
                    raise PlanError(f"contiguity: {after.name} does not follow {here.name} directly, "
                                    f"so the range {start.name}..{end.name} is not one span")
        self._validate_correspondence()
        for t in self.tensors:
            if t.offset % 256 or t.slot_bytes % 256:
                raise PlanError(f"alignment: tensor {t.name!r} (id {t.id}) at offset {t.offset} "
                                f"with slot {t.slot_bytes} is not 256-byte aligned")

    def _validate_correspondence(self):
        """Every family that mirrors the master weights holds, kind by kind, the same tensors
        with slots of the same element count, so flat ranges line up element by element."""
        c = self.config
        for kind in Kind:
            master = self.regions[FAMILY["W"][kind]]
            for role in ("G", "M", "V", "E") + (("A", "G16", "E16", "N") if kind in HALF_KINDS else ()):
                region = FAMILY[role][kind]
                if not c.enabled(region):  # this configuration has no such region
                    continue
                twins = self.regions[region]
                if c.sharded(region):
                    self._validate_share(region, FAMILY["W"][kind])
                    continue
                if len(twins) != len(master):
                    raise PlanError(f"layer correspondence: {region.name} holds {len(twins)} tensors, "
                                    f"{FAMILY['W'][kind].name} holds {len(master)}")
                if role == "N":
                    continue
                scale = 2 if twins and twins[0].dtype == "fp16" else 1
                for w, t in zip(master, twins):
                    if w.slot_bytes != t.slot_bytes * scale:
                        raise PlanError(f"layer correspondence: {t.name!r} in {region.name} has a "
                                        f"{t.slot_bytes}-byte slot, which does not line up with "
                                        f"{w.name!r} ({w.slot_bytes} bytes)")

    def _validate_share(self, region: Region, master: Region):
        """A sharded region holds 1/shards of its master range, in whole chunks of 128 values
        (LARS maps chunks to tensors), so the ranks' shares tile the range exactly."""
        held = [t.numel for t in self.regions[region]]
        if sum(held) * self.config.shards != self.region_bytes(master) // 4 or any(n % 128 for n in held):
            raise PlanError(f"sharding: {region.name} holds shares of {held} values; {self.config.shards} "
                            f"ranks' shares must tile {master.name}'s {self.region_bytes(master) // 4} values "
                            f"in whole 128-value chunks")

    def region_bytes(self, region: Region) -> int:
        return sum(t.slot_bytes for t in self.regions[region])

    def range(self, start: Region, end: Region | None = None) -> tuple[int, int]:
        """(offset, bytes) of the regions start..end inclusive, one contiguous span."""
        self._require_frozen()
        end = start if end is None else end
        return self.base[start], self.base[end] + self.region_bytes(end) - self.base[start]

    def _require_frozen(self):
        if not self.frozen:
            raise PlanError("plan is not finalized yet")

    # -- identity ------------------------------------------------------------------
    def layout(self) -> list:
        return [{"index": int(r), "name": r.name, "enabled": self.config.enabled(r),
                 "base_offset": self.base[r], "bytes": self.region_bytes(r),
                 "tensors": [t.to_json() for t in self.regions[r]]} for r in Region]

    def fingerprint(self) -> str:
        """A stable hash of the layout: every tensor's name, shape, region, dtype, offset and slot.
        The shape counts because a slot is rounded up: a 10- and an 11-class head share one."""
        self._require_frozen()
        rows = [(t.id, t.name, list(t.shape), t.region.name, t.dtype, t.offset, t.slot_bytes)
                for t in self.tensors]
        return hashlib.sha256(json.dumps([self.total_bytes, self.config.amp_dtype, rows]).encode()).hexdigest()[:16]

    def sharding(self) -> dict:
        """Bytes per GPU of the sharded moment regions, what they take replicated, and what the
        whole arena saves: less, as the shares' padding grows the regions that mirror the weights."""
        sharded = [r for r in Region if self.config.sharded(r) and self.config.enabled(r)]  # V_ only for Adam
        held = sum(self.region_bytes(r) for r in sharded)
        # replicated, a moment holds one slot per master weight; the sharded plan's master slots are padded
        replicated = sum(slot_bytes(w.shape, "fp32", r) for r in sharded for w in self.regions[Region["W" + r.name[1:]]])
        mirrors = {FAMILY[role][k] for role in ("W", "G", "G16", "A", "E", "E16") for k in FAMILY[role]}
        padding = sum(t.slot_bytes - slot_bytes(t.shape, t.dtype, t.region) for r in mirrors for t in self.regions[r])
        return {"shards": self.config.shards, "sharded_regions": [r.name for r in sharded if self.regions[r]],
                "bytes_per_gpu": held, "replicated_bytes": replicated, "saved_bytes_per_gpu": replicated - held,
                "padding_bytes": padding, "arena_saved_bytes": replicated - held - padding}

    def to_json(self, variants=()) -> dict:
        self._require_frozen()
        return {"total_bytes": self.total_bytes, "fingerprint": self.fingerprint(),
                "config": asdict(self.config),
                "variants": [{"name": v.name, "batch": v.batch, "resolution": v.resolution} for v in variants],
                "regions": self.layout(), **({"sharding": self.sharding()} if self.config.shards > 1 else {})}
