"""JPEG (and PNG) files in class folders: listing them with their labels, and cheap checks that turn a
bad file into a message naming it before training starts."""
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from trainer.errors import DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")  # compared lower-case; DALI's image decoders read PNG too
# images of other kinds (torchvision's ImageFolder reads these): refused where found, not left out
OTHER_IMAGE_SUFFIXES = (".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".heic", ".avif", ".jp2", ".jxl")
_TAIL = 64  # bytes searched for the end marker: some writers pad after it (a file without is decoded)
# DALI's decoder reads PNG too, and data sets hold PNGs under a .jpg name (ImageNet's
# n02105855_2933.JPEG): the check takes a PNG whole from its signature to its IEND chunk.
_PNG_START, _PNG_END = b"\x89PNG\r\n\x1a\n", b"IEND\xaeB\x60\x82"


def printable(path) -> str:
    """A path for a message: bytes of a name that are not UTF-8 (held as surrogates, as
    os.fsdecode gives them) written as \\xNN, since a log stream refuses the surrogates."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


@contextmanager
def looking_into_folders():
    """An OSError met while the data's folders are looked into or listed (a folder without
    read or search permission, a disk's I/O error) as one message naming the path, where it
    ended in a traceback. Where search permission is missing, the path named is one inside
    the folder at fault: the advice takes in the folders that hold it."""
    try:
        yield
    except OSError as e:
        raise read_error(e.filename, e, "its permissions and those of the folders that hold it") from None


def hidden(name: str) -> bool:
    """Whether a folder's or file's name is left out of the data: hidden ones are no classes
    or images (Jupyter's .ipynb_checkpoints/; macOS's copies keep a file's attributes beside
    it as ._NAME.jpg, which is no image)."""
    return name.startswith(".")


def find_split(root: Path, names: tuple[str, ...]) -> Path:
    """The first of root/<name> that exists (CIFAR's tree calls its val split "test")."""
    with looking_into_folders():
        if not root.exists():
            raise DataError(f"missing data.root {root}: point data.root at the folder that holds "
                            f"{names[0]}/<class>/*.jpg")
        if root.is_file():
            raise DataError(f"data.root={root} is a file, where the folders are read: point it at the folder that "
                            f"holds {names[0]}/<class>/*.jpg (unpack an archive first; data=cifar10 reads CIFAR-10's)")
        for name in names:
            if (root / name).is_dir():
                return root / name
    raise DataError(f"missing directory {root / names[0]}: data.root={root} must hold {names[0]}/<class>/*.jpg")


def class_folders(folder: Path) -> list[str]:
    """The class names: the sorted names of `folder`'s folders but hidden ones."""
    with looking_into_folders():
        entries = [e for e in os.scandir(folder) if not hidden(e.name)]
        broken = sorted(e.name for e in entries if e.is_symlink() and not e.is_dir() and not e.is_file())
        if broken:
            raise broken_links([printable(folder / name) for name in broken], "a class folder", printable(folder))
        return sorted(e.name for e in entries if e.is_dir())


def broken_links(paths: list[str], what: str, where: str, then: str = "") -> DataError:
    """Links to `what` (a class folder, a file) that is not there, the first named with how
    many more `where` holds: left out without a word, the run trained on fewer classes or
    images than the data shows."""
    more = f" (and {len(paths) - 1} more in {where})" if paths[1:] else ""
    return DataError(f"{paths[0]} is a link to {what} that is not there{more}: restore its target, or remove the "
                     f"link{then}")


def one_folder(path: str, other: str, then: str = "") -> DataError:
    """Two class folders that are one through a link: its images under two labels, each the
    other's wrong answer."""
    return DataError(f"class folders {path} and {other} are one folder, reached through a link: each class needs its "
                     f"own images; remove the link{then}")


def other_kinds(paths: list[str], where: str, then: str = "") -> DataError:
    """Images of other kinds (.webp, .bmp ...), the first named with how many more `where`
    holds: left out without a word, the run trained on fewer images than the data shows
    (torchvision's ImageFolder reads them)."""
    more = f" (and {len(paths) - 1} more in {where})" if paths[1:] else ""
    return DataError(f"{paths[0]}{more}: only .jpg/.jpeg/.png images are read; convert it to JPEG or PNG, or move it "
                     f"out of the data set{then}")


def empty_class_folder(path: str, held: list[str], then: str = "") -> DataError:
    """A class folder without an image, named with what it `held` instead (a folder's name
    ending in "/"): images in subfolders are not read, as they are no class's."""
    held = sorted(held)
    found = f" but {', '.join(held[:4])}{' ...' if len(held) > 4 else ''}" if held else ""
    subfolders = " (images in its subfolders are not read)" if any(h.endswith("/") for h in held) else ""
    return DataError(f"empty class folder {path}: it holds no .jpg/.jpeg/.png file{found}{subfolders}; add its images, "
                     f"or remove the class's folder from every split (they need the same ones){then}")


_listed: dict[Path, tuple[tuple, list[str], np.ndarray]] = {}  # folder -> (its folders' times, files, labels)
_listing = threading.Lock()  # the planner and the data's thread list a split at once: one waits for the other


def forget_listings():
    """A new run lists its splits again, whatever their folders' times say (a copy that
    keeps them, rsync -a, may have changed a folder since the last run of this process)."""
    _listed.clear()


def list_split(folder: Path) -> tuple[list[str], np.ndarray, list[str]]:
    """(files, labels int32, class names): classes are the sorted folder names, so label k
    is the k-th folder in alphabetical order (CIFAR-10's usual order).

    The planner counts a split's files and its source reads them: the listing is kept and
    given again, within a run, while the split's folders keep their modification times
    (adding, removing or renaming a file changes its folder's), since listing ImageNet's
    1.28M files takes seconds, more on a network file system."""
    with looking_into_folders():
        if not folder.is_dir():
            raise DataError(f"missing directory {folder}: expected class folders {folder}/<class>/*.jpg")
        classes = class_folders(folder)
        if not classes:
            raise DataError(f"no class folders in {folder}: expected {folder}/<class>/*.jpg")
        stats = {name: os.stat(folder / name) for name in [".", *classes]}
        seen: dict[tuple[int, int], str] = {}
        for name in classes:  # links to one folder: its images under two labels, each the other's wrong answer
            other = seen.setdefault((stats[name].st_dev, stats[name].st_ino), name)
            if other != name:
                raise one_folder(printable(folder / other), printable(folder / name))
        stamp = tuple((name, st.st_mtime_ns) for name, st in stats.items())
        with _listing:
            if folder not in _listed or _listed[folder][0] != stamp:
                _listed[folder] = (stamp, *_list_files(folder, classes))
            _, files, labels = _listed[folder]
    return list(files), labels.copy(), classes


def _list_files(folder: Path, classes: list[str]) -> tuple[list[str], np.ndarray]:
    files, labels = [], []
    for k, name in enumerate(classes):
        entries = [e for e in os.scandir(folder / name) if not hidden(e.name)]
        other = sorted(e.name for e in entries if e.name.lower().endswith(OTHER_IMAGE_SUFFIXES))
        if other:
            raise other_kinds([printable(folder / name / o) for o in other], "its folder")
        images = [e for e in entries if e.name.lower().endswith(IMAGE_SUFFIXES)]
        broken = sorted(e.name for e in images if e.is_symlink() and not e.is_file())
        if broken:
            raise broken_links([printable(folder / name / b) for b in broken], "a file", "its folder")
        jpegs = sorted(e.name for e in images if e.is_file())
        if not jpegs:
            raise empty_class_folder(printable(folder / name),
                                     [e.name + "/" if e.is_dir() else e.name for e in os.scandir(folder / name)])
        files += [str(folder / name / f) for f in jpegs]
        labels += [k] * len(jpegs)
    return files, np.array(labels, np.int32)


def same_classes(train: str, classes: list[str], val: str, val_classes: list[str], num_classes: int):
    """A label is its class folder's place in sorted order: the evaluation split needs the
    training split's folders (test/car for train/automobile would give it and those after
    it another class's label), and data.num_classes of them."""
    if len(classes) < 2:  # data.num_classes=1 is refused: one class leaves nothing to classify
        raise DataError(f"{train} has one class folder ({classes[0]}): a classifier needs 2 classes at least; add the "
                        "folders of the others")
    if len(classes) != num_classes:  # num_classes may be a checkpoint's: its model's
        raise DataError(f"{train} has {len(classes)} class folders ({', '.join(classes[:12])}) but data.num_classes="
                        f"{num_classes}: set data.num_classes={len(classes)}, or, to resume or evaluate a model of "
                        f"{num_classes} classes, give data.root a data set of {num_classes}")
    if val_classes != classes:
        differ = sorted(set(classes) ^ set(val_classes))
        raise DataError(f"{val} and {train} differ in their class folders ({', '.join(differ[:8])}): both need the "
                        f"same ones, or the labels would not match")


def jpeg_problem(head: bytes, tail: bytes, whole) -> str | None:
    """What is wrong with a JPEG or PNG file that starts with `head` (its first 8 bytes) and
    ends with `tail`, if anything a look at its ends can tell (a truncated file has lost its
    end marker). A tail without it is looked at again in `whole()`, the file's bytes, as
    phone cameras append trailers of kilobytes: a PNG's IEND chunk is searched for, a JPEG
    decoded, as its EXIF thumbnail ends with an end marker of its own."""
    if not head:
        return "empty file (0 bytes)"
    if head.startswith(_PNG_START):
        if _PNG_END in tail or _PNG_END in whole():
            return None
        return "no PNG end chunk (IEND): the file is truncated"
    if head[:2] != b"\xff\xd8":
        return "no JPEG start marker (FF D8) or PNG signature: not a JPEG or PNG file"
    if b"\xff\xd9" not in tail and not _decodes(whole()):
        return "no JPEG end marker (FF D9): the file is truncated"
    return None


def _decodes(data: bytes) -> bool:
    """Whether PIL decodes the whole image: it raises on a truncated one."""
    from PIL import Image
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
        return True
    except Exception:  # PIL raises many kinds for a damaged image
        return False


def read_error(path: str, error: OSError, check: str = "the file and its permissions, or delete it") -> DataError:
    """A file or folder that cannot be read (its permissions, a disk's I/O error), named with
    the OS's reason, and what to `check`."""
    return DataError(f"cannot read {printable(path)} ({error.strerror or error}): check {check}")


def _file_problem(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            head = f.read(len(_PNG_START))
            f.seek(max(os.fstat(f.fileno()).st_size - _TAIL, 0))
            return jpeg_problem(head, f.read(), Path(path).read_bytes)
    except OSError as e:
        raise read_error(path, e) from None


def corrupt(problems: list[tuple[str, str]]) -> DataError:
    """One message for every damaged file found, so that one run finds them all (the first
    ten named)."""
    problems = [(printable(name), why) for name, why in problems]
    if len(problems) == 1:
        return DataError(f"corrupt JPEG {problems[0][0]}: {problems[0][1]}; replace the file or delete it")
    shown = "; ".join(f"{name}: {why}" for name, why in problems[:10])
    more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
    return DataError(f"{len(problems)} corrupt JPEGs: {shown}{more}; replace the files or delete them")


def check_files(files: list[str], threads: int) -> None:
    """Look at both ends of every file, `threads` at a time (a few seconds per million files);
    one whose end lacks the marker is decoded whole."""
    with ThreadPoolExecutor(threads) as pool:
        problems = [(path, why) for path, why in zip(files, pool.map(_file_problem, files, chunksize=256)) if why]
    if problems:
        raise corrupt(problems)


def _byte_problems(names: list[str], encoded: list) -> list[tuple[str, str]]:
    """(name, what is wrong) of each file in memory (bytes or uint8 arrays) whose ends show damage."""
    return [(name, why) for name, data in zip(names, encoded)
            if (why := jpeg_problem(bytes(data[:len(_PNG_START)]), bytes(data[-_TAIL:]), lambda: bytes(data)))]


def check_bytes(names: list[str], encoded: list) -> None:
    """The same look for files already in memory."""
    problems = _byte_problems(names, encoded)
    if problems:
        raise corrupt(problems)


def decode_error(names: list[str], encoded: list, error: Exception) -> DataError:
    """DALI failed on a batch without saying which file: look at each file's ends, as
    data.check_files does (a GIF under a .jpg name, which PIL decodes and DALI does not, was
    not found), then decode each with PIL to find it."""
    problems = _byte_problems(names, encoded)
    if problems:
        return corrupt(problems)
    from PIL import Image, UnidentifiedImageError
    for name, data in zip(names, encoded):
        try:
            with Image.open(io.BytesIO(bytes(data))) as image:
                image.load()
        except UnidentifiedImageError:  # its message names the in-memory copy by address, not the file
            return corrupt([(name, "cannot be decoded (its header is damaged: no image can be read from it)")])
        except Exception as e:  # PIL raises many kinds; any of them names the culprit
            return corrupt([(name, f"cannot be decoded ({e})")])
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    detail = str(error).split("encountered:")[-1].strip().splitlines()[0]  # past DALI's preamble
    return DataError(f"DALI could not decode a batch of {shown} ({detail}); check these files")
