"""Archives read in memory: the tar reader against the standard library's, and CIFAR-10's
JPEG tree read from its archive as from its folder."""
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.config import DataConfig, TrainConfig, TrainerConfig
from trainer.data import build_sources
from trainer.data.tar import tar_files
from trainer.errors import DataError

CPU = torch.device("cpu")
LONG = "train/" + "a-long-class-name-" * 6 + "/" + "an-even-longer-file-name-" * 3 + ".jpg"  # 194 bytes


def archive(fmt: int, compress: bool) -> bytes:
    """Files of sizes around block boundaries, an empty one, a long path, a non-ASCII name,
    one that is not UTF-8, a directory, and links: hard and symbolic ones to files (one
    through another link, one to the long path), and a symbolic one to nothing."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if compress else "w", format=fmt) as tar:
        def add(name, data=None, kind=tarfile.REGTYPE, target=""):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            info.size = len(data or b"")
            tar.addfile(info, io.BytesIO(data) if data else None)
        add("train", kind=tarfile.DIRTYPE)
        for i, size in enumerate((1, 511, 512, 513, 5000)):
            add(f"train/{i}.jpg", bytes(np.random.default_rng(i).integers(0, 256, size, np.uint8)))
        add("train/empty.jpg", b"")
        add(LONG, b"long")
        add("train/grenouille-\u00e9t\u00e9.jpg", b"frog")
        add(os.fsdecode(b"train/\xe9t\xe9.jpg"), b"latin-1")  # a name in Latin-1, not UTF-8
        add("train/hard.jpg", kind=tarfile.LNKTYPE, target="train/3.jpg")
        add("train/sub/symbolic.jpg", kind=tarfile.SYMTYPE, target="../hard.jpg")  # from its own folder
        if fmt != tarfile.USTAR_FORMAT:  # ustar holds link targets of 100 bytes at most
            add("train/long-link.jpg", kind=tarfile.SYMTYPE, target=LONG[len("train/"):])
        add("train/dangling.jpg", kind=tarfile.SYMTYPE, target="train/a.jpg")  # train/train/a.jpg: none
        add("val/frogs", kind=tarfile.SYMTYPE, target="../train/sub")  # a folder, with a link in it
        add("val/all.jpg", kind=tarfile.SYMTYPE, target="frogs/symbolic.jpg")  # through the folder's link
    return buffer.getvalue()


def unpacked(data: bytes, folder: Path) -> dict[str, bytes]:
    """{path: contents} of the files an archive unpacks to, as `find -L` lists them: its links
    followed, a loop of folders left out."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(folder, filter="tar")
    listed = subprocess.run(["find", "-L", ".", "-type", "f"], cwd=folder, capture_output=True, check=False).stdout
    return {os.fsdecode(path)[2:]: (folder / os.fsdecode(path)).read_bytes() for path in listed.splitlines()}


@pytest.mark.parametrize("compress", [False, True], ids=["tar", "tgz"])
@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["ustar", "gnu", "pax"])
def test_tar_files_reads_what_the_archive_unpacks_to(fmt, compress, tmp_path):
    """Links included: unpacked, each reads as its target (a folder with a hard link gave one
    image more than its archive), a link to a folder as the folder's files (they were left
    out)."""
    data = archive(fmt, compress)
    expected = unpacked(data, tmp_path)
    assert expected["train/sub/symbolic.jpg"] == expected["train/3.jpg"] == expected["val/frogs/symbolic.jpg"]
    assert expected["val/all.jpg"] == expected["train/3.jpg"] and "train/dangling.jpg" not in expected
    assert LONG in expected and len(expected) == (13 if fmt == tarfile.USTAR_FORMAT else 14)
    members = tar_files(data)
    assert members.files == expected and members.dangling == ["train/dangling.jpg"] and members.folders == {"train"}
    assert members.linked == {"val/frogs": "train/sub"}


@pytest.mark.parametrize("links", [
    [("a/b/up", "..")],  # a link to the folder that holds it
    [("a/b/c", "../d"), ("a/d/e", "../b")],  # two folders linked to each other
    [(f"a/{x}/{y}", f"../{y}") for x in "bcd" for y in "bcd" if x != y],  # three, each linked to the other two
    [("a/b/1.jpg", "../d/1.jpg")],  # a link after the file of its name: unpacked, it replaces the file
    [(f"a/gone{i}", f"../nowhere/{i}.jpg") for i in range(50)],  # dangling
], ids=["up", "two", "three", "replaced", "dangling"])
def test_links_read_as_find_follows_them_unpacked(links, tmp_path):
    """A loop of folders is listed as `find -L` lists it, once down each way; the old
    resolution expanded three folders linked to each other into 245,730 paths."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for folder in "bcd":
            for i in range(3):
                info = tarfile.TarInfo(f"a/{folder}/{i}.jpg")
                info.size = 2
                tar.addfile(info, io.BytesIO(f"{folder}{i}".encode()))
        for name, target in links:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    files, _, _, dangling = tar_files(buffer.getvalue())
    assert files == unpacked(buffer.getvalue(), tmp_path)
    assert sorted(dangling) == sorted(name for name, _ in links if not (tmp_path / name).exists())


def cifar(root: Path, **data) -> TrainConfig:
    return TrainConfig(data=DataConfig(name="cifar10", root=str(root), **data), trainer=TrainerConfig(batch_size=4))


def test_a_damaged_or_truncated_archive_is_refused_with_its_path(tmp_path):
    """As damaged, with the advice to copy it again: a truncated download was told that
    data.root must be a .tgz of the tree, which it was. A file that is no archive is told so."""
    data = bytearray(archive(tarfile.GNU_FORMAT, compress=False))
    data[3 * 512 + 130] ^= 0x01  # a bit of the second file's size: its header's checksum no longer holds
    damaged, truncated, cut = tmp_path / "damaged.tar", tmp_path / "truncated.tgz", tmp_path / "cut.tar"
    damaged.write_bytes(bytes(data))
    truncated.write_bytes(archive(tarfile.GNU_FORMAT, compress=True)[:-100])
    cut.write_bytes(bytes(data[:3 * 512]))  # between two members: what is left reads as a shorter archive
    lettered = tmp_path / "lettered.tar"  # letters in a checksum's field: int()'s ValueError, as no archive's
    lettered.write_bytes(bytes(data[:3 * 512 + 148]) + b"garbage!" + bytes(data[3 * 512 + 156:]))
    first = tmp_path / "first.tar"  # the first header's checksum changed: a tar archive still ("ustar" at 257)
    first.write_bytes(bytes(data[:150]) + bytes([data[150] ^ 0x01]) + bytes(data[151:]))
    for path, why in ((damaged, "damaged tar header at byte 1536"), (truncated, "its gzip stream: Compressed file ended"),
                      (cut, "ends at byte 1536 without its end-of-archive blocks"),
                      (lettered, "damaged tar header at byte 1536"), (first, "damaged tar header at byte 0")):
        with pytest.raises(DataError, match=f"^the archive {path} is damaged or truncated \\(.*{why}.*\\): "
                                            f"download or copy it again$"):
            build_sources(cifar(path), CPU, 0, 1, None)
    # a file of text was told "invalid literal for int() with base 8", of the letters where a checksum would be
    text, short = tmp_path / "notes.tgz", tmp_path / "short.tar"
    text.write_bytes(b"not an archive\n" * 100)
    short.write_bytes(b"not an archive\n")
    for path in (text, short):
        with pytest.raises(DataError, match=f"^cannot read the archive {path}: it is not a tar archive, gzip-compressed "
                                            "or not; data.root must be a .tgz/.tar of the CIFAR-10 JPEG tree"):
            build_sources(cifar(path), CPU, 0, 1, None)


def archived(tree: Path) -> Path:
    """The tree as the .tgz beside it, under CIFAR-10's folder name."""
    path = tree.parent / "cifar.tgz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(tree, arcname="cifar10")
    return path


def jpeg_tree(root: Path) -> dict[str, np.ndarray]:
    """CIFAR-10's layout with three classes: 32x32 JPEGs of noise, which JPEG cannot keep exactly."""
    images = {}
    for split, count in (("train", 4), ("test", 2)):
        for k, name in enumerate(("cat", "airplane", "frog")):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                pixels = np.random.default_rng([k, i]).integers(0, 256, (32, 32, 3), np.uint8)
                path = root / split / name / f"{i:04d}.jpg"
                Image.fromarray(pixels).save(path, quality=90)
                images[f"{split}/{name}/{i:04d}"] = np.asarray(Image.open(path).convert("RGB"))
    return images


def test_the_jpeg_tree_reads_the_same_from_its_archive_and_its_folder(tmp_path):
    images = jpeg_tree(tmp_path / "tree")
    loaded = []
    for root in (tmp_path / "tree", archived(tmp_path / "tree")):
        train, val = build_sources(cifar(root, num_classes=3, train_size=12, val_size=6), CPU, 0, 1, None)
        loaded.append([train.images, train.labels, val.images, val.labels])
    for a, b in zip(*loaded):
        assert torch.equal(a, b)
    # the test split in folder order (airplane, cat, frog: sorted names are the labels), decoded as PIL does
    _, _, val_images, val_labels = loaded[0]
    assert val_labels.tolist() == [0, 0, 1, 1, 2, 2]
    expected = np.stack([images[f"test/{name}/{i:04d}"] for name in ("airplane", "cat", "frog") for i in range(2)])
    assert np.abs(val_images.numpy().astype(int) - expected).max() <= 2


def test_a_tree_with_test_and_val_folders_reads_test_alone_from_its_archive_as_from_its_folder(tmp_path):
    """The archive merged both, where the folder reader takes test/ (a label per folder order
    of 12 images where the folder gave 6)."""
    jpeg_tree(tmp_path / "tree")
    for name in ("cat", "airplane", "frog"):
        (tmp_path / "tree" / "val" / name).mkdir(parents=True)
        Image.new("RGB", (32, 32), (255, 255, 255)).save(tmp_path / "tree" / "val" / name / "white.jpg")
    loaded = []
    for root in (tmp_path / "tree", archived(tmp_path / "tree")):
        cfg = cifar(root, num_classes=3, train_size=12, val_size=9)
        with pytest.raises(DataError, match="holds 6 val images, fewer than the data.val_size=9 asked for"):
            build_sources(cfg, CPU, 0, 1, None)
        cfg.data.val_size = 6
        _, val = build_sources(cfg, CPU, 0, 1, None)
        loaded.append(val.images)
    assert torch.equal(*loaded) and loaded[1].float().mean() < 200  # test/'s noise, no white val/ image


def test_hidden_folders_and_files_in_an_archive_are_left_out_as_in_its_folder(tmp_path):
    """macOS's ._NAME.jpg beside a copied image (its attributes, no JPEG) stopped the
    archive's run as a corrupt JPEG, and Jupyter's .ipynb_checkpoints/ counted as a class."""
    tree = tmp_path / "tree"
    jpeg_tree(tree)
    for jpeg in list(tree.glob("*/*/*.jpg")):
        (jpeg.parent / f"._{jpeg.name}").write_bytes(b"\x00\x05\x16\x07")  # AppleDouble's magic number
    (tree / "train" / ".ipynb_checkpoints").mkdir()
    shutil.copy(tree / "train" / "cat" / "0000.jpg", tree / "train" / ".ipynb_checkpoints" / "0000-checkpoint.jpg")
    loaded = []
    for root in (tree, archived(tree)):
        train, val = build_sources(cifar(root, num_classes=3, train_size=12, val_size=6), CPU, 0, 1, None)
        loaded.append([train.images, train.labels, val.images, val.labels])
    for a, b in zip(*loaded):
        assert torch.equal(a, b)


def test_an_archive_of_fewer_jpegs_than_asked_for_names_the_size_asked_for(tmp_path):
    jpeg_tree(tmp_path / "tree")
    cfg = cifar(archived(tmp_path / "tree"), num_classes=3, train_size=20)
    with pytest.raises(DataError, match="holds 12 train images, fewer than the data.train_size=20 asked for; "
                                        "set data.train_size=12 or less$"):
        build_sources(cfg, CPU, 0, 1, None)


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs the tar command")
def test_a_tree_archived_twice_reads_each_image_once_as_it_unpacks(tmp_path):
    """GNU tar stores the files of a folder named twice (tar czf a.tgz train test train) the
    second time as hard links to themselves: they were taken as loops of links and left out,
    so the archive held no training images. Appended again (tar rf), the later copy is read."""
    tree = tmp_path / "tree"
    jpeg_tree(tree)
    twice, appended = tmp_path / "twice.tgz", tmp_path / "appended.tar"
    subprocess.run(["tar", "czf", twice, "train", "test", "train"], cwd=tree, check=True)
    subprocess.run(["tar", "cf", appended, "train", "test"], cwd=tree, check=True)
    shutil.copy(tree / "train" / "frog" / "0000.jpg", tree / "train" / "cat" / "0000.jpg")
    subprocess.run(["tar", "rf", appended, "train"], cwd=tree, check=True)
    for path in (twice, appended):
        assert tar_files(path.read_bytes()).files == unpacked(path.read_bytes(), tmp_path / path.stem)

    def loaded(root):
        train, val = build_sources(cifar(root, num_classes=3, train_size=12, val_size=6), CPU, 0, 1, None)
        return [train.images, train.labels, val.images, val.labels]
    now, before = loaded(tree), loaded(twice)
    assert all(torch.equal(a, b) for a, b in zip(now, loaded(appended)))
    changed = 4  # train/cat/0000.jpg: the first image of the second class folder in sorted order
    assert torch.equal(before[0][:changed], now[0][:changed]) and not torch.equal(before[0][changed], now[0][changed])


def test_an_archive_holding_a_split_folder_in_two_places_is_refused(tmp_path):
    """Two copies of the tree (cifar10/ and a backup of it): every image was read from both."""
    jpeg_tree(tmp_path / "tree")
    path = tmp_path / "two.tgz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(tmp_path / "tree", arcname="cifar10")
        tar.add(tmp_path / "tree" / "train", arcname="backup/cifar10/train")
    with pytest.raises(DataError, match=f"^the archive {path} holds train/ in 2 places \\(backup/cifar10/train, "
                                        "cifar10/train\\): its images would be read once from each; make the archive "
                                        "again of one tree$"):
        build_sources(cifar(path, num_classes=3, train_size=12, val_size=6), CPU, 0, 1, None)


@pytest.mark.parametrize("link, target, what", [("train/dog", "../../elsewhere/dog", "a class folder"),
                                                ("test/cat/0002.jpg", "0009.jpg", "a file")], ids=["class", "image"])
def test_a_link_in_an_archive_to_a_class_folder_or_image_not_there_is_named(tmp_path, link, target, what):
    """As in its folder: the class or image was left out without a word, and the run trained
    on fewer classes or images than the archive shows."""
    tree = tmp_path / "tree"
    jpeg_tree(tree)
    (tree / link).symlink_to(target)
    said = f"is a link to {what} that is not there: restore its target, or remove the link"
    path = archived(tree)
    for root, named, then in ((tree, tree / link, ""), (path, f"{path}:cifar10/{link}", ", then make the archive again")):
        with pytest.raises(DataError, match=f"^{named} {said}{then}$"):
            build_sources(cifar(root, num_classes=3, train_size=12, val_size=6), CPU, 0, 1, None)


@pytest.mark.parametrize("add, named, said", [
    ("train/cat/0009.webp", "train/cat/0009.webp",
     "only .jpg/.jpeg/.png images are read; convert it to JPEG or PNG, or move it out of the data set"),
    ("train/dog/", "train/dog", "it holds no .jpg/.jpeg/.png file; add its images, or remove the class's folder from "
                                "every split \\(they need the same ones\\)"),
    ("test/cat/notes/0000.jpg", "", ""),  # in a subfolder: test/cat keeps its images
], ids=["another-kind", "empty", "subfolder"])
def test_what_the_folder_reader_refuses_is_refused_in_the_archive_too(tmp_path, add, named, said):
    """An image of another kind, a class folder without images: left out of the archive without
    a word, where its folder names them, so the run trained on fewer images or classes."""
    tree = tmp_path / "tree"
    jpeg_tree(tree)
    if add.endswith("/"):
        (tree / add).mkdir()
    else:
        (tree / add).parent.mkdir(exist_ok=True)
        Image.new("RGB", (32, 32)).save(tree / add)
    path = archived(tree)
    for root, shown, then in ((tree, tree / named, ""), (path, f"{path}:cifar10/{named}", ", then make the archive again")):
        cfg = cifar(root, num_classes=3, train_size=12, val_size=6)
        if not named:
            build_sources(cfg, CPU, 0, 1, None)
            continue
        empty = "empty class folder " if add.endswith("/") else ""
        with pytest.raises(DataError, match=f"^{empty}{shown}: {said}{then}$"):
            build_sources(cfg, CPU, 0, 1, None)


def test_two_class_folders_that_are_one_through_a_link_in_an_archive_are_named_as_in_its_folder(tmp_path):
    """Its images were trained under both labels, each the other's wrong answer."""
    tree = tmp_path / "tree"
    jpeg_tree(tree)
    for split in ("train", "test"):
        (tree / split / "dog").symlink_to("cat")
    (tree / "test" / "frog").rename(tree / "frog")
    (tree / "test" / "frog").symlink_to("../frog")  # a class folder elsewhere: its own images
    path = archived(tree)
    said = "are one folder, reached through a link: each class needs its own images; remove the link"
    for root, named, then in ((tree, f"{tree}/", ""), (path, f"{path}:cifar10/", ", then make the archive again")):
        with pytest.raises(DataError, match=f"^class folders {named}(train|test)/cat and {named}\\1/dog {said}{then}$"):
            build_sources(cifar(root, num_classes=4, train_size=16, val_size=8), CPU, 0, 1, None)
