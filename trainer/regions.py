"""The 68 semantic regions of a MemoryPlan, low address to high, and the ranges range ops cover."""
from enum import IntEnum


class Region(IntEnum):
    B_PREV_MEAN = 1
    B_PREV_VAR = 2
    B_NEXT_MEAN = 3
    B_NEXT_VAR = 4
    W_EQ_BIAS = 5
    W_EQ_SCALE = 6
    W_BN_BIAS = 7
    W_BN_WEIGHT = 8
    W_FC_BIAS = 9
    W_FC_WEIGHT = 10
    W_FIRST_CONV = 11
    W_DEEP_CONV = 12
    E_BN_BIAS = 13
    E_BN_WEIGHT = 14
    E_FC_BIAS = 15
    E_FC_WEIGHT = 16
    E_FIRST_CONV = 17
    E_DEEP_CONV = 18
    E_FC_WEIGHT_FP16 = 19
    E_FIRST_CONV_FP16 = 20
    E_DEEP_CONV_FP16 = 21
    A_FC_WEIGHT = 22
    A_FIRST_CONV = 23
    A_DEEP_CONV = 24
    G_BN_BIAS = 25
    G_BN_WEIGHT = 26
    G_FC_BIAS = 27
    G_FC_WEIGHT = 28
    G_FIRST_CONV = 29
    G_DEEP_CONV = 30
    R_RESULT = 31
    G_FC_WEIGHT_FP16 = 32
    G_FIRST_CONV_FP16 = 33
    G_DEEP_CONV_FP16 = 34
    M_BN_BIAS = 35
    M_BN_WEIGHT = 36
    M_FC_BIAS = 37
    M_FC_WEIGHT = 38
    M_FIRST_CONV = 39
    M_DEEP_CONV = 40
    V_BN_BIAS = 41
    V_BN_WEIGHT = 42
    V_FC_BIAS = 43
    V_FC_WEIGHT = 44
    V_FIRST_CONV = 45
    V_DEEP_CONV = 46
    N_FC_WEIGHT = 47
    N_FIRST_CONV = 48
    N_DEEP_CONV = 49
    I_A_LABEL = 50
    I_A_DATA = 51
    I_B_LABEL = 52
    I_B_DATA = 53
    F_FEATURE_FP32 = 54
    F_GRAD_SLOT_FP32 = 55
    F_FEATURE_FP16 = 56
    F_GRAD_SLOT_FP16 = 57
    S_SCALAR_FP32 = 58
    S_SCALAR_FP16 = 59
    S_SCALAR_INT32 = 60
    S_SCALAR_INT8 = 61
    S_MASK = 62
    T_TEMP_FP32 = 63
    T_TEMP_FP16 = 64
    T_TEMP_INT32 = 65
    T_TEMP_INT8 = 66
    R_PREDICTED_LABEL = 67
    R_RESULT_ACCUMULATED = 68


class Kind(IntEnum):
    """Layer kinds of parameters. The order is the order of the W_, E_, G_, M_, V_ regions."""
    BN_BIAS = 0
    BN_WEIGHT = 1
    FC_BIAS = 2
    FC_WEIGHT = 3
    FIRST_CONV = 4
    DEEP_CONV = 5


def _family(pattern: str, kinds=tuple(Kind)) -> dict:
    return {k: Region[pattern.format(k.name)] for k in kinds}


# Half-precision twins (and LARS norms) exist only for the weight block kinds.
HALF_KINDS = (Kind.FC_WEIGHT, Kind.FIRST_CONV, Kind.DEEP_CONV)
# Per role, the region that holds each layer kind: W master weights, E EMA, A half
# compute weights, G gradients (G16 their half twins), M/V moments, N LARS norms.
FAMILY = {
    "W": _family("W_{}"), "E": _family("E_{}"), "G": _family("G_{}"),
    "M": _family("M_{}"), "V": _family("V_{}"),
    "A": _family("A_{}", HALF_KINDS), "G16": _family("G_{}_FP16", HALF_KINDS),
    "E16": _family("E_{}_FP16", HALF_KINDS), "N": _family("N_{}", HALF_KINDS),
}

# Region ranges that one range op covers as a single flat span; finalize() checks
# that each is contiguous.
CONTIGUOUS_RANGES = (
    (Region.B_PREV_MEAN, Region.B_NEXT_VAR),
    (Region.G_BN_BIAS, Region.G_FIRST_CONV),
    (Region.I_A_LABEL, Region.I_B_DATA),
    (Region.E_FC_WEIGHT_FP16, Region.E_DEEP_CONV_FP16),
)


INPUT_DATA = (Region.I_A_DATA, Region.I_B_DATA)
_INT32 = (Region.I_A_LABEL, Region.I_B_LABEL, Region.S_SCALAR_INT32, Region.T_TEMP_INT32,
          Region.R_PREDICTED_LABEL)
_INT8 = (Region.S_SCALAR_INT8, Region.S_MASK, Region.T_TEMP_INT8)


def storage_dtype(region: Region, amp: bool) -> str:
    """What a region stores: fp32, fp16 (any 2-byte float: fp16 or bf16), int32 or int8.
    Input data is half precision under AMP, so the first conv reads it without a cast."""
    if region in INPUT_DATA:
        return "fp16" if amp else "fp32"
    if region in _INT32:
        return "int32"
    if region in _INT8:
        return "int8"
    if region.name.startswith("A_") or region.name.endswith("FP16"):
        return "fp16"
    return "fp32"
