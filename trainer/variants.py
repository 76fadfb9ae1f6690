"""Variants: the shapes one run's step graphs take (batch size, resolution, train or eval)."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    name: str
    batch: int
    resolution: int
    train: bool


def derive_variants(train_size: int, val_size: int, batch: int, val_batch: int, resolution: int,
                    lowres_resolution: int = 0, lowres_epochs: int = 0, drop_last: bool = True) -> list[Variant]:
    """The variants a run needs, train_base first. Sizes are per rank.

    A `last` variant exists when the data does not divide into batches (train: only
    with drop_last off; evaluation never drops); `lowres` ones when progressive resizing
    trains some epochs at a lower resolution.
    """
    tail = train_size % batch if not drop_last else 0
    resolutions = [("", resolution)] + ([("_lowres", lowres_resolution)] if lowres_epochs > 0 else [])
    out = []
    for suffix, res in resolutions:
        out.append(Variant(f"train{suffix or '_base'}", batch, res, True))
        if tail:
            out.append(Variant(f"train{suffix}_last", tail, res, True))
    out.append(Variant("val_base", val_batch, resolution, False))
    if val_size % val_batch:
        out.append(Variant("val_last", val_size % val_batch, resolution, False))
    return out
