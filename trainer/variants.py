"""Variants: the shapes one run's step graphs take (batch size, resolution, train or eval)."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    name: str
    batch: int
    resolution: int
    train: bool
    frozen: bool = False  # a training step after every freeze (trainer.*_freeze_epochs) has happened


def derive_variants(train_size: int, val_size: int, batch: int, val_batch: int, resolution: int,
                    lowres_resolution: int = 0, lowres_epochs: int = 0, drop_last: bool = True,
                    late_freeze: bool = False) -> list[Variant]:
    """The variants a run needs, train_base first. Sizes are per rank.

    A `last` variant exists when the data does not divide into batches (train: only
    with drop_last off; evaluation never drops); `lowres` ones when progressive resizing
    trains some epochs at a lower resolution; a `_frozen` twin of each training variant
    when some part freezes after step 0 (late_freeze), for the steps after it.
    """
    tail = train_size % batch if not drop_last else 0
    resolutions = [("", resolution)] + ([("_lowres", lowres_resolution)] if lowres_epochs > 0 else [])
    out = []
    for suffix, res in resolutions:
        out.append(Variant(f"train{suffix or '_base'}", batch, res, True))
        if tail:
            out.append(Variant(f"train{suffix}_last", tail, res, True))
    if late_freeze:
        out += [Variant(v.name + "_frozen", v.batch, v.resolution, True, frozen=True) for v in out]
    out.append(Variant("val_base", val_batch, resolution, False))
    if val_size % val_batch:
        out.append(Variant("val_last", val_size % val_batch, resolution, False))
    return out
