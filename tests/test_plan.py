"""The memory planner's invariants (DESIGN.md: Regions, slot rule, finalize(), Variants).

Expectations are written out from the design, not computed by the code under test.
"""
import itertools
import sys
from collections import Counter

import pytest
import torch
from torch import nn

from trainer import arena
from trainer.arena import Arena
from trainer.config import compose_config
from trainer.data import build_sources
from trainer.dist import Dist
from trainer.dtensor import slot_bytes
from trainer.errors import PlanError
from trainer.models import build_model
from trainer.plan import Baseline, MemoryPlan, PlanConfig
from trainer.planner import build_plans, classify
from trainer.regions import Kind, Region
from trainer.setup import make_plans
from trainer.variants import Variant, derive_variants

# -- the design, written out ------------------------------------------------------------

DESIGN_REGIONS = [
    "B_PREV_MEAN", "B_PREV_VAR", "B_NEXT_MEAN", "B_NEXT_VAR",
    "W_EQ_BIAS", "W_EQ_SCALE", "W_BN_BIAS", "W_BN_WEIGHT", "W_FC_BIAS", "W_FC_WEIGHT", "W_FIRST_CONV",
    "W_DEEP_CONV",
    "E_BN_BIAS", "E_BN_WEIGHT", "E_FC_BIAS", "E_FC_WEIGHT", "E_FIRST_CONV", "E_DEEP_CONV",
    "E_FC_WEIGHT_FP16", "E_FIRST_CONV_FP16", "E_DEEP_CONV_FP16",
    "A_FC_WEIGHT", "A_FIRST_CONV", "A_DEEP_CONV",
    "G_BN_BIAS", "G_BN_WEIGHT", "G_FC_BIAS", "G_FC_WEIGHT", "G_FIRST_CONV", "G_DEEP_CONV",
    "R_RESULT",
    "G_FC_WEIGHT_FP16", "G_FIRST_CONV_FP16", "G_DEEP_CONV_FP16",
    "M_BN_BIAS", "M_BN_WEIGHT", "M_FC_BIAS", "M_FC_WEIGHT", "M_FIRST_CONV", "M_DEEP_CONV",
    "V_BN_BIAS", "V_BN_WEIGHT", "V_FC_BIAS", "V_FC_WEIGHT", "V_FIRST_CONV", "V_DEEP_CONV",
    "N_FC_WEIGHT", "N_FIRST_CONV", "N_DEEP_CONV",
    "I_A_LABEL", "I_A_DATA", "I_B_LABEL", "I_B_DATA",
    "F_FEATURE_FP32", "F_GRAD_SLOT_FP32", "F_FEATURE_FP16", "F_GRAD_SLOT_FP16",
    "S_SCALAR_FP32", "S_SCALAR_FP16", "S_SCALAR_INT32", "S_SCALAR_INT8", "S_MASK",
    "T_TEMP_FP32", "T_TEMP_FP16", "T_TEMP_INT32", "T_TEMP_INT8",
    "R_PREDICTED_LABEL", "R_RESULT_ACCUMULATED",
]
SIX = ("BN_BIAS", "BN_WEIGHT", "FC_BIAS", "FC_WEIGHT", "FIRST_CONV", "DEEP_CONV")
HALF = ("FC_WEIGHT", "FIRST_CONV", "DEEP_CONV")
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw", "lars", "muon")
# Which optimizer state each optimizer keeps: M first moment / momentum, V second moment, N LARS norms.
OPTIMIZER_STATE = {"sgd": "", "momentum": "M", "nesterov": "M", "adam": "MV", "adamw": "MV", "lars": "MN", "muon": "M"}
# Enabled regions a plan may leave empty (scalars, masks and temporaries some configurations use).
MAY_BE_EMPTY = {"S_SCALAR_FP16", "S_MASK", "T_TEMP_FP32", "T_TEMP_FP16", "T_TEMP_INT32", "T_TEMP_INT8"}


def expected_enabled(amp, ema, fold_bn, optimizer) -> set:
    """DESIGN.md's 'Enabled by configuration' paragraph, with one change (docs/DESIGN.md, "As
    built"): under AMP the weight block's gradients live only in their half twins."""
    on = {"B_PREV_MEAN", "B_PREV_VAR", "B_NEXT_MEAN", "B_NEXT_VAR", "R_RESULT",
          "I_A_LABEL", "I_A_DATA", "I_B_LABEL", "I_B_DATA",
          "S_SCALAR_FP32", "S_SCALAR_INT32", "S_SCALAR_INT8", "S_MASK",
          "T_TEMP_FP32", "T_TEMP_FP16", "T_TEMP_INT32", "T_TEMP_INT8",
          "R_PREDICTED_LABEL", "R_RESULT_ACCUMULATED"}
    on |= {f"W_{k}" for k in SIX} | {f"G_{k}" for k in SIX if not (amp and k in HALF)}
    if fold_bn:
        on |= {"W_EQ_BIAS", "W_EQ_SCALE"}
    if ema:
        on |= {f"E_{k}" for k in SIX}
    if ema and amp:
        on |= {f"E_{k}_FP16" for k in HALF}
    if amp:
        on |= {f"A_{k}" for k in HALF} | {f"G_{k}_FP16" for k in HALF}
        on |= {"S_SCALAR_FP16", "F_FEATURE_FP16", "F_GRAD_SLOT_FP16"}
    else:
        on |= {"F_FEATURE_FP32", "F_GRAD_SLOT_FP32"}
    state = OPTIMIZER_STATE[optimizer]
    if "M" in state:
        on |= {f"M_{k}" for k in SIX}
    if "V" in state:
        on |= {f"V_{k}" for k in SIX}
    if "N" in state:
        on |= {f"N_{k}" for k in HALF}
    return on


ALL_CONFIGS = list(itertools.product((False, True), (False, True), (False, True), OPTIMIZERS))


# -- small models ------------------------------------------------------------------------

def small_model():
    """Conv2d(3,8,3) + BN(8) + Linear(8,10): the hand-computed total below."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 10))


def two_conv_model():
    """Every layer kind: first conv, a deep conv, BN weight and bias, FC weight and bias."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, bias=False), nn.BatchNorm2d(16), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 10))


TRAIN = [Variant("train_base", 2, 8, True)]


def plan_of(model=None, variants=TRAIN, num_classes=10, **config) -> MemoryPlan:
    return build_plans(model or two_conv_model(), PlanConfig(**config), variants, num_classes).main


def shift_from(plan: MemoryPlan, first: Region, delta: int):
    """Move every region from `first` on (bases and tensors) by delta bytes."""
    for r in Region:
        if r >= first:
            plan.base[r] += delta
            for t in plan.regions[r]:
                t.offset += delta


# -- regions -----------------------------------------------------------------------------

def test_regions_are_the_designs_68_in_order():
    assert [r.name for r in Region] == DESIGN_REGIONS
    assert [int(r) for r in Region] == list(range(1, 69))


@pytest.mark.parametrize("amp,ema,fold_bn,optimizer", ALL_CONFIGS)
def test_enabled_regions_follow_the_design_table(amp, ema, fold_bn, optimizer):
    config = PlanConfig(amp=amp, ema=ema, fold_bn=fold_bn, optimizer=optimizer)
    expected = expected_enabled(amp, ema, fold_bn, optimizer)
    assert {r.name for r in Region if config.enabled(r)} == expected

    # The planner fills every enabled region it has something for and nothing else; a
    # disabled region is empty, 0 bytes, and reported as disabled.
    plan = plan_of(amp=amp, ema=ema, fold_bn=fold_bn, optimizer=optimizer)
    filled = {r.name for r in Region if plan.regions[r]}
    assert filled <= expected
    assert expected - MAY_BE_EMPTY <= filled
    for row in plan.layout():
        assert row["enabled"] == (row["name"] in expected)
        if not row["enabled"]:
            assert row["bytes"] == 0 and row["tensors"] == []


def test_unknown_optimizer_is_a_plan_error():
    with pytest.raises(PlanError, match="rmsprop"):
        PlanConfig(optimizer="rmsprop")


# -- slot rule ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape,dtype,region,expected", [
    # fp16: align256(elements*2 + 16)
    ((10,), "fp16", Region.A_FC_WEIGHT, 256),  # 20 + 16 = 36 -> 256
    ((120,), "fp16", Region.A_DEEP_CONV, 256),  # 240 + 16 = 256 exactly
    ((121,), "fp16", Region.A_DEEP_CONV, 512),  # 242 + 16 = 258 -> 512
    ((128,), "fp16", Region.A_DEEP_CONV, 512),  # 256 + 16 = 272 -> 512: the +16 counts
    # fp32 and int32: twice the fp16 slot
    ((10,), "fp32", Region.W_FC_BIAS, 512),
    ((120,), "fp32", Region.W_DEEP_CONV, 512),
    ((121,), "fp32", Region.W_DEEP_CONV, 1024),
    ((120,), "int32", Region.T_TEMP_INT32, 512),
    ((121,), "int32", Region.T_TEMP_INT32, 1024),
    # int8: align256(elements + 16)
    ((240,), "int8", Region.S_SCALAR_INT8, 256),
    ((241,), "int8", Region.T_TEMP_INT8, 512),
    # fp16 input data: channels padded to 4. 4*4*4*4 = 256 elements -> 528 -> 768
    # (unpadded 192 -> 400 -> 512; padded to 8: 512 -> 1040 -> 1280)
    ((4, 4, 4, 3), "fp16", Region.I_A_DATA, 768),
    ((4, 4, 4, 3), "fp16", Region.I_B_DATA, 768),
    # fp32 input data: unpadded. 192 elements -> 400 -> 512, x2 (padded to 4 would be 1536)
    ((4, 4, 4, 3), "fp32", Region.I_A_DATA, 1024),
    # fp16 features and gradient slots: channels padded to 8. 64*16 = 1024 -> 2064 -> 2304
    # (unpadded 640 -> 1296 -> 1536)
    ((64, 10), "fp16", Region.F_FEATURE_FP16, 2304),
    ((64, 10), "fp16", Region.F_GRAD_SLOT_FP16, 2304),
    ((4, 4, 4, 3), "fp16", Region.F_FEATURE_FP16, 1280),  # 512 elements -> 1040 -> 1280
    # fp32 features and gradient slots: unpadded. 640 -> 1296 -> 1536, x2
    ((64, 10), "fp32", Region.F_FEATURE_FP32, 3072),
    ((64, 10), "fp32", Region.F_GRAD_SLOT_FP32, 3072),
    # int8 masks: channels padded to 8. 100*8 = 800 + 16 -> 1024 (unpadded 316 -> 512)
    ((100, 3), "int8", Region.S_MASK, 1024),
    ((5,), "int8", Region.S_MASK, 256),  # 8 + 16 -> 256
    # no padding anywhere else, even for fp16 / int8 of the same shapes
    ((4, 4, 4, 3), "fp16", Region.A_DEEP_CONV, 512),
    ((4, 4, 4, 3), "fp16", Region.T_TEMP_FP16, 512),
    ((64, 10), "fp16", Region.T_TEMP_FP16, 1536),
    ((100, 3), "int8", Region.T_TEMP_INT8, 512),
])
def test_slot_rule_hand_computed(shape, dtype, region, expected):
    assert slot_bytes(shape, dtype, region) == expected


def test_fp32_slot_is_exactly_twice_fp16_and_256_aligned_with_16_spare():
    for n in range(1, 3000, 7):
        for shape in ((n,), (n, 3), (2, n, 1, 5)):
            elements = torch.Size(shape).numel()
            half = slot_bytes(shape, "fp16", Region.A_DEEP_CONV)
            assert half % 256 == 0 and half - 256 < 2 * elements + 16 <= half, shape
            assert slot_bytes(shape, "fp32", Region.W_DEEP_CONV) == 2 * half
            assert slot_bytes(shape, "int32", Region.T_TEMP_INT32) == 2 * half
            byte = slot_bytes(shape, "int8", Region.T_TEMP_INT8)
            assert byte % 256 == 0 and byte - 256 < elements + 16 <= byte, shape


def test_plan_allocations_take_dtype_and_padding_from_their_region():
    amp = MemoryPlan(PlanConfig(amp=True))
    inp = amp.add_input(batch=4, resolution=4, channels=3)
    for buf in "AB":
        assert (inp.data[buf].dtype, inp.data[buf].slot_bytes) == ("fp16", 768)  # C padded to 4
        assert (inp.label[buf].dtype, inp.label[buf].slot_bytes) == ("int32", 512)  # 2*align(8+16)
        mask = inp.mask[buf]  # (4,) int8, padded to 8: 8 + 16 -> 256
        assert (mask.region, mask.dtype, mask.slot_bytes) == (Region.S_MASK, "int8", 256)
    f = amp.add_features("x", (64, 10))
    g = amp.grad_slot((64, 10))
    assert (f.region, f.dtype, f.slot_bytes) == (Region.F_FEATURE_FP16, "fp16", 2304)
    assert (g.region, g.dtype, g.slot_bytes) == (Region.F_GRAD_SLOT_FP16, "fp16", 2304)
    m = amp.add_mask("mask", (100, 3))
    assert (m.region, m.dtype, m.slot_bytes) == (Region.S_MASK, "int8", 1024)
    p = amp.add_parameter("conv", Kind.DEEP_CONV, (4, 4, 4, 3))  # 192 elements: fp16 slot 512
    # under AMP a weight's gradient is its half twin only: no fp32 copy of it
    assert [(t.region, t.dtype, t.slot_bytes) for t in (p.w, p.a, p.g)] == [
        (Region.W_DEEP_CONV, "fp32", 1024), (Region.A_DEEP_CONV, "fp16", 512), (Region.G_DEEP_CONV_FP16, "fp16", 512)]
    assert not amp.regions[Region.G_DEEP_CONV]

    fp32 = MemoryPlan(PlanConfig(amp=False))
    inp = fp32.add_input(batch=4, resolution=4, channels=3)
    assert (inp.data["A"].dtype, inp.data["A"].slot_bytes) == ("fp32", 1024)  # unpadded
    f = fp32.add_features("x", (64, 10))
    assert (f.region, f.dtype, f.slot_bytes) == (Region.F_FEATURE_FP32, "fp32", 3072)
    for dtype, region in (("fp32", Region.T_TEMP_FP32), ("fp16", Region.T_TEMP_FP16),
                          ("int32", Region.T_TEMP_INT32), ("int8", Region.T_TEMP_INT8)):
        t = fp32.add_temp("t", (3,), dtype)
        assert (t.region, t.dtype) == (region, dtype)


# -- totals ------------------------------------------------------------------------------

# Baseline tensors of every plan (schedule_steps=1): S_SCALAR_FP32 14 x (1,) fp32 -> 2*align(2+16)
# = 512 each; S_SCALAR_INT32 3 x 512; S_SCALAR_INT8 2 x align(1+16) = 256; R_RESULT 3 x 512;
# R_RESULT_ACCUMULATED 2 x (4,) fp32 -> 2*align(8+16) = 512 each.
BASELINE_BYTES = 14 * 512 + 3 * 512 + 2 * 256 + 3 * 512 + 2 * 512  # 11776


def test_total_of_a_small_model_by_hand_fp32_sgd():
    plan = plan_of(small_model(), variants=[Variant("train_base", 2, 4, True)], optimizer="sgd")
    # Each fp32 tensor of n elements: 2 * align256(2n + 16). sgd: W and G only.
    conv = 2 * 1024  # (8,3,3,3) = 216 el: 432 + 16 = 448 -> 512, x2 = 1024; W and G
    bn = 2 * 512  # (8,): 16 + 16 -> 256, x2 = 512; W and G, for weight and for bias
    fc_w = 2 * 512  # (10,8) = 80 el: 176 -> 256, x2 = 512; W and G
    fc_b = 2 * 512  # (10,): 36 -> 256, x2 = 512; W and G
    bn_stats = 4 * 512  # prev/next mean/var, (8,) each
    # per buffer A and B: label int32 (2,) 512; data fp32 (2,4,4,3) = 96 el: 208 -> 256, x2 = 512;
    # mask int8 (2,) padded to 8: 24 -> 256
    inputs = 2 * (512 + 512 + 256)
    head = 512 + 512 + 512  # logits fp32 (2,10): 56 -> 256, x2; its gradient slot; predictions int32 (2,)
    expected = BASELINE_BYTES + conv + 2 * bn + fc_w + fc_b + bn_stats + inputs + head
    assert expected == 24064
    assert plan.total_bytes == expected
    assert plan.total_bytes == sum(plan.region_bytes(r) for r in Region)


def test_total_of_a_small_model_by_hand_amp_ema_lars():
    plan = plan_of(small_model(), variants=[Variant("train_base", 2, 4, True)],
                   amp=True, ema=True, optimizer="lars")
    # conv (8,3,3,3) = 216 el: fp16 slot align(448) = 512, fp32 1024.
    # W, M, E fp32; A, G16, E16 fp16 (no fp32 G under AMP); N (2,) fp32 = 2*align(4+16) = 512.
    conv = 3 * 1024 + 3 * 512 + 512
    # BN weight / bias (8,): W, G, M, E at 512 each (no half twins, no LARS norms).
    bn = 4 * 512
    # fc weight (10,8) = 80 el: fp16 align(176) = 256, fp32 512. W, M, E + A, G16, E16 + N.
    fc_w = 3 * 512 + 3 * 256 + 512
    fc_b = 4 * 512  # (10,): W, G, M, E
    bn_stats = 4 * 512
    # per buffer: label int32 512; data fp16 (2,4,4,3) padded to C=4: 128 el -> 272 -> 512;
    # mask int8 (2,) -> 256
    inputs = 2 * (512 + 512 + 256)
    # logits fp16 (2,10) padded to C=16: 32 el -> 80 -> 256; its gradient slot the same;
    # predictions int32 (2,) 512
    head = 256 + 256 + 512
    # LARS: one int32 chunk index per 128 fp32 elements of the weight block (W_FC_WEIGHT +
    # W_FIRST_CONV = 512 + 1024 bytes = 384 elements -> 3 chunks): (3,) int32 -> 512
    lars_temp = 512
    expected = BASELINE_BYTES + conv + 2 * bn + fc_w + fc_b + bn_stats + inputs + head + lars_temp
    assert expected == 32000
    assert plan.total_bytes == expected


# -- finalize() and its four validations -------------------------------------------------

LARS_AMP_EMA = dict(amp=True, ema=True, optimizer="lars")


def test_finalized_plan_is_packed_aligned_and_valid():
    plan = plan_of(**LARS_AMP_EMA)
    cursor = 0
    for r in Region:
        assert plan.base[r] == cursor
        for t in plan.regions[r]:
            assert t.offset == cursor and t.offset % 256 == 0 and t.slot_bytes % 256 == 0
            cursor += t.slot_bytes
    assert plan.total_bytes == cursor
    ids = sorted(t.id for r in Region for t in plan.regions[r])
    assert ids == list(range(len(plan.tensors)))  # every tensor in exactly one region
    plan.validate()


def test_a_plan_moved_as_a_whole_stays_valid():
    plan = plan_of(**LARS_AMP_EMA)
    shift_from(plan, Region.B_PREV_MEAN, 256)
    plan.validate()


def test_validation_region_order():
    plan = plan_of(**LARS_AMP_EMA)
    plan.base[Region.W_BN_BIAS] = 0
    with pytest.raises(PlanError, match="region order.*W_BN_BIAS"):
        plan.validate()


def test_validation_tensor_not_packed_in_its_region():
    plan = plan_of(**LARS_AMP_EMA)
    t = plan.regions[Region.W_DEEP_CONV][0]
    t.offset += 256
    with pytest.raises(PlanError) as e:
        plan.validate()
    assert t.name in str(e.value) and "W_DEEP_CONV" in str(e.value)


def test_validation_region_overrunning_the_next():
    plan = plan_of(**LARS_AMP_EMA)
    plan.regions[Region.F_FEATURE_FP16][-1].slot_bytes += 256  # now overlaps F_GRAD_SLOT_FP16
    with pytest.raises(PlanError) as e:
        plan.validate()
    assert "F_GRAD_SLOT_FP16" in str(e.value) and "F_FEATURE_FP16" in str(e.value)


CONTIGUOUS = [(Region.B_PREV_MEAN, Region.B_NEXT_VAR), (Region.G_BN_BIAS, Region.G_FIRST_CONV),
              (Region.I_A_LABEL, Region.I_B_DATA), (Region.E_FC_WEIGHT_FP16, Region.E_DEEP_CONV_FP16)]


@pytest.mark.parametrize("after", [Region(r) for start, end in CONTIGUOUS for r in range(start + 1, end + 1)],
                         ids=lambda r: r.name)
def test_validation_contiguity(after):
    plan = plan_of(**LARS_AMP_EMA)
    shift_from(plan, after, 256)  # a gap just below `after`, inside a range one op covers
    with pytest.raises(PlanError, match=f"contiguity: {after.name} "):
        plan.validate()


@pytest.mark.parametrize("optimizer,region", [
    ("lars", Region.G_DEEP_CONV_FP16), ("lars", Region.G_BN_WEIGHT), ("lars", Region.G_FC_BIAS),
    ("lars", Region.M_FC_WEIGHT), ("lars", Region.E_FIRST_CONV), ("lars", Region.A_DEEP_CONV),
    ("lars", Region.G_FIRST_CONV_FP16), ("lars", Region.E_FC_WEIGHT_FP16), ("lars", Region.N_DEEP_CONV),
    ("lars", Region.W_DEEP_CONV), ("adam", Region.V_BN_BIAS),
], ids=lambda x: getattr(x, "name", x))
def test_validation_layer_correspondence_count(optimizer, region):
    plan = MemoryPlan(PlanConfig(amp=True, ema=True, optimizer=optimizer))
    plan.add_parameter("conv1.weight", Kind.FIRST_CONV, (8, 3, 3, 3))
    plan.add_parameter("conv2.weight", Kind.DEEP_CONV, (8, 3, 3, 8))
    plan.add_parameter("bn.weight", Kind.BN_WEIGHT, (8,))
    plan.add_parameter("bn.bias", Kind.BN_BIAS, (8,))
    plan.add_parameter("fc.weight", Kind.FC_WEIGHT, (10, 8))
    plan._place(region, "stray", (8,))
    with pytest.raises(PlanError, match=f"layer correspondence.*{region.name}"):
        plan.finalize()
    assert not plan.frozen


@pytest.mark.parametrize("region", [Region.A_DEEP_CONV, Region.G_DEEP_CONV_FP16, Region.E_DEEP_CONV,
                                    Region.M_DEEP_CONV], ids=lambda r: r.name)
def test_validation_layer_correspondence_slot(region):
    plan = plan_of(**LARS_AMP_EMA)
    t = plan.regions[region][-1]  # the last of its region, so packing still holds
    assert t.slot_bytes >= 512
    t.slot_bytes -= 256
    with pytest.raises(PlanError, match="layer correspondence") as e:
        plan.validate()
    assert t.name in str(e.value)


def test_validation_alignment_of_an_offset():
    plan = plan_of(**LARS_AMP_EMA)
    shift_from(plan, Region.R_RESULT_ACCUMULATED, 16)
    with pytest.raises(PlanError, match="alignment.*train_sums"):
        plan.validate()


def test_validation_alignment_of_a_slot():
    plan = plan_of(**LARS_AMP_EMA)
    plan.regions[Region.R_RESULT_ACCUMULATED][-1].slot_bytes += 16  # the plan's last tensor
    with pytest.raises(PlanError, match="alignment.*val_sums"):
        plan.validate()


def test_allocation_after_finalize_is_an_error():
    plan = MemoryPlan(PlanConfig(amp=True))
    plan.add_parameter("conv.weight", Kind.FIRST_CONV, (8, 3, 3, 3))
    plan.grad_slot((2, 10))
    plan.finalize()
    n = len(plan.tensors)
    for allocate in (lambda: plan.add_parameter("late.weight", Kind.DEEP_CONV, (8, 3, 3, 8)),
                     lambda: plan.add_bn_statistics("late_bn", 8),
                     lambda: plan.add_input(2, 4),
                     lambda: plan.add_features("late", (2, 10)),
                     lambda: plan.grad_slot((2, 20)),
                     lambda: plan.add_predictions(2),
                     lambda: plan.add_mask("late", (2, 8)),
                     lambda: plan.add_temp("late", (4,), "fp32")):
        with pytest.raises(PlanError, match="finalized"):
            allocate()
    assert len(plan.tensors) == n
    with pytest.raises(PlanError, match="already finalized"):
        plan.finalize()


@pytest.mark.parametrize("config,region", [
    (PlanConfig(), Region.W_EQ_SCALE), (PlanConfig(), Region.E_DEEP_CONV),
    (PlanConfig(ema=True), Region.E_DEEP_CONV_FP16), (PlanConfig(), Region.A_DEEP_CONV),
    (PlanConfig(), Region.G_FC_WEIGHT_FP16), (PlanConfig(), Region.S_SCALAR_FP16),
    (PlanConfig(amp=True), Region.F_FEATURE_FP32), (PlanConfig(), Region.F_GRAD_SLOT_FP16),
    (PlanConfig(optimizer="sgd"), Region.M_BN_BIAS), (PlanConfig(optimizer="momentum"), Region.V_FC_WEIGHT),
    (PlanConfig(optimizer="adam"), Region.N_FC_WEIGHT),
], ids=lambda x: getattr(x, "name", ""))
def test_allocation_into_a_disabled_region_is_an_error(config, region):
    plan = MemoryPlan(config)
    with pytest.raises(PlanError, match=f"{region.name}.*disabled|disabled.*{region.name}"):
        plan._place(region, "stray", (8,))
    assert plan.regions[region] == []


def test_range_is_one_span_of_whole_regions():
    plan = plan_of(**LARS_AMP_EMA)
    regions = [Region(r) for r in range(Region.G_BN_BIAS, Region.G_FIRST_CONV + 1)]
    assert plan.range(Region.G_BN_BIAS, Region.G_FIRST_CONV) == (
        plan.base[Region.G_BN_BIAS], sum(plan.region_bytes(r) for r in regions))
    assert plan.range(Region.W_DEEP_CONV) == (plan.base[Region.W_DEEP_CONV], plan.region_bytes(Region.W_DEEP_CONV))
    with pytest.raises(PlanError, match="not finalized"):
        MemoryPlan(PlanConfig()).range(Region.G_BN_BIAS)


# -- the fp32 ranges and their fp16 twins ------------------------------------------------

@pytest.mark.parametrize("fp32,fp16", [
    ((Region.W_FC_WEIGHT, Region.W_DEEP_CONV), (Region.A_FC_WEIGHT, Region.A_DEEP_CONV)),
    ((Region.E_FC_WEIGHT, Region.E_DEEP_CONV), (Region.E_FC_WEIGHT_FP16, Region.E_DEEP_CONV_FP16)),
], ids=["W-A", "E-E16"])
def test_fp32_range_and_fp16_twin_line_up_element_for_element(fp32, fp16):
    model = build_model("cifar_resnet", 10, depth=20, width=16)  # 3x3 and 1x1 convs of many sizes
    plan = plan_of(model, **LARS_AMP_EMA)

    def tensors(start, end):
        return [t for r in range(start, end + 1) for t in plan.regions[Region(r)]]

    wide, narrow = tensors(*fp32), tensors(*fp16)
    assert len(wide) == len(narrow) == 22  # 1 FC weight + 1 first conv + 20 deep convs
    w0, a0 = plan.base[fp32[0]], plan.base[fp16[0]]
    for w, a in zip(wide, narrow):
        assert (w.dtype, a.dtype) == ("fp32", "fp16")
        assert w.shape == a.shape and a.name.startswith(w.name.removesuffix(".grad").removesuffix(".ema"))
        assert (w.offset - w0) % 4 == 0 and (a.offset - a0) % 2 == 0
        assert (w.offset - w0) // 4 == (a.offset - a0) // 2, w.name
        assert w.slot_bytes // 4 >= w.numel
    assert plan.range(*fp32)[1] == 2 * plan.range(*fp16)[1]  # one flat cast covers both


# -- baseline tensors ----------------------------------------------------------------------

BASELINE = [  # id, name, region, shape (schedule_steps=7)
    (0, "lr_bias", "S_SCALAR_FP32", (1,)), (1, "lr_weight", "S_SCALAR_FP32", (1,)),
    (2, "weight_decay_bias", "S_SCALAR_FP32", (1,)), (3, "weight_decay", "S_SCALAR_FP32", (1,)),
    (4, "momentum", "S_SCALAR_FP32", (1,)), (5, "beta1", "S_SCALAR_FP32", (1,)),
    (6, "beta2", "S_SCALAR_FP32", (1,)), (7, "eps", "S_SCALAR_FP32", (1,)),
    (8, "lars_eta", "S_SCALAR_FP32", (1,)), (9, "ema_decay", "S_SCALAR_FP32", (1,)),
    (10, "loss_scale", "S_SCALAR_FP32", (1,)), (11, "lr_schedule", "S_SCALAR_FP32", (7,)),
    (12, "lr_muon", "S_SCALAR_FP32", (1,)), (13, "muon_momentum", "S_SCALAR_FP32", (1,)),
    (14, "step", "S_SCALAR_INT32", (1,)), (15, "opt_step", "S_SCALAR_INT32", (1,)),
    (16, "good_steps", "S_SCALAR_INT32", (1,)),
    (17, "overflow", "S_SCALAR_INT8", (1,)), (18, "nan_seen", "S_SCALAR_INT8", (1,)),
    (19, "loss", "R_RESULT", (1,)), (20, "top1", "R_RESULT", (1,)), (21, "top5", "R_RESULT", (1,)),
    (22, "train_sums", "R_RESULT_ACCUMULATED", (4,)), (23, "val_sums", "R_RESULT_ACCUMULATED", (4,)),
]
REGION_DTYPE = {"S_SCALAR_FP32": "fp32", "S_SCALAR_INT32": "int32", "S_SCALAR_INT8": "int8",
                "R_RESULT": "fp32", "R_RESULT_ACCUMULATED": "fp32"}


@pytest.mark.parametrize("amp,ema,fold_bn,optimizer", ALL_CONFIGS)
def test_baseline_tensors_at_fixed_ids(amp, ema, fold_bn, optimizer):
    config = PlanConfig(amp=amp, ema=ema, fold_bn=fold_bn, optimizer=optimizer, schedule_steps=7)
    plans = build_plans(two_conv_model(), config, TRAIN + [Variant("val_base", 3, 8, False)], 10)
    assert [b.value for b in Baseline] == [row[0] for row in BASELINE]
    for plan in plans.plans.values():
        for id_, name, region, shape in BASELINE:
            t = plan[id_]
            assert (t.id, t.name, t.region.name, t.shape, t.dtype) == (id_, name, region, shape, REGION_DTYPE[region])
        assert plan[Baseline.LOSS].name == "loss" and plan[Baseline.STEP].name == "step"
        assert plan[Baseline.OVERFLOW].name == "overflow" and plan[Baseline.LOSS_SCALE].name == "loss_scale"


# -- variants ------------------------------------------------------------------------------

def test_derive_variants_names_batches_and_resolutions():
    got = derive_variants(train_size=1000, val_size=250, batch=64, val_batch=100, resolution=32,
                          lowres_resolution=16, lowres_epochs=2, drop_last=False)
    assert [(v.name, v.batch, v.resolution, v.train) for v in got] == [
        ("train_base", 64, 32, True), ("train_last", 40, 32, True),  # 1000 = 15*64 + 40
        ("train_lowres", 64, 16, True), ("train_lowres_last", 40, 16, True),
        ("val_base", 100, 32, False), ("val_last", 50, 32, False)]  # 250 = 2*100 + 50
    got = derive_variants(1000, 200, 64, 100, 32, drop_last=True)
    assert [(v.name, v.batch) for v in got] == [("train_base", 64), ("val_base", 100)]


@pytest.mark.parametrize("amp", [False, True])
def test_offsets_agree_across_variants_and_slot_is_the_max(amp):
    variants = derive_variants(1000, 250, 64, 100, 32, lowres_resolution=16, lowres_epochs=2,
                               drop_last=False)
    assert len(variants) == 6
    plans = build_plans(two_conv_model(), PlanConfig(amp=amp, ema=True, optimizer="adam"), variants, 10)
    by_variant = [plans.plans[v.name] for v in variants]
    assert len({p.total_bytes for p in by_variant}) == 1
    assert len({len(p.tensors) for p in by_variant}) == 1
    for same_id in zip(*(p.tensors for p in by_variant)):
        first = same_id[0]
        for t in same_id:
            assert (t.id, t.name, t.region, t.dtype, t.offset) == (
                first.id, first.name, first.region, first.dtype, first.offset), t.name
        own = [slot_bytes(t.shape, t.dtype, t.region) for t in same_id]
        assert all(t.slot_bytes == max(own) for t in same_id), first.name

    # The shapes stay each variant's own; the input slot is set by the largest (val_base, 100).
    data = {v.name: plans.tensors[v.name].input.data["A"] for v in variants}
    assert data["train_lowres"].shape == (64, 16, 16, 3) and data["val_last"].shape == (50, 32, 32, 3)
    assert data["train_base"].slot_bytes == slot_bytes((100, 32, 32, 3), data["val_base"].dtype,
                                                       Region.I_A_DATA)
    assert slot_bytes((64, 32, 32, 3), data["train_base"].dtype, Region.I_A_DATA) < data["train_base"].slot_bytes


# -- gradient slots ----------------------------------------------------------------------

@pytest.mark.parametrize("amp", [False, True])
def test_gradient_slots_are_reused_by_shape_and_at_most_four(amp):
    plan = MemoryPlan(PlanConfig(amp=amp))
    region = Region.F_GRAD_SLOT_FP16 if amp else Region.F_GRAD_SLOT_FP32
    a = plan.grad_slot((8, 10))
    assert plan.grad_slot((8, 10)) is a and plan.grad_slot([8, 10]) is a
    b, c, d = plan.grad_slot((8, 4, 4, 16)), plan.grad_slot((8, 2, 2, 32)), plan.grad_slot((4, 10))
    assert len({id(x) for x in (a, b, c, d)}) == 4
    assert plan.regions[region] == [a, b, c, d]
    assert {t.dtype for t in plan.regions[region]} == {"fp16" if amp else "fp32"}
    assert plan.grad_slot((4, 10)) is d  # a known shape is still served when all four are taken
    with pytest.raises(PlanError, match="at most 4"):
        plan.grad_slot((2, 10))
    assert len(plan.regions[region]) == 4


# -- the planner's classification --------------------------------------------------------

def kind_counts(model):
    params, bns = classify(model)
    assert sum(torch.Size(s).numel() for _, _, s in params) == sum(p.numel() for p in model.parameters())
    return Counter(k for _, k, _ in params), len(bns), {n: (k, s) for n, k, s in params}


@pytest.mark.parametrize("name,deep,bn,fc_in", [
    ("resnet18", 19, 20, 512), ("resnet34", 35, 36, 512),  # 1 + 2 per block + 3 downsample convs
    ("resnet50", 52, 53, 2048), ("resnet101", 103, 104, 2048),  # 1 + 3 per block + 4 downsample
])
def test_classify_torchvision_resnets(name, deep, bn, fc_in):
    kinds, bns, params = kind_counts(build_model(name, 1000))
    assert kinds == {Kind.FIRST_CONV: 1, Kind.DEEP_CONV: deep, Kind.BN_WEIGHT: bn, Kind.BN_BIAS: bn,
                     Kind.FC_WEIGHT: 1, Kind.FC_BIAS: 1}
    assert bns == bn
    assert params["conv1.weight"] == (Kind.FIRST_CONV, (64, 7, 7, 3))  # NHWC: (O, kh, kw, I)
    assert params["fc.weight"] == (Kind.FC_WEIGHT, (1000, fc_in))


def test_classify_resnet18_cifar_stem():
    _, _, params = kind_counts(build_model("resnet18", 10, stem="cifar"))
    assert params["conv1.weight"] == (Kind.FIRST_CONV, (64, 3, 3, 3))


@pytest.mark.parametrize("depth,width", [(20, 8), (20, 16), (20, 64), (56, 16)])
def test_classify_cifar_resnets(depth, width):
    kinds, bns, params = kind_counts(build_model("cifar_resnet", 10, depth=depth, width=width))
    n = (depth - 2) // 6
    convs = 1 + 3 * n * 2 + 2  # stem, two per block, shortcut convs into stages 2 and 3
    assert kinds == {Kind.FIRST_CONV: 1, Kind.DEEP_CONV: convs - 1, Kind.BN_WEIGHT: convs,
                     Kind.BN_BIAS: convs, Kind.FC_WEIGHT: 1, Kind.FC_BIAS: 1}
    assert bns == convs
    assert params["conv1.weight"] == (Kind.FIRST_CONV, (width, 3, 3, 3))
    assert params["fc.weight"] == (Kind.FC_WEIGHT, (10, 4 * width))


def test_classify_fastnet():
    kinds, bns, params = kind_counts(build_model("fastnet", 10, widths=(64, 256, 256)))
    # stem conv + 2 convs per group; BN scales are fixed (bias-only BN); the head has no bias
    assert kinds == {Kind.FIRST_CONV: 1, Kind.DEEP_CONV: 6, Kind.BN_BIAS: 7, Kind.FC_WEIGHT: 1}
    assert bns == 7
    assert params["stem.weight"] == (Kind.FIRST_CONV, (24, 2, 2, 3))
    assert params["fc.weight"] == (Kind.FC_WEIGHT, (10, 256))


def test_fastnet_without_stem_norm_skips_the_stems_backward():
    """stem_norm=none: with the stem conv frozen no parameter lies upstream of the first
    group, so backward computes no gradient for the stem's output."""
    model = build_model("fastnet", 10, widths=(16, 32, 32), stem_norm="none")
    kinds, bns, _ = kind_counts(model)
    assert kinds[Kind.BN_BIAS] == bns == 6
    model.stem.weight.requires_grad_(False)
    stem_out = []
    model.stem.register_forward_hook(lambda m, i, out: stem_out.append(out))
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert not stem_out[0].requires_grad and model.groups[0].conv1.weight.grad is not None


def test_plan_holds_every_classified_tensor():
    model = build_model("resnet18", 10, stem="cifar")
    plan = plan_of(model, **LARS_AMP_EMA)
    counts = {r: len(plan.regions[r]) for r in Region}
    assert counts[Region.W_FIRST_CONV] == counts[Region.A_FIRST_CONV] == counts[Region.N_FIRST_CONV] == 1
    assert counts[Region.W_DEEP_CONV] == counts[Region.A_DEEP_CONV] == counts[Region.G_DEEP_CONV_FP16] == 19
    assert counts[Region.W_BN_WEIGHT] == counts[Region.B_NEXT_MEAN] == counts[Region.B_PREV_VAR] == 20
    assert counts[Region.W_FC_WEIGHT] == counts[Region.W_FC_BIAS] == counts[Region.E_FC_BIAS] == 1


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))


def test_unplaceable_layers_are_listed_all_at_once():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8),
                          nn.Conv2d(8, 8, 3, bias=True), nn.LayerNorm(8), nn.Embedding(5, 8),
                          Scaled(), nn.Linear(8, 10))
    for call in (lambda: classify(model), lambda: build_plans(model, PlanConfig(), TRAIN, 10)):
        with pytest.raises(PlanError) as e:
            call()
        message = str(e.value)
        for offender in ("2.bias", "3.weight", "3.bias", "4.weight", "5.gain"):
            assert offender in message
        for placeable in ("0.weight", "1.weight", "2.weight", "6.weight"):
            assert placeable not in message


def test_fold_bn_needs_affine_batchnorm():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8, affine=False),
                          nn.Flatten(), nn.Linear(8, 10))
    with pytest.raises(PlanError, match="BatchNorms without one .*use fold_bn=false"):
        build_plans(model, PlanConfig(fold_bn=True), TRAIN, 10)
    plan = plan_of(model, fold_bn=False)
    assert len(plan.regions[Region.B_NEXT_MEAN]) == 1 and plan.regions[Region.W_BN_WEIGHT] == []


# -- sharded optimizer state ---------------------------------------------------------------

def moment_bytes(plan: MemoryPlan) -> int:
    return sum(plan.region_bytes(r) for r in Region if r.name.startswith(("M_", "V_")))


@pytest.mark.parametrize("config", [dict(optimizer="momentum"), dict(optimizer="nesterov"), dict(optimizer="adam"),
                                    dict(optimizer="adamw", amp=True, ema=True), dict(optimizer="lars", amp=True),
                                    dict(optimizer="adam", freeze=("first_conv", "stem_norm"))],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sharding_states_what_the_moments_take_and_what_the_arena_saves(config):
    """What mode=plan says one rank of eight saves, against the replicated plan: its moment
    regions (a one-moment optimizer has no V_ to count), and its whole arena, which is
    smaller by less, since padding the units to whole shares grows the weights, gradients
    and their twins. Frozen parts stash the same in both."""
    model = build_model("fastnet", 10)
    replicated, sharded = (build_plans(model, PlanConfig(shards=n, deep_conv_buckets=4, **config), TRAIN, 10).main
                           for n in (1, 8))
    s = sharded.sharding()
    assert s["bytes_per_gpu"] == moment_bytes(sharded)
    assert s["replicated_bytes"] == moment_bytes(replicated)
    assert s["saved_bytes_per_gpu"] == s["replicated_bytes"] - s["bytes_per_gpu"]
    assert s["arena_saved_bytes"] == replicated.total_bytes - sharded.total_bytes
    assert s["padding_bytes"] == s["saved_bytes_per_gpu"] - s["arena_saved_bytes"] > 0


# -- fingerprint -------------------------------------------------------------------------

def fingerprint(num_classes=10, width=8, batch=64, **config):
    model = build_model("cifar_resnet", num_classes, width=width)
    return build_plans(model, PlanConfig(**config), [Variant("train_base", batch, 16, True)],
                       num_classes).fingerprint()


def test_fingerprint_is_stable():
    torch.manual_seed(0)
    a = fingerprint(amp=True, optimizer="lars")
    torch.manual_seed(1)  # other initial weights: same layout
    assert fingerprint(amp=True, optimizer="lars") == a


@pytest.mark.parametrize("change", [
    dict(num_classes=11),  # the same slots as 10 classes: only the shapes tell them apart
    dict(width=9), dict(width=16), dict(batch=63),
    dict(optimizer="adam"), dict(optimizer="sgd"), dict(amp=True), dict(ema=True), dict(fold_bn=True),
    dict(amp=True, amp_dtype="bf16"),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_fingerprint_changes_with_model_and_config(change):
    base = dict(optimizer="momentum", amp=True) if change.get("amp_dtype") else dict(optimizer="momentum")
    assert fingerprint(**{**base, **change}) != fingerprint(**base)


# -- arena -------------------------------------------------------------------------------

@pytest.mark.parametrize("override, region", [("trainer.epochs=1e12", "S_SCALAR_FP32"), ("data.resolution=1000000", "I_A_DATA")])
def test_an_arena_too_large_for_the_device_names_its_size_and_what_sets_it(override, region, monkeypatch):
    """Over the 128 TiB of a process's address space: the CPU allocator refuses at once on any
    machine, however much memory it has or overcommits (here without the host's free memory
    to compare with, as where the kernel does not say it)."""
    monkeypatch.setattr(arena, "host_memory_available", lambda: None)
    _, plans, _ = make_plans(compose_config([override]))
    with pytest.raises(PlanError, match=rf"^the arena of [\d,]+ bytes \([\d,.]+ GiB\) cannot be allocated on cpu; "
                                        rf"its largest regions: {region} .*trainer.epochs sets the size of the learning-rate "
                                        rf"table .*mode=plan lists every region$"):
        Arena(plans.main)


def test_an_arena_larger_than_the_hosts_free_memory_is_refused_before_it_is_filled(monkeypatch):
    """One that the address space holds but the host's memory does not would be filled with
    zeros until the kernel killed the process, without a message."""
    _, plans, _ = make_plans(compose_config([]))
    if sys.platform == "linux":  # the kernel says it there
        assert arena.host_memory_available() > 0
    monkeypatch.setattr(arena, "host_memory_available", lambda: plans.main.total_bytes - 1)
    with pytest.raises(PlanError, match=r"cannot be allocated on cpu \(0.0 GiB of this host's memory is free\); its "
                                        r"largest regions: "):
        Arena(plans.main)
    monkeypatch.setattr(arena, "host_memory_available", lambda: plans.main.total_bytes)
    assert Arena(plans.main).storage.numel() == plans.main.total_bytes


@pytest.mark.parametrize("limit, used, cache, expected", [("max", "0", 0, 8 << 30), (str(6 << 30), str(5 << 30), 0, 1 << 30),
                                                        (str(6 << 30), str(5 << 30), 2 << 30, 3 << 30),
                                                        (str(4 << 30), str(5 << 30), 0, 0)])
def test_the_hosts_free_memory_is_the_kernels_estimate_under_the_cgroups_limit(tmp_path, limit, used, cache, expected):
    """In a container the cgroup's limit less its use bounds it, the page cache it can drop not
    counted as used (a pod that has just read its data set is not full); never below 0."""
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text(f"MemTotal: {16 << 20} kB\nMemAvailable: {8 << 20} kB\n")
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/job/step\n")
    group = tmp_path / "sys" / "fs" / "cgroup" / "job" / "step"
    group.mkdir(parents=True)
    (group / "memory.max").write_text(limit + "\n")
    (group / "memory.current").write_text(used + "\n")
    (group / "memory.stat").write_text(f"anon 1\nfile {cache + 5}\ninactive_file {cache}\n")
    assert arena.host_memory_available(tmp_path) == expected
    assert arena.host_memory_available(tmp_path / "elsewhere") is None  # not Linux: nothing to go by


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_limit_on_a_group_above_the_process_bounds_it_too(tmp_path, version):
    """A scheduler's limit set on the job's group, the process in a task's group below it
    without one of its own: only the process's own group was read."""
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text(f"MemAvailable: {8 << 20} kB\n")
    (tmp_path / "proc" / "self" / "cgroup").write_text("4:memory:/job/step/task_0\n" if version == "v1"
                                                       else "0::/job/step/task_0\n")
    files = ({"limit": "memory.limit_in_bytes", "used": "memory.usage_in_bytes", "cache": "total_inactive_file"}
             if version == "v1" else {"limit": "memory.max", "used": "memory.current", "cache": "inactive_file"})
    hierarchy = tmp_path / "sys" / "fs" / "cgroup" / ("memory" if version == "v1" else "")
    unlimited = str(2**63 - 4096) if version == "v1" else "max"
    for folder, limit, used in (("job", unlimited, 5 << 30), ("job/step", str(6 << 30), 5 << 30),
                                ("job/step/task_0", unlimited, 4 << 30)):
        (hierarchy / folder).mkdir(parents=True)
        (hierarchy / folder / files["limit"]).write_text(limit + "\n")
        (hierarchy / folder / files["used"]).write_text(f"{used}\n")
        (hierarchy / folder / "memory.stat").write_text(f"{files['cache']} {1 << 29}\n")
    assert arena.host_memory_available(tmp_path) == (1 << 30) + (1 << 29)


@pytest.mark.parametrize("group, folder", [("/job/step", "job/step"), ("/host/path/of/the/container", "")])
@pytest.mark.parametrize("limit, expected", [(str(6 << 30), 3 << 30), (str(2**63 - 4096), 8 << 30)])
def test_a_cgroup_v1_memory_limit_bounds_the_free_memory(tmp_path, group, folder, limit, expected):
    """cgroup v1's memory controller (limit_in_bytes less usage_in_bytes, total_inactive_file
    not counted as used), in its group's folder or, in a container that mounts its own group
    at the hierarchy's root and shows the host's path, there; its "no limit" is a number
    beyond the host's memory. It was not read: a v1 container's limit was not seen."""
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text(f"MemTotal: {16 << 20} kB\nMemAvailable: {8 << 20} kB\n")
    (tmp_path / "proc" / "self" / "cgroup").write_text(f"5:devices:/\n4:memory:{group}\n1:cpu,cpuacct:/\n0::/\n")
    memory = tmp_path / "sys" / "fs" / "cgroup" / "memory" / folder
    memory.mkdir(parents=True)
    (memory / "memory.limit_in_bytes").write_text(limit + "\n")
    (memory / "memory.usage_in_bytes").write_text(f"{5 << 30}\n")
    (memory / "memory.stat").write_text(f"inactive_file 1\ntotal_inactive_file {2 << 30}\n")
    assert arena.host_memory_available(tmp_path) == expected


# -- the evaluation batch ----------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 3])
def test_an_evaluation_batch_larger_than_a_ranks_share_of_the_set_is_planned_as_that_share(world):
    """Such a batch never runs: the share is served as one batch, which val_last ran while the
    arena held inputs for val_base's (5000x16 against 1024x16 on one rank)."""
    cfg = compose_config(["trainer.val_batch_size=5000"])
    _, val = build_sources(cfg, torch.device("cpu"), 0, world, None)
    share = -(-1024 // world)  # the synthetic set's 1024 evaluation images, split among the ranks
    assert val.size == share
    larger, whole = (make_plans(compose_config([f"trainer.val_batch_size={n}"]), world)[1] for n in (5000, share))
    assert [(v.name, v.batch) for v in larger.variants if not v.train] == [("val_base", share)]
    assert larger.main.total_bytes == whole.main.total_bytes


def test_an_evaluation_batch_larger_than_the_set_evaluates_as_one_of_the_set(tmp_path):
    from trainer.loop import Trainer
    results = []
    for val_batch in (100, 5000):
        cfg = compose_config(["data.train_size=256", "data.val_size=100", "trainer.batch_size=32", "trainer.epochs=1",
                              f"trainer.val_batch_size={val_batch}"])
        trainer = Trainer(cfg, tmp_path / str(val_batch), Dist())
        assert [(v.name, v.batch) for v in trainer.engine.plans.variants if not v.train] == [("val_base", 100)]
        summary = trainer.fit()
        results.append((summary["val_loss"], summary["val_top1"]))
    assert results[0] == results[1] and 0 < results[0][1] <= 1
