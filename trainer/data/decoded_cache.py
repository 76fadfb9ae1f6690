"""Decoded images kept on disk (data.decode_cache), so that runs after the first on a machine
skip reading and decoding an archive's JPEGs: CIFAR-10's 60,000 take seconds of set-up,
their decoded pixels (180 MB) a tenth of a second to load.

An entry is named by a hash of the archive's bytes and of what was taken from it (the
split sizes, the classes), so a changed archive or configuration misses: an entry never
goes stale. An entry that cannot be read is decoded again and rewritten; one that cannot be
written only costs the next run its decoding.
"""
import hashlib
import logging
import zipfile
from pathlib import Path

import numpy as np

from trainer.errors import WriteError
from trainer.run_dir import writing

log = logging.getLogger("trainer")
FORMAT = 3  # raised whenever what an entry holds, or how it was decoded, changes


def entry(cache_dir: str, archive: bytes, *taken) -> Path:
    digest = hashlib.blake2b(archive, digest_size=16)
    digest.update(repr((FORMAT, *taken)).encode())
    return Path(cache_dir).expanduser() / f"decoded-{digest.hexdigest()}.npz"


def load(path: Path, shapes: dict[str, tuple]) -> dict[str, np.ndarray] | None:
    """The entry's arrays, or None where it is absent or does not hold arrays of `shapes`."""
    if not path.is_file():
        return None
    try:
        with np.load(path) as f:
            arrays = {name: f[name] for name in shapes}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        log.warning("the decoded-image cache %s cannot be read (%s): decoding again", path, e)
        return None
    if {name: a.shape for name, a in arrays.items()} != shapes:
        log.warning("the decoded-image cache %s holds other shapes than this data set's: decoding again", path)
        return None
    log.info("decoded images from %s", path)
    return arrays


def save(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Written under another name and renamed: a run that stops part way, or two runs writing
    at once, never leave a half-written entry under the name others read."""
    try:
        with writing(path) as f:
            np.savez(f, **arrays)
        log.info("decoded images kept in %s for later runs (data.decode_cache)", path)
    except WriteError as e:
        # a file where a folder of the path is wanted: mkdir's reason, "File exists", would not say which
        file = next((folder for folder in path.parents if folder.is_file()), None)
        log.warning("cannot keep the decoded images: %s; the next run decodes them again; "
                    "set data.decode_cache to a writable folder, or to '' not to keep them",
                    f"{file} is a file, not a folder" if file else e)
