"""Folders of JPEGs (or PNGs) per class (root/train/<class>/*.jpg, root/val/<class>/*.jpg) through DALI.

Training: random-resized crop (decoded only inside the crop) and flip; evaluation: resize
the short side to resolution * data.val_resize, rounded, and take the center, as torchvision's
Resize and CenterCrop do (`center_view`). The host feeds the files' paths in the epoch's
order, `IN_FLIGHT` batches ahead of the loop; DALI's threads read them, so neither the file
reads nor their bytes pass through Python.

Decoding: the first data.host_decode of each batch is decoded on the host's cores
(libjpeg-turbo), the rest by the GPU's JPEG engines (device="mixed"), each part by a
pipeline of its own; both parts resize and normalize on the GPU. The default, 0, decodes
everything on the JPEG engines: beside a ResNet-50 step on an H200, training fed so ran at
0.973 of its speed on data already in the arena (median of five runs, a tree of 13,000
images), against 0.89 with half of each batch on the host's 16 cores.
The GPU decoder keeps its speed beside the step only with enough CUDA hardware queues
(trainer/__init__.py); with CUDA's default 8 it fell to a tenth, and 0.75 on the host was
the best share then (docs/BENCHMARKS.md, "Input pipeline"). A GPU without JPEG engines, or
a host with cores to spare, may want a larger share.

The crop windows are DALI's random draws, from a generator per pipeline that a resumed run
starts again: it crops otherwise than the uninterrupted run would have. Under
deterministic=true (torch's deterministic mode, set before the data is built) they are
drawn on the host from the seed and the epoch instead (`resized_crop_windows`), so a resumed run
crops alike. On an H200 they cost the loader alone 31% of its images/s, and training fed by it
none of its speed (docs/BENCHMARKS.md, session V), but they are left to deterministic runs.
"""
import math
import os
from functools import partial
from pathlib import Path

import numpy as np
import torch
from nvidia.dali import fn, math as dali_math, types

from trainer.config import DataConfig
from trainer.data.dali import DaliSource
from trainer.data.jpeg_files import (check_files, class_folders, decode_error, find_split, list_split, printable,
                                     read_error, same_classes)
from trainer.data.source import Shard, resized_crop_draws, subset
from trainer.errors import DataError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
ASPECT_RATIOS = [3 / 4, 4 / 3]  # of the random-resized crop, as in the ResNet papers
CROP_ATTEMPTS = 10  # windows drawn per crop, as torchvision's RandomResizedCrop tries


def resized_crop_windows(shapes: list[np.ndarray], draws: list[np.ndarray], min_area: float):
    """A batch's random-resized crop windows, [x, y] and [width, height] in pixels, from each
    image's shape (H, W, C) and its draws (source.resized_crop_draws), as torchvision's
    RandomResizedCrop.get_params chooses them: the first of CROP_ATTEMPTS windows of uniform
    area in [min_area, 1] of the image and log-uniform aspect ratio in ASPECT_RATIOS that
    fits, at a uniform position; where none fits, the whole image cut to the nearest ratio
    in range, centered. Run by DALI (fn.python_function) on the batch at once: numpy in
    float64, where some 30 of DALI's arithmetic operators took 12 ms a batch of 256."""
    k, (lo, hi) = CROP_ATTEMPTS, ASPECT_RATIOS
    hw, u = np.stack(shapes)[:, :2].astype(np.float64), np.stack(draws).astype(np.float64)
    h, w = hw[:, :1], hw[:, 1:]
    area = h * w * (min_area + u[:, :k] * (1 - min_area))
    ratio = np.exp(math.log(lo) + u[:, k:2 * k] * (math.log(hi) - math.log(lo)))
    widths, heights = np.round(np.sqrt(area * ratio)), np.round(np.sqrt(area / ratio))  # Python's round(), half to even
    fits = (widths >= 1) & (widths <= w) & (heights >= 1) & (heights <= h)
    found, first = fits.any(1), fits.argmax(1)
    rows, h, w = np.arange(len(u)), h[:, 0], w[:, 0]
    # none fits: the whole image, cut to the nearest ratio in range
    whole_w = np.where(w / h > hi, np.round(h * hi), w)
    whole_h = np.where(w / h < lo, np.round(w / lo), h)
    width = np.where(found, widths[rows, first], whole_w)
    height = np.where(found, heights[rows, first], whole_h)
    x = np.where(found, np.floor(u[:, 2 * k] * (w - width + 1)), (w - width) // 2)
    y = np.where(found, np.floor(u[:, 2 * k + 1] * (h - height + 1)), (h - height) // 2)
    return list(np.stack([x, y], 1).astype(np.float32)), list(np.stack([width, height], 1).astype(np.float32))


def center_view(images, jpegs, resolution: int, short: int):
    """The evaluation view, torchvision's Resize(short) then CenterCrop(resolution) pixel for
    pixel: the long side int(short * long / short side), the crop's corner (side -
    resolution) / 2 rounded half to even, as Python's round(). DALI's own (resize_shorter,
    a centered crop) keeps a fractional size's scale, rounds the long side and rounds a half
    pixel up: views up to a pixel off torchvision's."""
    shape = fn.peek_image_shape(jpegs)
    h, w = shape[0], shape[1]
    sides = [dali_math.max(short, short * h // w), dali_math.max(short, short * w // h)]  # (height, width)
    images = fn.resize(images, size=fn.cast(fn.stack(*sides), dtype=types.FLOAT))
    margins = [side - resolution for side in sides]
    corner = [m // 2 + (m & (m // 2) & 1) for m in margins]  # an odd half of an odd margin rounds up
    return fn.slice(images, start=fn.cast(fn.stack(*corner), dtype=types.INT32), shape=[resolution, resolution],
                    axis_names="HW")


def read(path: str) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint8)


class JpegFolderSource(DaliSource):
    def __init__(self, files: list[str], labels: np.ndarray, classes: list[str], shard: Shard, d: DataConfig,
                 seed: int, device: torch.device, half: torch.dtype | None, augment: bool):
        super().__init__(shard, len(classes), IMAGENET_MEAN, IMAGENET_STD, d, seed, device, half, augment)
        self.files, self.labels, self.classes = files, labels, classes
        # as fn.io.file.read takes them: the bytes of the name on disk, which need not be UTF-8
        self.paths = [np.frombuffer(os.fsencode(f), np.uint8) for f in files]
        self.host_crops = augment and torch.are_deterministic_algorithms_enabled()

    @property
    def parts(self) -> int:
        # on a CPU both parts would decode on the host: one pipeline, so that data.host_decode
        # changes nothing there (two, each drawing crops from a seed of its own, cropped otherwise)
        return 2 if self.gpu and 0 < self.d.host_decode < 1 else 1

    def _host_share(self, total: int) -> int:
        """The host part's share of `total` (rows, threads) when there are two parts:
        data.host_decode of it, leaving each part at least one."""
        return min(max(round(total * self.d.host_decode), 1), total - 1)

    def part_slices(self, n: int) -> list[slice]:
        """Host-decoded rows first. Each part gets at least one row; a batch of one row is
        made by both, and the device part's copy, written last, is the one kept."""
        if self.parts == 1:
            return [slice(0, n)]
        if n == 1:
            return [slice(0, 1), slice(0, 1)]
        k = self._host_share(n)
        return [slice(0, k), slice(k, n)]

    def part_threads(self, part: int) -> int:
        if self.parts == 1 or self.d.threads == 1:
            return self.d.threads
        host = self._host_share(self.d.threads)
        return host if part == 0 else self.d.threads - host

    def decoder(self, part: int) -> str:
        on_host = not self.gpu or self.d.host_decode == 1 or (self.parts == 2 and part == 0)
        return "cpu" if on_host else "mixed"

    def graph(self, resolution: int, augment: bool, part: int):
        jpegs = fn.io.file.read(fn.external_source(name="paths", dtype=types.UINT8))
        decoder = self.decoder(part)
        # on the GPU: all of it on the JPEG engines (hw_decoder_load=1), none on the SMs the step uses
        gpu_only = {"hw_decoder_load": 1.0} if decoder == "mixed" else {}
        if augment and self.host_crops:
            anchor, size = fn.python_function(fn.peek_image_shape(jpegs), fn.external_source(name="crop", dtype=types.FLOAT),
                                              function=partial(resized_crop_windows, min_area=self.d.min_crop_area),
                                              num_outputs=2, batch_processing=True)
            images = fn.decoders.image_slice(jpegs, anchor, size, axis_names="WH", normalized_anchor=False,
                                             normalized_shape=False, device=decoder, output_type=types.RGB,
                                             **gpu_only)
        elif augment:
            images = fn.decoders.image_random_crop(jpegs, device=decoder, output_type=types.RGB,
                                                   random_area=[self.d.min_crop_area, 1.0],
                                                   random_aspect_ratio=ASPECT_RATIOS, **gpu_only)
        else:
            images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB, **gpu_only)
        if decoder == "cpu" and self.gpu:
            images = images.gpu()
        if augment:
            return fn.resize(images, size=[resolution, resolution])
        return center_view(images, jpegs, resolution, round(resolution * self.d.val_resize))

    def inputs(self, examples: np.ndarray) -> dict:
        return {"paths": [self.paths[i] for i in examples]}

    def draws(self, epoch: int) -> dict[str, np.ndarray]:
        if not self.host_crops:
            return super().draws(epoch)
        return {**super().draws(epoch),
                "crop": resized_crop_draws(self.shard.total, CROP_ATTEMPTS, self.seed, epoch)}

    def decode_error(self, examples: np.ndarray, error: RuntimeError) -> Exception:
        names, encoded = [self.files[i] for i in examples], []
        for name in names:
            try:
                encoded.append(read(name))
            except FileNotFoundError:  # DALI reads the files: one may have gone since they were listed
                return DataError(f"cannot read {printable(name)}: it is gone since the data set was listed; "
                                 f"restore it, or restart the run to list the data again")
            except OSError as e:  # one data.check_files=false left unread (its permissions, a disk's I/O error)
                return read_error(name, e)
        return decode_error(names, encoded, error)


def sources(d: DataConfig, train: Shard, val: Shard, seed: int, device: torch.device, half: torch.dtype | None,
            read_train: bool = True) -> tuple[JpegFolderSource | None, JpegFolderSource]:
    root = Path(d.root)
    val_files, val_labels, val_classes = list_split(find_split(root, ("val",)))
    val_keep = subset(len(val_files), val.total, 1)
    val_files, val_labels = [val_files[i] for i in val_keep], val_labels[val_keep]
    if read_train:
        train_files, train_labels, classes = list_split(find_split(root, ("train",)))
        train_keep = subset(len(train_files), train.total, 0)
        train_files, train_labels = [train_files[i] for i in train_keep], train_labels[train_keep]
    else:  # the training split's class names alone, where it is there, for the labels' check
        train_files = []
        classes = class_folders(root / "train") if (root / "train").is_dir() else val_classes
    named = root / ("train" if read_train or (root / "train").is_dir() else "val")
    same_classes(str(named), classes, str(root / "val"), val_classes, d.num_classes)
    if d.check_files:
        check_files(train_files + val_files, d.threads)
    return (JpegFolderSource(train_files, train_labels, classes, train, d, seed, device, half, augment=True)
            if read_train else None,
            JpegFolderSource(val_files, val_labels, classes, val, d, seed, device, half, augment=False))
