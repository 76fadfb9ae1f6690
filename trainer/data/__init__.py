"""Input: the embedded synthetic data, CIFAR-10 and JPEG folders, written into the arena."""
from pathlib import Path

from trainer.config import DataConfig
from trainer.errors import DataError

_FULL_SIZE = {"synthetic": (4096, 1024), "cifar10": (50000, 10000)}
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".JPG", ".JPEG")


def _count_images(folder: Path) -> int:
    if not folder.is_dir():
        raise DataError(f"missing directory {folder}: data.root must hold train/ and val/ class folders")
    return sum(1 for f in folder.rglob("*") if f.suffix in IMAGE_SUFFIXES)


def dataset_sizes(d: DataConfig) -> tuple[int, int]:
    """Examples in the training and evaluation splits (train_size / val_size cap them)."""
    if d.name == "imagefolder":
        full = (_count_images(Path(d.root) / "train"), _count_images(Path(d.root) / "val"))
    else:
        full = _FULL_SIZE[d.name]
    return (min(full[0], d.train_size) if d.train_size else full[0],
            min(full[1], d.val_size) if d.val_size else full[1])
