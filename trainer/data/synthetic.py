"""The embedded data set: oriented, colored gratings under noise, generated in memory.

Ten classes: two orientations (horizontal, vertical stripes) x five colors of the stripes
(gratings.py). Jitter and pixel noise make a small net need a few epochs, not one step,
to tell them apart; both orientations are their own mirror images, so flips keep every
label true. The data set is the same in every run (its own fixed seed); the run's seed
only orders and augments it.
"""
import numpy as np
import torch
from nvidia.dali import fn, types

from trainer.arena import host_memory_available
from trainer.config import DataConfig
from trainer.data.dali import DaliSource
from trainer.data.gratings import ORIENTATIONS, gratings, hues
from trainer.data.source import Shard, check_crop_padding, crop_offsets
from trainer.errors import DataError

NUM_CLASSES = 10
DATASET_SEED = 20240611


def generate(n: int, split: int, size: int, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """n balanced examples of one split (0 train, 1 val: independent draws), made on
    `threads` threads (the same examples whatever their number)."""
    labels = (np.arange(n) % NUM_CLASSES).astype(np.int32)
    rng = np.random.default_rng([DATASET_SEED, split])
    return gratings(ORIENTATIONS[labels % 2], hues(NUM_CLASSES // 2)[labels // 2], rng, size, size,
                    threads=threads), labels


class SyntheticSource(DaliSource):
    """Images from memory through DALI: random crop with padding (the pad is the mean
    color, zero after normalization) and flip for training."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, shard: Shard, mean, std, d: DataConfig,
                 seed: int, device: torch.device, half: torch.dtype | None, augment: bool):
        super().__init__(shard, NUM_CLASSES, mean, std, d, seed, device, half, augment)
        self.images, self.labels = images, labels

    def graph(self, resolution: int, augment: bool, part: int):
        size = self.images.shape[1]
        images = fn.external_source(name="images", dtype=types.UINT8, layout="HWC")
        if self.gpu:
            images = images.gpu()
        if augment:
            corner = fn.external_source(name="corner", dtype=types.INT32)
            images = fn.slice(images, start=corner, shape=[size, size], axis_names="HW",
                              out_of_bounds_policy="pad", fill_values=self.mean)
        if resolution != size:
            images = fn.resize(images, size=[resolution, resolution])
        return images

    def inputs(self, examples: np.ndarray) -> dict:
        return {"images": self.images[examples]}

    def draws(self, epoch: int) -> dict[str, np.ndarray]:
        # the crop's corner in the unpadded image: -padding .. +padding
        corners = crop_offsets(self.shard.total, self.d.crop_padding, self.seed, epoch) - self.d.crop_padding
        return {**super().draws(epoch), "corner": corners.astype(np.int32)}


def check_training_crops(d: DataConfig) -> None:
    """data.crop_padding against the images, data.resolution square, before they are made."""
    check_crop_padding(d.crop_padding, d.resolution, d.resolution, "with the mean color")


def channel_stats(images: np.ndarray) -> tuple[list[float], list[float]]:
    """Each channel's mean and standard deviation on a 0..1 scale, exactly, from a histogram
    of its uint8 values (no float copy of the data set)."""
    values = np.arange(256) / 255
    counts = [np.bincount(images[..., c].ravel(), minlength=256) for c in range(images.shape[-1])]
    mean = [float(h @ values / h.sum()) for h in counts]
    return mean, [float(np.sqrt(h @ (values - m) ** 2 / h.sum())) for h, m in zip(counts, mean)]


def sources(d: DataConfig, train: Shard, val: Shard, seed: int, device: torch.device, half: torch.dtype | None,
            read_train: bool = True) -> tuple[SyntheticSource, SyntheticSource]:
    """Both splits, read_train or not: they are generated, not read, and the training split's
    statistics normalize the evaluation split too."""
    if d.num_classes != NUM_CLASSES:
        raise DataError(f"the synthetic data set has {NUM_CLASSES} classes but data.num_classes="
                        f"{d.num_classes}; set data.num_classes={NUM_CLASSES}")
    check_training_crops(d)
    size, available = (train.total + val.total) * d.resolution ** 2 * 3, host_memory_available()
    if available is not None and size > available:  # numpy would refuse with a traceback, or the kernel kill the run
        raise DataError(f"the synthetic data set of {train.total + val.total:,} images at data.resolution="
                        f"{d.resolution} takes {size / 2**30:,.1f} GiB of host memory, and {available / 2**30:,.1f} GiB "
                        f"is free: lower data.resolution, data.train_size or data.val_size")
    train_images, train_labels = generate(train.total, 0, d.resolution, d.threads)
    val_images, val_labels = generate(val.total, 1, d.resolution, d.threads)
    mean, std = channel_stats(train_images)
    return (SyntheticSource(train_images, train_labels, train, mean, std, d, seed, device, half, augment=True),
            SyntheticSource(val_images, val_labels, val, mean, std, d, seed, device, half, augment=False))
