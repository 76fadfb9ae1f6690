"""JPEG class folders through DALI: labels, normalization, variants, and the error messages."""
import ctypes
import io
import math
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import serve
from trainer.config import DataConfig, TrainConfig, TrainerConfig
from trainer.data import build_sources, dataset_sizes
from trainer.data.jpeg_files import forget_listings
from trainer.data.jpeg_folder import ASPECT_RATIOS, CROP_ATTEMPTS, IMAGENET_MEAN, IMAGENET_STD
from trainer.data.make_jpeg_tree import main as make_jpeg_tree
from trainer.errors import DataError

CPU = torch.device("cpu")
# Folder names sort differently from this order: labels must follow the sorted names.
COLORS = {"zebra": (200, 40, 40), "apple": (40, 200, 40), "mango": (40, 40, 200)}
LABEL_OF_COLOR = {color: sorted(COLORS).index(name) for name, color in COLORS.items()}


@pytest.fixture
def tree(tmp_path) -> Path:
    """Solid-color images, one color per class: any crop of an image tells its class."""
    root = tmp_path / "tree"
    for split, count in (("train", 5), ("val", 2)):
        for name, color in COLORS.items():
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                size = (48 + 8 * i, 40)  # sizes differ, as photos do
                Image.new("RGB", size, color).save(root / split / name / f"{i}.jpg", quality=95)
    return root


@pytest.fixture
def photo_tree(tmp_path) -> Path:
    """Two classes of six striped images of about 48x36 for training (make_jpeg_tree):
    crops of them differ from window to window, which the solid colors of `tree` hide."""
    make_jpeg_tree([str(tmp_path / "photos"), "--classes", "2", "--per-class", "6", "--val-per-class", "1",
                    "--size", "48x36", "--jobs", "2"])
    return tmp_path / "photos"


@pytest.fixture
def as_a_user():
    """Permissions as a user meets them: root's override of them (CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH) left out of this thread's effective capabilities, and so of the
    threads it starts, until the test ends; a user other than root has none to leave out."""
    if os.geteuid() != 0:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, the calling thread
    caps = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: their low words, then their high ones
    if not hasattr(libc, "capget") or libc.capget(header, caps) != 0:
        pytest.skip("run as root, where Linux's capget cannot leave out root's override of permissions")
    saved = (ctypes.c_uint32 * 6)(*caps)
    caps[0] &= ~(1 << 1 | 1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    if libc.capset(header, caps) != 0:
        pytest.skip("run as root, where Linux's capset cannot leave out root's override of permissions")
    try:
        yield
    finally:
        libc.capset(header, saved)


def config(root, num_classes=3, batch=4, val_batch=0, drop_last=True, resolution=24, **data):
    return TrainConfig(data=DataConfig(name="imagefolder", root=str(root), num_classes=num_classes,
                                       resolution=resolution, threads=2, **data),
                       trainer=TrainerConfig(batch_size=batch, val_batch_size=val_batch, drop_last=drop_last))


def colors_of(data: torch.Tensor) -> list[tuple[int, ...]]:
    """The color at each image's center, back from the normalization, snapped to COLORS."""
    rgb = data[:, data.shape[1] // 2, data.shape[2] // 2, :3].float() * torch.tensor(IMAGENET_STD) * 255
    rgb += torch.tensor(IMAGENET_MEAN) * 255
    palette = torch.tensor(list(COLORS.values()), dtype=torch.float32)
    nearest = torch.cdist(rgb, palette).argmin(1)
    assert torch.cdist(rgb, palette).min(1).values.max() < 12  # normalized with ImageNet's statistics
    return [tuple(palette[i].int().tolist()) for i in nearest]


def test_labels_follow_the_sorted_class_folders(tree):
    train, val = build_sources(config(tree, batch=7, val_batch=3, drop_last=False), CPU, 0, 1, None)
    assert (train.size, val.size, train.num_classes) == (15, 6, 3)
    for source, sizes in ((train, (7, 7, 1)), (val, (3, 3))):
        batches = serve(source, sizes, 24, mask=source is val)
        labels = [lab for _, label, _ in batches for lab in label.tolist()]
        colors = [c for data, _, _ in batches for c in colors_of(data)]
        assert labels == [LABEL_OF_COLOR[c] for c in colors]
        assert sorted(labels) == sorted([0, 1, 2] * (len(labels) // 3))  # every image once


def test_later_epochs_fed_ahead_serve_their_own_order(tree):
    # three batches an epoch: each later epoch is fed whole while the one before is served,
    # its partial last batch included
    train, _ = build_sources(config(tree, batch=7, drop_last=False), CPU, 0, 1, None)
    for epoch in range(3):
        batches = serve(train, (7, 7, 1), 24, epoch=epoch)
        labels = [lab for _, label, _ in batches for lab in label.tolist()]
        assert labels == train.labels[train.shard.epoch(train.seed, epoch).examples].tolist()
        assert labels == [LABEL_OF_COLOR[c] for data, _, _ in batches for c in colors_of(data)]


def test_evaluation_images_are_torchvisions_resize_and_center_crop(tmp_path):
    """The view of each evaluation image is torchvision's Resize(round(resolution * val_resize))
    then CenterCrop(resolution), pixel for pixel: DALI's resize_shorter=27.36 kept the
    fractional scale and rounded the long side (33 pixels where torchvision makes 32), and its
    center crop rounded a half pixel up, so views were shifted by up to a pixel."""
    from torchvision.transforms import CenterCrop, Resize
    root = tmp_path / "shapes"
    # (width, height): either side the short one, long sides whose crop margin is odd and even
    sizes = [(33, 40), (40, 50), (61, 33), (61, 40), (47, 47), (71, 50)]
    for split in ("train", "val"):
        for name in ("a", "b"):
            (root / split / name).mkdir(parents=True)
            for i, (w, h) in enumerate(sizes):
                y, x = np.mgrid[0:h, 0:w]  # smooth ramps: a shifted or rescaled view differs by several levels
                image = np.stack([x * 255 // w, y * 255 // h, (x + 2 * y) * 255 // (w + 2 * h)], -1)
                Image.fromarray(image.astype(np.uint8)).save(root / split / name / f"{i}.png")
    _, val = build_sources(config(root, num_classes=2, val_batch=12), CPU, 0, 1, None)
    (data, _, _), = serve(val, (12,), 24)
    got = data * torch.tensor(IMAGENET_STD) * 255 + torch.tensor(IMAGENET_MEAN) * 255
    view = [CenterCrop(24)(Resize(round(24 * 1.14))(Image.open(f).convert("RGB"))) for f in val.files]
    want = torch.from_numpy(np.stack([np.asarray(v) for v in view])).float()
    torch.testing.assert_close(got, want, atol=2.01, rtol=0)  # the two libraries' interpolation rounds apart


def test_host_decode_changes_nothing_on_a_cpu(photo_tree):
    """It split each batch between two pipelines on the host, each cropping from a seed of
    its own: other crops than host_decode=0, another run (host_decode=1 matched 0)."""
    served = []
    for host_decode in (0.0, 0.5):
        train, _ = build_sources(config(photo_tree, num_classes=2, host_decode=host_decode), CPU, 0, 1, None)
        served.append(torch.cat([data for data, _, _ in serve(train, (4, 4, 4), 24)]))
    assert train.parts == 1 and torch.equal(*served)


def test_last_partial_batch_low_resolution_and_half(tmp_path):
    """Each training image is torchvision's resized_crop of its window (deterministic=true's, drawn
    from the seed) at the epoch's resolution, flipped where drawn: low, then full resolution, fp16."""
    from torchvision.transforms.functional import hflip, resized_crop
    from trainer.data.jpeg_folder import resized_crop_windows
    from trainer.data.source import flips, resized_crop_draws
    root = tmp_path / "waves"
    for name in ("a", "b"):
        for split, sizes in (("train", [(48, 40), (40, 50), (61, 33), (56, 44)]), ("val", [(40, 40)])):
            (root / split / name).mkdir(parents=True)
            for i, (w, h) in enumerate(sizes):
                # ramps: a shifted, rescaled or unflipped view differs by several levels; a wave of about
                # 9 pixels: so does another filter (the ramps, linear, come out of any filter the same)
                y, x = np.mgrid[0:h, 0:w]
                image = np.stack([x * 255 // w, y * 255 // h, 128 + 100 * np.sin(x / 1.5 + y / 2.3)], -1)
                Image.fromarray(image.astype(np.uint8)).save(root / split / name / f"{i}.png")
    torch.use_deterministic_algorithms(True)  # as use_device sets it before the data is built (conftest resets it)
    train, _ = build_sources(config(root, num_classes=2, batch=3, drop_last=False), CPU, 0, 1, torch.float16)
    assert train.shard.batches == [3, 3, 2]
    for epoch, resolution in ((0, 16), (1, 24)):  # progressive resizing: low, then full
        batches = serve(train, (3, 3, 2), resolution, channels=4, dtype=torch.float16, epoch=epoch)
        data = torch.cat([data for data, _, _ in batches])
        assert torch.all(data[..., 3] == 0)
        examples = train.shard.epoch(train.seed, epoch).examples
        assert torch.cat([label for _, label, _ in batches]).tolist() == train.labels[examples].tolist()
        images = [Image.open(train.files[i]).convert("RGB") for i in examples]
        draws = resized_crop_draws(train.shard.total, CROP_ATTEMPTS, train.seed, epoch)[examples]
        corners, sides = resized_crop_windows([np.array((im.height, im.width, 3)) for im in images], list(draws),
                                              train.d.min_crop_area)
        flipped = flips(train.d.flip, train.shard.total, train.seed, epoch)[examples]
        views = [resized_crop(im, int(y), int(x), int(h), int(w), [resolution, resolution])
                 for im, (x, y), (w, h) in zip(images, corners, sides)]
        want = torch.from_numpy(np.stack([np.asarray(hflip(v) if f else v) for v, f in zip(views, flipped)])).float()
        got = data[..., :3].float() * torch.tensor(IMAGENET_STD) * 255 + torch.tensor(IMAGENET_MEAN) * 255
        # a level apart where the libraries round apart, and fp16's rounding; the wave in the border only
        # differs more, where the filters reach past the window (DALI repeats its edge, PIL weighs what is inside)
        torch.testing.assert_close(got[..., :2], want[..., :2], atol=1.25, rtol=0)
        torch.testing.assert_close(got[:, 1:-1, 1:-1, 2], want[:, 1:-1, 1:-1, 2], atol=1.25, rtol=0)


def test_val_shards_mask_their_padding(tree):
    real = 0
    for rank in range(4):  # 6 val images over 4 ranks: 2 per rank, 8 slots
        _, val = build_sources(config(tree, val_batch=2), CPU, rank, 4, None)
        (_, _, mask), = serve(val, (2,), 24, mask=True)
        real += int(mask.sum())
    assert real == 6


def test_fill_writes_in_place(tree):
    train, _ = build_sources(config(tree), CPU, 0, 1, None)
    arena = torch.zeros(2, 4, 24, 24, 3)
    pointers = (arena[0].data_ptr(), arena[1].data_ptr())
    train.start_epoch(0, 24)
    train.fill(arena[0], torch.empty(4, dtype=torch.int32), None, None)
    first = arena[0].clone()
    train.fill(arena[1], torch.empty(4, dtype=torch.int32), None, None)
    assert (arena[0].data_ptr(), arena[1].data_ptr()) == pointers
    assert torch.equal(arena[0], first) and arena[1].abs().sum() > 0


def test_peek(tree):
    train, _ = build_sources(config(tree), CPU, 0, 1, None)
    images = train.peek(7)
    assert images.shape == (7, 3, 24, 24) and images.dtype == torch.float32
    assert len(set(colors_of(images.permute(0, 2, 3, 1)))) > 1  # epoch 0's shuffled order, not one class


def test_a_file_name_that_is_not_utf8_is_read(tree):
    latin1 = tree / "train" / "apple" / os.fsdecode(b"\xe9t\xe9.jpg")  # as an old camera or Windows may name it
    shutil.copy(tree / "train" / "apple" / "0.jpg", latin1)
    train, _ = build_sources(config(tree, batch=16), CPU, 0, 1, None)
    (data, label, _), = serve(train, (16,), 24)
    assert str(latin1) in train.files and label.tolist() == [LABEL_OF_COLOR[c] for c in colors_of(data)]
    latin1.write_bytes(latin1.read_bytes()[:100])  # its message names it as a log stream can write it
    with pytest.raises(DataError, match=f"corrupt JPEG {tree / 'train' / 'apple'}/\\\\xe9t\\\\xe9.jpg: no JPEG end marker"):
        build_sources(config(tree, batch=16), CPU, 0, 1, None)


def test_class_count_must_match(tree, tmp_path):
    """The count may be a checkpoint's, which the run cannot change: the data set then must."""
    with pytest.raises(DataError, match=r"has 3 class folders \(apple, mango, zebra\) but data.num_classes=1000: set "
                                        r"data.num_classes=3, or, to resume or evaluate a model of 1000 classes, give "
                                        r"data.root a data set of 1000$"):
        build_sources(config(tree, num_classes=1000), CPU, 0, 1, None)
    one = tmp_path / "one"  # data.num_classes=1 is refused: "set data.num_classes=1" led there
    for split in ("train", "val"):
        shutil.copytree(tree / split / "apple", one / split / "apple")
    with pytest.raises(DataError, match=f"^{one / 'train'} has one class folder \\(apple\\): a classifier needs 2 "
                                        "classes at least; add the folders of the others$"):
        build_sources(config(one, num_classes=2), CPU, 0, 1, None)


def test_val_must_have_the_training_classes(tree):
    (tree / "val" / "apple").rename(tree / "val" / "apricot")
    with pytest.raises(DataError, match=r"differ in their class folders \(apple, apricot\)"):
        build_sources(config(tree), CPU, 0, 1, None)


def test_evaluation_alone_reads_the_val_split_only(tree):
    """mode=eval listed and checked every training file: a damaged one, or a training split
    left behind, kept a checkpoint from being evaluated."""
    bad = tree / "train" / "apple" / "3.jpg"
    bad.write_bytes(b"")
    train, val = build_sources(config(tree, val_batch=3), CPU, 0, 1, None, read_train=False)
    assert train is None and val.size == 6
    labels = [lab for _, label, _ in serve(val, (3, 3), 24, mask=True) for lab in label.tolist()]
    reference = build_sources(config(tree, val_batch=3, check_files=False), CPU, 0, 1, None)[1]
    assert labels == [lab for _, label, _ in serve(reference, (3, 3), 24, mask=True) for lab in label.tolist()]
    # the training folder's class names still check the labels', where it is there
    (tree / "train" / "apple").rename(tree / "train" / "apricot")
    with pytest.raises(DataError, match=r"differ in their class folders \(apple, apricot\)"):
        build_sources(config(tree), CPU, 0, 1, None, read_train=False)
    shutil.rmtree(tree / "train")
    assert build_sources(config(tree), CPU, 0, 1, None, read_train=False)[1].size == 6
    assert dataset_sizes(config(tree).data, read_train=False) == (0, 6)
    with pytest.raises(DataError, match=f"{tree / 'val'} has 3 class folders .* but data.num_classes=2"):
        build_sources(config(tree, num_classes=2), CPU, 0, 1, None, read_train=False)


def test_a_split_is_listed_once_while_its_folders_are_unchanged(tree, monkeypatch):
    """The planner's count and the sources each listed every class folder (three listings of
    ImageNet's 1.28M training files before the first step, two of them at once); a file
    added since is seen, and a new run lists the folders again."""
    for folder in [tree / "train", *(tree / "train").iterdir()]:  # times well apart from the change below
        os.utime(folder, ns=(10**18, 10**18))
    scanned = []
    real_scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: scanned.append(Path(path)) or real_scandir(path))
    with ThreadPoolExecutor(2) as pool:  # the planner's count, beside the data's thread, as a run makes them
        counted = pool.submit(dataset_sizes, config(tree).data)
        build_sources(config(tree), CPU, 0, 1, None)
        assert counted.result() == (15, 6)
    assert sorted(p for p in scanned if p.parent == tree / "train") == sorted((tree / "train").iterdir())
    Image.new("RGB", (48, 40), COLORS["apple"]).save(tree / "train" / "apple" / "9.jpg")
    assert dataset_sizes(config(tree).data) == (16, 6)
    forget_listings()  # a new run: listed again whatever the times say
    dataset_sizes(config(tree).data)
    assert sum(p == tree / "train" / "apple" for p in scanned) == 3


def test_missing_directories(tree, tmp_path):
    with pytest.raises(DataError, match=f"missing data.root {tmp_path / 'nowhere'}"):
        build_sources(config(tmp_path / "nowhere"), CPU, 0, 1, None)
    (tmp_path / "photos.tgz").write_bytes(b"")
    with pytest.raises(DataError, match=f"data.root={tmp_path / 'photos.tgz'} is a file, where the folders are read"):
        dataset_sizes(config(tmp_path / "photos.tgz").data)
    shutil.rmtree(tree / "val")
    with pytest.raises(DataError, match=f"missing directory {tree / 'val'}"):
        dataset_sizes(config(tree).data)


@pytest.mark.parametrize("folder, mode, named", [
    ("train/apple", 0o000, "train/apple"),  # its files listed
    ("train", 0o000, "train"),  # its class folders listed
    (".", 0o000, "train"),  # the split's folder looked for in data.root
    ("val", 0o444, "val/apple"),  # listed, but its class folders' times not read
], ids=["class-folder", "split", "root", "split-unsearchable"])
def test_a_folder_that_cannot_be_read_is_named(tree, as_a_user, folder, mode, named):
    """It ended in PermissionError's traceback, where a file that cannot be read is named."""
    (tree / folder).chmod(mode)
    with pytest.raises(DataError, match=f"^cannot read {tree / named} \\(Permission denied\\): check its permissions "
                                        "and those of the folders that hold it$"):
        build_sources(config(tree), CPU, 0, 1, None)


def test_hidden_folders_and_files_are_not_classes_or_images(tree):
    """Jupyter's .ipynb_checkpoints/ was taken for an empty class, and macOS's ._NAME.jpg
    beside a copied image (its attributes, no JPEG) for a corrupt image: each stopped the run."""
    (tree / "train" / ".ipynb_checkpoints").mkdir()
    (tree / "train" / "apple" / "._0.jpg").write_bytes(b"\x00\x05\x16\x07")
    assert dataset_sizes(config(tree).data) == (15, 6)
    build_sources(config(tree), CPU, 0, 1, None)


def test_a_link_to_an_image_that_is_not_there_is_named(tree):
    """It was left out without a word: the run trained on fewer images than the folder shows."""
    (tree / "train" / "apple" / "9.jpg").symlink_to(tree / "gone.jpg")
    with pytest.raises(DataError, match=f"^{tree / 'train' / 'apple' / '9.jpg'} is a link to a file that is not "
                                        "there: restore its target, or remove the link$"):
        dataset_sizes(config(tree).data)


def test_a_link_to_a_class_folder_that_is_not_there_is_named(tree):
    """It was left out without a word, in every split: the run trained on fewer classes
    than the folders show, or its message asked for data.num_classes of those fewer."""
    for split in ("train", "val"):
        (tree / split / "peach").symlink_to(tree / "gone", target_is_directory=True)
    with pytest.raises(DataError, match=f"^{tree / 'train' / 'peach'} is a link to a class folder that is not there: "
                                        "restore its target, or remove the link$"):
        build_sources(config(tree), CPU, 0, 1, None)
    with pytest.raises(DataError, match=f"^{tree / 'val' / 'peach'} is a link to a class folder"):
        build_sources(config(tree), CPU, 0, 1, None, read_train=False)


@pytest.mark.parametrize("suffix", [".webp", ".BMP", ".tiff"])
def test_an_image_of_another_kind_is_named(tree, suffix):
    """Images torchvision's ImageFolder reads, but not this reader, were left out without a
    word: the run trained on fewer images than the folder shows."""
    Image.new("RGB", (48, 40), COLORS["apple"]).save(tree / "train" / "apple" / f"9{suffix}")
    with pytest.raises(DataError, match=f"^{tree / 'train' / 'apple' / f'9{suffix}'}: only .jpg/.jpeg/.png images are "
                                        "read; convert it to JPEG or PNG, or move it out of the data set$"):
        build_sources(config(tree), CPU, 0, 1, None)


def test_class_folders_that_are_one_folder_are_named(tree):
    """A link to another class's folder gave its images both labels, each the other's wrong
    answer, without a word; links to folders elsewhere are read."""
    for split in ("train", "val"):
        (tree / split / "peach").symlink_to(tree / split / "apple", target_is_directory=True)
        shutil.move(tree / split / "zebra", tree / f"{split}-zebra")
        (tree / split / "zebra").symlink_to(tree / f"{split}-zebra", target_is_directory=True)
    with pytest.raises(DataError, match=f"^class folders {tree / 'train' / 'apple'} and {tree / 'train' / 'peach'} are "
                                        "one folder, reached through a link: each class needs its own images; remove "
                                        "the link$"):
        build_sources(config(tree, num_classes=4), CPU, 0, 1, None)
    for split in ("train", "val"):
        (tree / split / "peach").unlink()
    assert dataset_sizes(config(tree).data) == (15, 6)


def test_empty_class_folder(tree):
    for f in (tree / "val" / "mango").iterdir():
        f.unlink()
    with pytest.raises(DataError, match=f"empty class folder {tree / 'val' / 'mango'}: it holds no .jpg/.jpeg/.png "
                                        f"file; add its images, or remove the class's folder from every split "
                                        f"\\(they need the same ones\\)$"):
        build_sources(config(tree), CPU, 0, 1, None)


def test_an_empty_class_folder_names_what_it_holds_instead(tree):
    """Images in a class folder's subfolders are not read: the message says so, where it
    named no reason."""
    (tree / "train" / "apple" / "2024").mkdir()
    for f in (tree / "train" / "apple").glob("*.jpg"):
        f.rename(tree / "train" / "apple" / "2024" / f.name)
    (tree / "train" / "apple" / "notes.txt").write_text("")
    with pytest.raises(DataError, match=f"empty class folder {tree / 'train' / 'apple'}: it holds no .jpg/.jpeg/.png "
                                        f"file but 2024/, notes.txt \\(images in its subfolders are not read\\)"):
        build_sources(config(tree), CPU, 0, 1, None)


def test_png_files_are_read_as_jpegs_are(tree):
    """DALI's decoders read PNG: a class folder of .png files was empty to the reader."""
    pngs = []
    for folder in (tree / "train" / "apple", tree / "val" / "zebra"):
        for jpeg in list(folder.glob("*.jpg")):
            jpeg.unlink()
            pngs.append(jpeg.with_suffix(".png"))
            Image.new("RGB", (44, 40), COLORS[folder.name]).save(pngs[-1])
    train, val = build_sources(config(tree, batch=15, val_batch=6), CPU, 0, 1, None)
    assert {str(p) for p in pngs} <= set(train.files + val.files)
    for source, size in ((train, 15), (val, 6)):
        (data, label, _), = serve(source, (size,), 24)
        assert label.tolist() == [LABEL_OF_COLOR[c] for c in colors_of(data)]


@pytest.mark.parametrize("content, why", [
    (b"", "empty file"),
    (b"GIF89a" + bytes(100), "no JPEG start marker"),
    ("truncated", "no JPEG end marker"),
])
def test_a_corrupt_file_is_named_before_training(tree, content, why):
    bad = tree / "train" / "apple" / "3.jpg"
    bad.write_bytes(bad.read_bytes()[:len(bad.read_bytes()) // 2] if content == "truncated" else content)
    with pytest.raises(DataError, match=f"corrupt JPEG {bad}: {why}"):
        build_sources(config(tree), CPU, 0, 1, None)


def test_every_corrupt_file_is_named_in_one_message(tree):
    """One run names them all: fixing one file a run took as many runs as there were."""
    bad = [tree / "train" / "apple" / "3.jpg", tree / "val" / "mango" / "0.jpg"]
    for path in bad:
        path.write_bytes(b"")
    empty = "empty file \\(0 bytes\\)"
    with pytest.raises(DataError, match=f"^2 corrupt JPEGs: {bad[0]}: {empty}; {bad[1]}: {empty}; replace the files "
                                        "or delete them$"):
        build_sources(config(tree), CPU, 0, 1, None)


def png_as_jpg(path: Path, color) -> None:
    """A PNG under a .jpg name, as ImageNet's n02105855_2933.JPEG is."""
    Image.new("RGB", (44, 40), color).save(path, format="PNG")


@pytest.mark.parametrize("deterministic", [False, True])  # DALI's crops, or windows from the image's shape
def test_a_png_under_a_jpg_name_passes_the_check_and_is_decoded(tree, deterministic):
    pngs = [tree / "train" / "apple" / "3.jpg", tree / "val" / "zebra" / "1.jpg"]
    for png in pngs:
        png_as_jpg(png, COLORS[png.parent.name])
    torch.use_deterministic_algorithms(deterministic)  # as use_device sets it before the data is built (conftest resets it)
    train, val = build_sources(config(tree, batch=15, val_batch=6), CPU, 0, 1, None)
    for source, png, size in ((train, pngs[0], 15), (val, pngs[1], 6)):
        (data, _, _), = serve(source, (size,), 24)
        row = source.shard.epoch(source.seed, 0).examples.tolist().index(source.files.index(str(png)))
        assert colors_of(data[row:row + 1]) == [COLORS[png.parent.name]]  # the PNG's own pixels


def test_a_truncated_png_is_named_before_training(tree):
    bad = tree / "train" / "mango" / "2.jpg"
    png_as_jpg(bad, COLORS["mango"])
    bad.write_bytes(bad.read_bytes()[:-20])
    with pytest.raises(DataError, match=f"corrupt JPEG {bad}: no PNG end chunk \\(IEND\\): the file is truncated"):
        build_sources(config(tree), CPU, 0, 1, None)


def with_thumbnail(path: Path) -> None:
    """The JPEG with an EXIF segment holding a thumbnail, which ends with an end marker of its own."""
    thumbnail = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 0, 0)).save(thumbnail, format="JPEG")
    exif = b"Exif\0\0" + thumbnail.getvalue()
    data = path.read_bytes()
    path.write_bytes(data[:2] + b"\xff\xe1" + (len(exif) + 2).to_bytes(2, "big") + exif + data[2:])


def test_a_long_trailer_after_the_end_marker_passes_the_check_but_a_truncated_file_does_not(tree):
    """Phone cameras append kilobytes after the end marker: such a JPEG is decoded whole to
    tell it from a truncated one (whose EXIF thumbnail's marker would fool a search)."""
    trailed = [tree / "train" / "apple" / "3.jpg", tree / "val" / "zebra" / "1.jpg"]
    png_as_jpg(trailed[1], COLORS["zebra"])  # a PNG's IEND chunk too
    for path in trailed:
        path.write_bytes(path.read_bytes() + b"MotionPhoto_Data" + bytes(range(256)) * 16)
    train, val = build_sources(config(tree, batch=15, val_batch=6), CPU, 0, 1, None)
    for source, path, size in ((train, trailed[0], 15), (val, trailed[1], 6)):
        (data, _, _), = serve(source, (size,), 24)
        row = source.shard.epoch(source.seed, 0).examples.tolist().index(source.files.index(str(path)))
        assert colors_of(data[row:row + 1]) == [COLORS[path.parent.name]]
    bad = tree / "train" / "mango" / "2.jpg"
    with_thumbnail(bad)
    bad.write_bytes(bad.read_bytes()[:-40])  # cut inside the image's own data
    with pytest.raises(DataError, match=f"corrupt JPEG {bad}: no JPEG end marker \\(FF D9\\): the file is truncated"):
        build_sources(config(tree), CPU, 0, 1, None)


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux's /proc/self/mem")
def test_a_file_that_cannot_be_read_is_named_with_the_reason(tree):
    bad = tree / "train" / "apple" / "bad.jpg"
    bad.symlink_to("/proc/self/mem")  # its first page is unmapped: reading it fails with EIO, as a failing disk's
    with pytest.raises(DataError, match=f"^cannot read {bad} \\(Input/output error\\): check the file"):
        build_sources(config(tree), CPU, 0, 1, None)


def test_a_file_left_unchecked_that_cannot_be_read_is_named_with_the_reason(tree, as_a_user):
    """data.check_files=false: DALI's read fails on it, and the message said it had changed
    since the data set was listed, which it had not."""
    bad = tree / "val" / "mango" / "0.jpg"
    bad.chmod(0o000)
    _, val = build_sources(config(tree, val_batch=6, check_files=False), CPU, 0, 1, None)
    with pytest.raises(DataError, match=f"^cannot read {bad} \\(Permission denied\\): check the file and its "
                                        "permissions, or delete it$"):
        serve(val, (6,), 24)


def test_a_file_dali_cannot_decode_is_named_when_its_batch_fails(tree):
    bad = tree / "train" / "mango" / "1.jpg"
    bad.write_bytes(b"\xff\xd8" + bytes(range(256)) * 4 + b"\xff\xd9")  # the ends look right
    train, _ = build_sources(config(tree, batch=15), CPU, 0, 1, None)
    with pytest.raises(DataError, match=f"^corrupt JPEG {bad}: cannot be decoded \\(its header is damaged: no image "
                                        "can be read from it\\); replace the file or delete it$"):
        serve(train, (15,), 24)


def test_a_file_gone_after_the_check_is_named_when_its_batch_fails(tree):
    train, _ = build_sources(config(tree, batch=15), CPU, 0, 1, None)
    gone = tree / "train" / "zebra" / "2.jpg"
    gone.unlink()
    with pytest.raises(DataError, match=f"^cannot read {gone}: it is gone since the data set was listed; restore "
                                        "it, or restart the run to list the data again$"):
        serve(train, (15,), 24)


def test_make_jpeg_tree(tmp_path):
    make_jpeg_tree([str(tmp_path / "t"), "--classes", "3", "--per-class", "2", "--val-per-class", "1",
                    "--size", "40x30", "--jobs", "2"])
    d = config(tmp_path / "t").data
    assert dataset_sizes(d) == (6, 3)
    first = Image.open(tmp_path / "t" / "train" / "class_000" / "00000.jpg")
    assert first.mode == "RGB" and 36 <= first.width <= 44 and 27 <= first.height <= 33
    train, val = build_sources(config(tmp_path / "t", batch=6), CPU, 0, 1, None)
    serve(train, (6,), 24)


@pytest.mark.parametrize("deterministic", [False, True])
def test_under_deterministic_a_resumed_run_crops_what_an_uninterrupted_one_crops(photo_tree, deterministic):
    """deterministic=true: the random-resized crops come from draws of the seed and the
    epoch, and a source that starts at epoch 2, as a resumed run's does, serves epoch 2's
    very bytes. Otherwise they are DALI's draws, from a generator a new pipeline starts
    again: the resumed epoch crops otherwise."""
    cfg = config(photo_tree, num_classes=2, batch=4, flip="none")
    torch.use_deterministic_algorithms(deterministic)  # as use_device sets it before the data is built (conftest resets it)
    went_on, _ = build_sources(cfg, CPU, 0, 1, None)
    epochs = [torch.cat([data for data, _, _ in serve(went_on, (4, 4, 4), 24, epoch=epoch)]) for epoch in range(3)]
    resumed, _ = build_sources(cfg, CPU, 0, 1, None)
    again = torch.cat([data for data, _, _ in serve(resumed, (4, 4, 4), 24, epoch=2)])
    assert torch.equal(epochs[2], again) == deterministic
    # and the crops are random: one image, cropped anew in the next epoch
    first, second = (went_on.shard.epoch(went_on.seed, e).examples.tolist() for e in (1, 2))
    assert not torch.equal(epochs[1][0], epochs[2][second.index(first[0])])


def reference_crop(h: int, w: int, u: np.ndarray, min_area: float, attempts=CROP_ATTEMPTS) -> tuple[int, ...]:
    """torchvision's RandomResizedCrop.get_params in float64, its random draws replaced by u;
    attempts=0 gives the fallback."""
    k, (lo, hi) = CROP_ATTEMPTS, ASPECT_RATIOS
    for i in range(attempts):
        area = h * w * (min_area + u[i] * (1 - min_area))
        ratio = math.exp(math.log(lo) + u[k + i] * (math.log(hi) - math.log(lo)))
        cw, ch = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            return int(u[2 * k] * (w - cw + 1)), int(u[2 * k + 1] * (h - ch + 1)), cw, ch
    cw, ch = w, h
    if w / h < lo:
        ch = int(round(w / lo))
    elif w / h > hi:
        cw = int(round(h * hi))
    return (w - cw) // 2, (h - ch) // 2, cw, ch


def test_resized_crop_windows_are_torchvisions():
    """The windows deterministic=true crops with, against torchvision's rule one image at a
    time in float64: photos' shapes, tiny images and ones too narrow or too wide for any
    window in ratio, where the whole image is cut to the nearest ratio (the fallback)."""
    from trainer.data.jpeg_folder import resized_crop_windows
    from trainer.data.source import resized_crop_draws
    shapes = [(375, 500), (500, 375), (333, 500), (1, 1), (3, 2), (40, 400), (400, 40), (224, 224)] * 8
    draws = resized_crop_draws(len(shapes), CROP_ATTEMPTS, 7, 0)
    draws[-8:, :2 * CROP_ATTEMPTS] = 0.999  # near-whole windows at ratio near 4/3: none fits the portrait photo
    anchors, sizes = resized_crop_windows([np.array((h, w, 3)) for h, w in shapes], list(draws), 0.25)
    got = [(*a, *s) for a, s in zip(np.array(anchors).astype(int).tolist(), np.array(sizes).astype(int).tolist())]
    want = [reference_crop(h, w, u.astype(np.float64), 0.25) for (h, w), u in zip(shapes, draws)]
    assert got == want
    fell_back = [win == reference_crop(h, w, u, 0.25, attempts=0) for win, (h, w), u in zip(want, shapes, draws)]
    # the too narrow and too wide images always, the portrait photo with the last draws, photos seldom
    assert all(fell_back[5::8]) and all(fell_back[6::8]) and fell_back[-7] and not any(fell_back[:-8:8])


@pytest.mark.parametrize("user_value", [None, "4"])
def test_the_trainer_asks_cuda_for_32_work_queues_unless_the_user_chose(user_value):
    """DALI's GPU decoder keeps its speed beside the step only with enough hardware queues;
    CUDA reads the setting when it starts, so importing the trainer sets it."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    if user_value:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = user_value
    code = "import os, trainer.data; print(os.environ['CUDA_DEVICE_MAX_CONNECTIONS'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == (user_value or "32"), out.stderr


def test_a_truncated_file_left_unchecked_in_the_next_epochs_first_batches_is_named_at_a_new_resolution(tree):
    """data.check_files=false: the batches fed ahead for the next epoch are collected when it
    starts at another resolution (progressive resizing), and DALI's own error came out there."""
    train, _ = build_sources(config(tree, batch=4, check_files=False), CPU, 0, 1, None)
    first, ahead = (train.shard.epoch(train.seed, epoch).examples for epoch in (0, 1))
    bad = train.files[next(i for i in ahead[:8] if i not in first[:12])]  # left out of epoch 0's three batches
    data = Path(bad).read_bytes()
    Path(bad).write_bytes(data[:len(data) // 2])
    serve(train, (4, 4, 4), 24)
    with pytest.raises(DataError, match=f"^corrupt JPEG {bad}: no JPEG end marker \\(FF D9\\): the file is truncated; "
                                        "replace the file or delete it$"):
        train.start_epoch(1, 16)


@pytest.mark.parametrize("check_files", [True, False])
def test_an_image_of_another_kind_under_a_jpeg_name_is_named_checked_or_not(tree, check_files):
    """data.check_files=false: DALI fails on a GIF that PIL decodes, and its batch was named
    (15 files) in place of the file."""
    bad = tree / "train" / "mango" / "1.jpg"
    Image.new("RGB", (40, 40), COLORS["mango"]).save(bad, format="GIF")
    said = f"^corrupt JPEG {bad}: no JPEG start marker \\(FF D8\\) or PNG signature: not a JPEG or PNG file; replace"
    with pytest.raises(DataError, match=said):
        train, _ = build_sources(config(tree, batch=15, check_files=check_files), CPU, 0, 1, None)
        serve(train, (15,), 24)
