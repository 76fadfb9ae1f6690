"""DTensor: a descriptor of one persistent tensor. It owns no memory; an Arena gives it some."""
from dataclasses import dataclass
from math import prod

from trainer.regions import INPUT_DATA, Region

ALIGN = 256
ITEMSIZE = {"fp32": 4, "fp16": 2, "int32": 4, "int8": 1}

# Channel padding of the slot rule: half input data to 4 channels and half feature
# maps, gradient slots and int8 masks to 8, so that vectorized NHWC kernels see
# aligned channel groups.
_HALF_FEATURES = (Region.F_FEATURE_FP16, Region.F_GRAD_SLOT_FP16)


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def padded_channels(shape: tuple, dtype: str, region: Region) -> tuple:
    """The logical NHWC shape with its channel (last) dimension padded as the slot rule says."""
    if dtype == "fp16" and region in INPUT_DATA:
        multiple = 4
    elif (dtype == "fp16" and region in _HALF_FEATURES) or region == Region.S_MASK:
        multiple = 8
    else:
        return tuple(shape)
    *rest, channels = shape
    return (*rest, -(-channels // multiple) * multiple)


def slot_bytes(shape: tuple, dtype: str, region: Region) -> int:
    """fp16: align256(elements*2 + 16); int8: align256(elements + 16); fp32 and int32:
    twice the fp16 slot, so an fp32 range and its fp16 twin line up element by element."""
    elements = prod(padded_channels(shape, dtype, region))
    if dtype == "int8":
        return align(elements + 16)
    half = align(elements * 2 + 16)
    return half if dtype == "fp16" else 2 * half


@dataclass(eq=False)
class DTensor:
    id: int
    name: str
    shape: tuple  # logical NHWC: a conv weight (O, I, kh, kw) is described as (O, kh, kw, I)
    dtype: str  # fp32 | fp16 | int32 | int8
    region: Region
    slot_bytes: int
    offset: int | None = None  # set by MemoryPlan.finalize()

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def to_json(self) -> dict:
        return {"id": self.id, "name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "offset": self.offset, "slot_bytes": self.slot_bytes}
