"""Input: the embedded synthetic data, CIFAR-10 and JPEG folders, written into the arena.

Each data set's module builds a (train, val) pair of Sources (source.py: the contract).
The modules are imported only when their data set is asked for, so the planner, which
needs only dataset_sizes, runs without DALI.
"""
import dataclasses
import importlib
import os
from pathlib import Path

import torch

from trainer.config import DataConfig, TrainConfig, TrainerConfig
from trainer.data.jpeg_files import find_split, list_split
from trainer.data.source import Shard, Source
from trainer.errors import ConfigError
from trainer.run_dir import launched

_FULL_SIZE = {"cifar10": (50000, 10000)}
_SYNTHETIC_DEFAULT = (4096, 1024)
_MODULES = {"synthetic": "trainer.data.synthetic", "cifar10": "trainer.data.cifar",
            "imagefolder": "trainer.data.jpeg_folder"}


def dataset_sizes(d: DataConfig, read_train: bool = True) -> tuple[int, int]:
    """Examples in the training and evaluation splits: train_size / val_size of them, all
    where 0 (the synthetic set, and a JPEG folder planned without data.root, have exactly
    the sizes given); more than a split holds is refused, not trained on as fewer.
    read_train=False (evaluation alone): a JPEG folder's training split is not listed, and
    its size is data.train_size as given."""
    if d.name == "synthetic":
        return d.train_size or _SYNTHETIC_DEFAULT[0], d.val_size or _SYNTHETIC_DEFAULT[1]
    if d.name == "imagefolder" and not d.root:  # mode=plan without the files: the sizes must be given
        if not (d.train_size and d.val_size):
            raise ConfigError("data=imagefolder without data.root has no image count to plan for: give data.root=PATH, "
                              "or data.train_size and data.val_size")
        return d.train_size, d.val_size
    if d.name == "imagefolder":
        full = tuple(len(list_split(find_split(Path(d.root), (split,)))[0]) if read_train or split == "val"
                     else d.train_size for split in ("train", "val"))
    else:  # CIFAR-10's sizes are known: no file is read, with or without data.root
        full = _FULL_SIZE[d.name]
    for split, asked, have in (("train", d.train_size, full[0]), ("val", d.val_size, full[1])):
        if asked > have:
            raise ConfigError(f"data.{split}_size={asked}: {d.root or d.name} has {have} {split} images; give at most "
                              f"that many, or 0 for all of them")
    return d.train_size or full[0], d.val_size or full[1]


def build_sources(cfg: TrainConfig, device: torch.device, rank: int, world: int,
                  half: torch.dtype | None, read_train: bool = True) -> tuple[Source | None, Source]:
    """(train, val) sources for this rank. half: torch.float16/bfloat16 under AMP (data
    written as that dtype, 4 channels: RGB + a zero channel), None for fp32 3-channel data.
    read_train=False (evaluation alone): the data sets read from files leave their training
    split unread, so that neither its files nor a damaged one among them stand in the way,
    and give None for it."""
    d, t = cfg.data, cfg.trainer
    if not d.threads:  # JPEG decoding is CPU-bound in part (Huffman decoding): use the cores
        local = os.environ.get("LOCAL_WORLD_SIZE", "") if launched() else ""  # torchrun's processes on this node
        d = dataclasses.replace(d, threads=max(1, (os.cpu_count() or 1) // max(1, int(local) if local.isdigit() else 1)))
    train_size, val_size = dataset_sizes(d, read_train)
    train = Shard(train_size, t.batch_size, rank, world, train=True, drop_last=t.drop_last)
    val = Shard(val_size, val_batch(t, val_size, world), rank, world, train=False)
    return source_module(d).sources(d, train, val, t.seed + d.seed_offset, device, half, read_train)


def val_batch(t: TrainerConfig, val_size: int, world: int) -> int:
    """The evaluation batch: trainer.val_batch_size (0: batch_size), at most a rank's share of
    the set, which is then one batch: a larger one never runs, and planning its inputs
    would only take arena."""
    return min(t.val_batch_size or t.batch_size, -(-val_size // world))


def source_module(d: DataConfig):
    """The module of data set d.name, imported with what it imports (DALI where it decodes)."""
    return importlib.import_module(_MODULES[d.name])
