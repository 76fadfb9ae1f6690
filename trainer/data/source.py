"""The contract between an input pipeline and the training loop, and the order of examples.

A Source serves one split (train or val) to one rank. Each epoch has one global order of
the split's examples, the same on every rank; global batch k is the concatenation over
ranks of each rank's batch k (rank-major), so 2 ranks at batch B/2 see the same examples
per step as 1 rank at batch B. Augmentation draws (flips, crop offsets) are made per
example of the data set, not per position in a batch, for the same reason.
"""
from contextlib import nullcontext
from typing import Protocol

import numpy as np
import torch

from trainer.errors import DataError


class Source(Protocol):
    size: int  # examples in this rank's shard per epoch
    num_classes: int
    classes: list[str] | None  # the class folders' names, label k the k-th; None where they are fixed or made up

    def start_epoch(self, epoch: int, resolution: int) -> None:
        """Begin an epoch: train reshuffles from (seed, epoch); val keeps its order.
        `resolution` is this epoch's crop size (progressive resizing)."""

    def fill(self, data: torch.Tensor, label: torch.Tensor, mask: torch.Tensor | None, stream) -> None:
        """Write the epoch's next batch INTO data (N,H,W,C), label int32 (N,) and mask
        int8 (N,) (1 real, 0 padding). On CUDA all work is enqueued on `stream`."""

    def peek(self, n: int) -> torch.Tensor:
        """The first n images of epoch 0's order, normalized, float32 NCHW, no augmentation."""


def rng(seed: int, *keys: int) -> np.random.Generator:
    """A generator for one purpose (keys) of one run (seed); numpy seeds must be non-negative."""
    return np.random.default_rng([seed % 2**32, *keys])


# keys of the random streams, so that no two purposes share draws (one key per purpose:
# numpy's seeding ignores trailing zeros, so [seed, key] and [seed, key, 0] are one stream)
ORDER, FLIP, FIRST_FLIP, CROP, SUBSET, DALI_SEED, CUTOUT, RESIZED_CROP = range(8)


class Shard:
    """Which examples of a split this rank serves, batch by batch.

    train: `total // world` examples per rank, so every rank takes the same number of
    steps; a partial last batch only when drop_last is off. val: `ceil(total / world)`
    per rank and never drops: the global order is padded with repeats of the first
    examples, which the mask marks as padding.
    """

    def __init__(self, total: int, batch: int, rank: int, world: int, train: bool, drop_last: bool = True):
        self.total, self.rank, self.world, self.train = total, rank, world, train
        self.size = total // world if train else -(-total // world)
        full, tail = divmod(self.size, batch)
        self.batches = [batch] * full + ([tail] if tail and not (train and drop_last) else [])

    def order(self, seed: int, epoch: int) -> np.ndarray:
        """The global order of epoch `epoch`: slots; a slot >= total is padding."""
        if self.train:
            return rng(seed, ORDER, epoch).permutation(self.total)
        return np.arange(self.world * self.size)

    def epoch(self, seed: int, epoch: int) -> "EpochPlan":
        order = self.order(seed, epoch)
        mine, start = [], 0
        for b in self.batches:
            mine.append(order[start + self.rank * b:start + (self.rank + 1) * b])
            start += self.world * b
        slots = np.concatenate(mine)
        return EpochPlan(slots % self.total, slots < self.total, self.batches)


class EpochPlan:
    """This rank's examples of one epoch in serving order, and a cursor over its batches."""

    def __init__(self, examples: np.ndarray, real: np.ndarray, batches: list[int]):
        self.examples, self.real, self.batches = examples, real, batches
        self.starts = np.concatenate([[0], np.cumsum(batches)]).astype(int)
        self.next_batch = 0

    def __len__(self) -> int:
        return len(self.batches)

    def span(self, k: int) -> slice:
        return slice(self.starts[k], self.starts[k + 1])

    def take(self, n: int) -> slice:
        """The span of the next batch, which must have n examples: a mismatch means the
        loop and the source disagree on the variant, which would silently shift every batch."""
        k = self.next_batch
        if k == len(self.batches):
            raise RuntimeError(f"fill() past the end of the epoch ({k} batches); call start_epoch() first")
        if n != self.batches[k]:
            raise RuntimeError(f"batch {k} of this epoch has {self.batches[k]} examples, fill() got {n}")
        self.next_batch += 1
        return self.span(k)


def subset(have: int, want: int, split: int) -> np.ndarray:
    """Which `want` of `have` examples a capped split (data.train_size / val_size) uses:
    the same in every run, and random, so every class keeps its share of a sorted list."""
    if want >= have:
        return np.arange(have)
    return np.sort(rng(0, SUBSET, split).permutation(have)[:want])


def flips(mode: str, n: int, seed: int, epoch: int) -> np.ndarray:
    """Which of the n examples are mirrored this epoch. alternating (airbench): epoch 0 flips
    a random half, each later epoch flips exactly the images not flipped the epoch before,
    so every image is seen both ways every two epochs."""
    if mode == "none":
        return np.zeros(n, bool)
    if mode == "alternating":
        return (rng(seed, FIRST_FLIP).random(n) < 0.5) ^ bool(epoch % 2)
    return rng(seed, FLIP, epoch).random(n) < 0.5


def crop_offsets(n: int, padding: int, seed: int, epoch: int) -> np.ndarray:
    """(n, 2) top-left corners (y, x) of random crops within the image padded by `padding`:
    an offset of `padding` is the uncropped image."""
    return rng(seed, CROP, epoch).integers(0, 2 * padding + 1, (n, 2))


def check_crop_padding(padding: int, height: int, width: int, pad: str) -> None:
    """A training crop's padding must be smaller than the image: a crop may then reach at most
    a side less one past the image, which reflecting it once covers; wider, a crop reads
    outside the image (reflection) or is all `pad` but for a corner (a constant color)."""
    if padding >= min(height, width):
        raise DataError(f"data.crop_padding={padding} is not smaller than the images ({height}x{width}), which "
                        f"training crops pad {pad}; set data.crop_padding to at most {min(height, width) - 1}")


def resized_crop_draws(n: int, attempts: int, seed: int, epoch: int) -> np.ndarray:
    """(n, 2 * attempts + 2) uniform draws in [0, 1) for each example's random-resized crop
    this epoch: `attempts` of its area, as many of its aspect ratio, then its position
    across and down (trainer/data/jpeg_folder.py turns them into a window)."""
    return rng(seed, RESIZED_CROP, epoch).random((n, 2 * attempts + 2), dtype=np.float32)


def cutout_corners(n: int, size: int, h: int, w: int, seed: int, epoch: int) -> np.ndarray:
    """(n, 2) top-left corners (y, x) of the cutout squares of side `size`: each centered
    uniformly over the h x w image, so a square near an edge is clipped by it (cutout as
    DeVries and Taylor define it)."""
    return rng(seed, CUTOUT, epoch).integers(0, (h, w), (n, 2)) - size // 2


def on(stream, data: torch.Tensor):
    """The context that enqueues torch work on `stream` when the batch lives on a GPU."""
    return torch.cuda.stream(stream) if data.is_cuda and stream is not None else nullcontext()
