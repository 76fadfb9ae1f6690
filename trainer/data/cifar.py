"""CIFAR-10, decoded once and kept on the device.

data.root may be the JPEG tree (train/<class>/*.jpg, test/<class>/*.jpg), a .tgz/.tar
archive of it (read in memory: no extraction), or the usual python batches
(cifar-10-batches-py/, as a folder or inside its archive). A data.train_size /
data.val_size below the full split takes the same random subset in every run. What an
archive decodes to is kept in data.decode_cache, named by the archive's content
(decoded_cache.py).
"""
import io
import pickle
import posixpath
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from trainer.config import DataConfig
from trainer.data import decoded_cache
from trainer.data.dali import decode_all
from trainer.data.jpeg_files import (IMAGE_SUFFIXES, OTHER_IMAGE_SUFFIXES, broken_links, check_bytes, class_folders,
                                     empty_class_folder, find_split, hidden, list_split, looking_into_folders,
                                     one_folder, other_kinds, printable, read_error, same_classes)
from trainer.data.resident import PAD, ResidentSource
from trainer.data.source import Shard, check_crop_padding, subset
from trainer.data.tar import Damaged, Members, tar_files
from trainer.errors import DataError

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
SPLIT_DIRS = {"train": ("train",), "val": ("test", "val")}
BATCH_FILES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "val": ["test_batch"]}
BATCH_CLASSES = 10  # the python batches' labels: CIFAR-10's
# their names, label k the k-th: in the JPEG tree's folders, sorted, the same order
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def read_archive(path: Path, raw: bytes) -> dict[str, bytes]:
    """The JPEGs and python batches in an archive (its bytes `raw`), by member path."""
    try:
        archive = tar_files(raw)
    except Damaged as e:  # an archive all the same: not the wrong file, but a bad copy of it
        raise DataError(f"the archive {path} is damaged or truncated ({e}): download or copy it again") from None
    except ValueError as e:
        raise DataError(f"cannot read the archive {path}: {e}; data.root must be a .tgz/.tar of the "
                        f"CIFAR-10 JPEG tree or of cifar-10-batches-py, or a folder of either") from None
    _refuse_left_out(path, archive)
    return {name: data for name, data in archive.files.items()
            if name.lower().endswith(IMAGE_SUFFIXES) or "_batch" in name}


def _refuse_left_out(path: Path, archive: Members):
    """What the tree's folder reader names, named in its archive: a link to nothing at a class
    folder's place (.../<split>/<class>) or an image's, an image of another kind, a class folder
    without an image (each left out without a word: the run trained on fewer classes or images
    than the archive shows), two class folders that are one through a link (its images under
    two labels)."""
    splits = {folder for folders in SPLIT_DIRS.values() for folder in folders}
    again = ", then make the archive again"

    def place(member: str) -> tuple[str, str, str]:
        """The last three parts of a member's path: (split, class, file) for an image in a class folder."""
        *_, split, folder, name = ["", "", *member.split("/")]
        return split, folder, name

    links = {"a class folder": [], "a file": []}
    for link in sorted(archive.dangling):
        split, folder, name = place(link)
        if hidden(folder) or hidden(name):
            continue
        if folder in splits:
            links["a class folder"].append(printable(f"{path}:{link}"))
        elif split in splits and name.lower().endswith(IMAGE_SUFFIXES):
            links["a file"].append(printable(f"{path}:{link}"))
    for what, broken in links.items():
        if broken:
            raise broken_links(broken, what, "the archive", again)
    in_member_folder: dict[str, list[str]] = {}
    for member in archive.files:
        parent, _, name = member.rpartition("/")
        in_member_folder.setdefault(parent, []).append(name)
    held: dict[str, list[str]] = {}  # a folder's path, as unpacked ("./" and "//" gone) -> the names in it
    for parent, names in in_member_folder.items():
        held.setdefault(posixpath.normpath(parent), []).extend(names)
    for folder in archive.folders:
        parent, _, name = folder.rpartition("/")
        held.setdefault(folder, [])
        held.setdefault(parent, []).append(name + "/")
    classes = sorted(f for f in held if place(f)[1] in splits and not hidden(place(f)[2]))
    seen: dict[tuple[str, str], str] = {}  # (a split's folder, a class folder as it is, through links) -> its path
    for folder in classes:
        first = seen.setdefault((folder.rpartition("/")[0], archive.linked.get(folder, folder)), folder)
        if first != folder:
            raise one_folder(printable(f"{path}:{first}"), printable(f"{path}:{folder}"), again)
    other = [printable(f"{path}:{folder}/{name}") for folder in classes for name in sorted(held[folder])
             if name.lower().endswith(OTHER_IMAGE_SUFFIXES) and not hidden(name)]
    if other:
        raise other_kinds(other, "the archive", again)
    for folder in classes:
        if not any(name.lower().endswith(IMAGE_SUFFIXES) and not hidden(name) for name in held[folder]):
            raise empty_class_folder(printable(f"{path}:{folder}"), held[folder], again)


def python_batches(root: Path, members: dict[str, bytes] | None) -> dict[str, bytes] | None:
    """The python batch files by name, if that is what data.root holds."""
    if members is not None:
        found = {PurePosixPath(name).name: data for name, data in members.items() if "_batch" in name}
    else:
        with looking_into_folders():
            folder = next((f for f in (root, root / "cifar-10-batches-py") if (f / "data_batch_1").is_file()), None)
            found = {p.name: p.read_bytes() for p in folder.glob("*_batch*")} if folder else {}
    return found if "data_batch_1" in found else None


def _keep(have: int, want: int, asked: int, split: str, root: Path) -> np.ndarray:
    """`want` of the `have` images: data.<split>_size (`asked`, at most CIFAR-10's split:
    dataset_sizes refuses more), or the whole split where 0 was asked for; the sizes are
    fixed before the files are read, so a data set that holds fewer is refused here; so is
    one that holds more where 0 was asked for, whose extra images were left out without a word."""
    if want > have:
        wanted = (f"the data.{split}_size={asked} asked for" if asked
                  else f"CIFAR-10's full {want} that data.{split}_size=0 stands for")
        raise DataError(f"{root} holds {have} {split} images, fewer than {wanted}; set data.{split}_size={have} or less")
    if have > want and not asked:
        raise DataError(f"{root} holds {have} {split} images, {have - want} more than CIFAR-10's full {want} that "
                        f"data.{split}_size=0 stands for: remove the extra images, give data.{split}_size={want} or "
                        f"fewer to take a subset, or use data=imagefolder for a data set of another size")
    return subset(have, want, list(SPLIT_DIRS).index(split))


def from_batches(batches: dict[str, bytes], split: str, n: int, asked: int,
                 root: Path) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    for name in BATCH_FILES[split]:
        if name not in batches:
            raise DataError(f"missing {name} in {root}: CIFAR-10's python batches are data_batch_1 .. "
                            f"data_batch_5 and test_batch")
        rows, batch_labels = _batch(batches[name], f"{name} in {root}")
        images.append(rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        labels.append(batch_labels)
    keep = _keep(sum(map(len, labels)), n, asked, split, root)
    return np.concatenate(images)[keep], np.concatenate(labels)[keep]


class _BatchUnpickler(pickle.Unpickler):
    """A python batch is a pickled dict of bytes, lists and a numpy array: only what that
    array's reconstruction names is let in, so a file that is something else cannot run
    code as it loads."""
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it names {module}.{name}")
        return super().find_class(module, name)


def _batch(data: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A batch's rows of 3x32x32 pixels and their labels, checked: a damaged or other file
    ended in a traceback, and rows of larger images were cut into several 32x32 ones, each
    with the label of another."""
    try:
        batch = _BatchUnpickler(io.BytesIO(data), encoding="bytes").load()
        rows, labels = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"])
    except Exception as e:  # noqa: BLE001 - whatever a damaged pickle raises, one message
        why = f"{type(e).__name__}: {e}"
    else:
        if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] != 3 * 32 * 32:
            why = f"its data is {rows.dtype} of shape {rows.shape}, not rows of 3x32x32 bytes"
        elif labels.shape != (len(rows),) or not np.issubdtype(labels.dtype, np.integer):
            why = f"it has {labels.size} labels for {len(rows)} images"
        elif len(labels) and not 0 <= labels.min() <= labels.max() < BATCH_CLASSES:
            why = f"its labels run from {labels.min()} to {labels.max()}, not 0 to {BATCH_CLASSES - 1}"
        else:
            return rows, labels.astype(np.int32)
    raise DataError(f"{where} is not a CIFAR-10 python batch ({why}): get cifar-10-batches-py again, or give the "
                    "JPEG tree")


def jpeg_list(root: Path, split: str, members: dict[str, bytes] | None):
    """(names, labels, classes) of a split's JPEGs, in the tree or among the archive's members
    (.../<split>/<class>/<file>); class k is the k-th class name in sorted order."""
    if members is None:
        return list_split(find_split(root, SPLIT_DIRS[split]))
    images = _archived_images(members)
    # the first of the split's folders the archive holds, as find_split takes in a tree (test/, not val/ too)
    held = {n.split("/")[-3] for n in images}
    folder = next((f for f in SPLIT_DIRS[split] if f in held), None)
    names = sorted(_in_split(root, images, folder))
    if not names:
        raise DataError(f"no {SPLIT_DIRS[split][0]}/<class>/*.jpg in the archive {root}: data.root must be "
                        f"a .tgz of the CIFAR-10 JPEG tree or of cifar-10-batches-py")
    folders = [n.split("/")[-2] for n in names]
    classes = sorted(set(folders))
    labels = np.searchsorted(classes, folders).astype(np.int32)
    return names, labels, classes


def _archived_images(members: dict[str, bytes]) -> list[str]:
    """The archive's images in class folders (.../<split>/<class>/<file>), but those whose
    class folder or file is hidden, as in a tree. Member names are "/"-separated: str.split,
    as PurePosixPath costs a second per 60,000 names."""
    return [n for n in members if n.lower().endswith(IMAGE_SUFFIXES) and n.count("/") >= 2
            and not any(map(hidden, n.split("/")[-2:]))]


def _in_split(root: Path, images: list[str], folder: str | None) -> list[str]:
    """The images in the split's `folder` (.../<folder>/<class>/<file>), refused where the archive
    holds that folder in more than one place (the tree stored twice, under two names): each
    image was read once from each."""
    names = [n for n in images if n.split("/")[-3] == folder]
    trees = sorted({n.rsplit("/", 2)[0] for n in names})
    if trees[1:]:
        raise DataError(f"the archive {root} holds {folder}/ in {len(trees)} places ({', '.join(trees[:4])}): its "
                        "images would be read once from each; make the archive again of one tree")
    return names


def train_classes(root: Path, members: dict[str, bytes] | None) -> list[str] | None:
    """The class names of the training split, from its folders' names alone (None where it has none)."""
    if members is None:
        return class_folders(root / "train") if (root / "train").is_dir() else None
    return sorted({n.split("/")[-2] for n in _in_split(root, _archived_images(members), "train")}) or None


def jpeg_splits(root: Path, members: dict[str, bytes] | None, d: DataConfig,
                splits=tuple(SPLIT_DIRS)) -> tuple[dict[str, tuple[list[str], np.ndarray]], list[str]]:
    """(names, labels) of each of `splits`' JPEGs, once the evaluation split is found to have
    the training split's data.num_classes class folders (evaluation alone lists the training
    split's folder names only, where it has them), and those class folders' names."""
    listed = {s: jpeg_list(root, s, members) for s in splits}
    val_names, _, val_classes = listed["val"]
    val_dir = val_names[0].split("/")[-3]  # test/ or val/, whichever the data set has
    classes = listed["train"][2] if "train" in listed else train_classes(root, members)
    named = f"{root}'s {'train' if classes else val_dir}"
    same_classes(named, classes or val_classes, f"{root}'s {val_dir}", val_classes, d.num_classes)
    return {s: (names, labels) for s, (names, labels, _) in listed.items()}, classes or val_classes


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise read_error(path, e) from None


def read_jpegs(root: Path, split: str, names: list[str], labels: np.ndarray, n: int, asked: int,
               members: dict[str, bytes] | None) -> tuple[list[str], list[np.ndarray], np.ndarray]:
    """The kept JPEGs of a split: their names as messages show them, their bytes, their labels."""
    keep = _keep(len(names), n, asked, split, root)
    names = [names[i] for i in keep]
    encoded = [np.frombuffer(members[f] if members else _read(f), np.uint8) for f in names]
    return [f"{root}:{f}" for f in names] if members else names, encoded, labels[keep]


def decode(root: Path, raw: bytes | None, d: DataConfig, sizes: dict[str, int]) -> dict[str, np.ndarray]:
    """Each split's images (N, 32, 32, 3) uint8 and labels in host memory, and the classes'
    names (label k the k-th)."""
    members = read_archive(root, raw) if raw is not None else None
    batches = python_batches(root, members)
    if batches is not None and d.num_classes != BATCH_CLASSES:
        raise DataError(f"{root} holds CIFAR-10's python batches, {BATCH_CLASSES} classes, but "
                        f"data.num_classes={d.num_classes}; set data.num_classes={BATCH_CLASSES}")
    asked = {"train": d.train_size, "val": d.val_size}
    out = {"classes": np.array(CIFAR10_CLASSES)}
    if batches is not None:
        for split, n in sizes.items():
            out[f"{split}_images"], out[f"{split}_labels"] = from_batches(batches, split, n, asked[split], root)
        return out
    listed, classes = jpeg_splits(root, members, d, tuple(sizes))
    out["classes"] = np.array(classes)
    read = {split: read_jpegs(root, split, *listed[split], n, asked[split], members) for split, n in sizes.items()}
    # every damaged file of both splits in one message, as data=imagefolder names them
    check_bytes([name for names, _, _ in read.values() for name in names],
                [data for _, encoded, _ in read.values() for data in encoded])
    for split, (names, encoded, labels) in read.items():
        # the source and the decode cache keep CIFAR-10's size
        images = decode_all(names, encoded, d.threads, (32, 32),
                            "data=cifar10 reads CIFAR-10's 32x32 images: use data=imagefolder for images of other sizes")
        out[f"{split}_images"], out[f"{split}_labels"] = images.numpy(), labels
    return out


def check_training_crops(d: DataConfig) -> None:
    """data.crop_padding against CIFAR-10's 32x32 images before they are read, as the training
    source checks it: a sweep's jobs are checked before the first runs."""
    check_crop_padding(d.crop_padding, 32, 32, PAD)


def sources(d: DataConfig, train: Shard, val: Shard, seed: int, device: torch.device, half: torch.dtype | None,
            read_train: bool = True) -> tuple[ResidentSource | None, ResidentSource]:
    root = Path(d.root)
    if not root.exists():
        raise DataError(f"missing data.root {root}: point it at the CIFAR-10 JPEG tree, its .tgz, "
                        f"or cifar-10-batches-py")
    try:
        raw = root.read_bytes() if root.is_file() else None
    except OSError as e:
        raise DataError(f"cannot read the archive {root} ({e.strerror}): check its permissions") from None
    # an entry is named by both splits' sizes, as training decodes them; evaluation alone takes the
    # val split from it, or decodes that split alone and keeps nothing
    sizes = {"train": train.total, "val": val.total}
    cache = decoded_cache.entry(d.decode_cache, raw, sizes, d.num_classes) if raw and d.decode_cache else None
    shards = {"train": train, "val": val} if read_train else {"val": val}
    shapes = {f"{s}_{kind}": (shard.total, 32, 32, 3) if kind == "images" else (shard.total,)
              for s, shard in shards.items() for kind in ("images", "labels")} | {"classes": (d.num_classes,)}
    splits = decoded_cache.load(cache, shapes) if cache else None
    if splits is None:
        splits = decode(root, raw, d, {s: shard.total for s, shard in shards.items()})
        if cache and read_train:
            decoded_cache.save(cache, splits)
    made = {s: ResidentSource(torch.from_numpy(splits[f"{s}_images"]).to(device),
                              torch.from_numpy(splits[f"{s}_labels"]).to(device), shard, d.num_classes,
                              CIFAR_MEAN, CIFAR_STD, d, seed, augment=s == "train", half=half)
            for s, shard in shards.items()}
    for source in made.values():  # a JPEG tree's folders, which may be renamed between runs
        source.classes = [str(name) for name in splits["classes"]]
    return made.get("train"), made["val"]
