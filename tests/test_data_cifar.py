"""CIFAR-10 resident on the device: loading, augmentation written into the arena, sharding."""
import io
import pickle
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.helpers import serve
from tests.test_data_jpeg_folder import as_a_user  # noqa: F401  (a fixture)
from trainer.config import DataConfig, TrainConfig, TrainerConfig
from trainer.data import _FULL_SIZE, build_sources, cifar
from trainer.data.cifar import CIFAR10_CLASSES, CIFAR_MEAN, CIFAR_STD
from trainer.errors import DataError

CPU = torch.device("cpu")
ARCHIVE = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpeg.tgz"
N_TRAIN, N_VAL = 40, 12


def fake_images(n: int, offset: int) -> np.ndarray:
    """Every image distinct and asymmetric: red = its index, green = column, blue = row."""
    img = np.zeros((n, 32, 32, 3), np.uint8)
    img[..., 0] = (np.arange(n) + offset)[:, None, None]
    img[..., 1] = np.arange(32)[None, None, :] * 7
    img[..., 2] = np.arange(32)[None, :, None] * 5
    return img


def write_batches(folder: Path) -> Path:
    """cifar-10-batches-py with 5 x 8 training and 12 test images, made in folder: folder."""
    root = folder / "cifar-10-batches-py"
    root.mkdir(parents=True)
    files = [(f"data_batch_{i}", fake_images(8, 8 * (i - 1))) for i in range(1, 6)]
    files.append(("test_batch", fake_images(N_VAL, 100)))
    for name, img in files:
        rows = img.transpose(0, 3, 1, 2).reshape(len(img), -1)
        labels = [int(v) % 10 for v in img[:, 0, 0, 0]]
        (root / name).write_bytes(pickle.dumps({b"data": rows, b"labels": labels}))
    return folder


@pytest.fixture(scope="module")
def batches(tmp_path_factory) -> Path:
    return write_batches(tmp_path_factory.mktemp("cifar"))


def config(root, batch=8, val_batch=0, crop_padding=4, flip="random", drop_last=True, **data):
    return TrainConfig(data=DataConfig(name="cifar10", root=str(root), train_size=N_TRAIN, val_size=N_VAL,
                                       crop_padding=crop_padding, flip=flip, **data),
                       trainer=TrainerConfig(batch_size=batch, val_batch_size=val_batch, drop_last=drop_last))


def pixels(data: torch.Tensor) -> torch.Tensor:
    """Normalized NHWC back to 0..255 values."""
    return data[..., :3].float() * torch.tensor(CIFAR_STD) * 255 + torch.tensor(CIFAR_MEAN) * 255


def epoch(source, n_batches, batch, resolution=32, channels=3, dtype=torch.float32, epoch=0, mask=False):
    return serve(source, [batch] * n_batches, resolution, channels, dtype, mask, epoch)


def test_val_is_the_images_in_order_normalized_with_their_labels(batches):
    _, val = build_sources(config(batches, val_batch=6), CPU, 0, 1, None)
    got = epoch(val, 2, 6, mask=True)
    data, labels = torch.cat([d for d, _, _ in got]), torch.cat([lab for _, lab, _ in got])
    torch.testing.assert_close(pixels(data), torch.from_numpy(fake_images(N_VAL, 100)).float(), atol=1e-3, rtol=0)
    assert labels.tolist() == [v % 10 for v in range(100, 112)]
    assert all(m.tolist() == [1] * 6 for _, _, m in got)


def test_val_shards_pad_the_last_batch_and_mask_the_padding(batches):
    seen, padding = [], 0
    for rank in range(5):  # ceil(12 / 5) = 3 per rank, batches of 2 and 1: 15 slots for 12 images
        _, val = build_sources(config(batches, val_batch=2), CPU, rank, 5, None)
        assert val.size == 3
        val.start_epoch(0, 32)
        for n in (2, 1):
            data, label, mask = torch.empty(n, 32, 32, 3), torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int8)
            val.fill(data, label, mask, None)
            index = pixels(data)[:, 0, 0, 0].round().long() - 100
            seen += index[mask == 1].tolist()
            padding += int((mask == 0).sum())
    assert sorted(seen) == list(range(12)) and padding == 3


def test_train_batches_are_padded_crops_maybe_mirrored_of_the_right_images(batches):
    train, _ = build_sources(config(batches, crop_padding=2), CPU, 0, 1, None)
    shifts = set()
    for data, label, _ in epoch(train, 5, 8):
        for image, lab in zip(pixels(data).round().to(torch.uint8).numpy(), label.tolist()):
            index = int(image[16, 16, 0])  # red is the image's index everywhere, padding included
            original = np.pad(fake_images(N_TRAIN, 0)[index], ((2, 2), (2, 2), (0, 0)), mode="reflect")
            views = {(dy, dx, f): original[dy:dy + 32, dx:dx + 32][:, ::-1 if f else 1]
                     for dy in range(5) for dx in range(5) for f in (0, 1)}
            match = [k for k, v in views.items() if np.array_equal(v, image)]
            assert match and lab == index % 10
            shifts.add(match[0])
    assert len(shifts) > 10 and {f for _, _, f in shifts} == {0, 1}  # crops and flips vary


def test_two_ranks_get_one_ranks_batches_augmentation_included(batches):
    one, _ = build_sources(config(batches, batch=8), CPU, 0, 1, None)
    halves = [build_sources(config(batches, batch=4), CPU, r, 2, None)[0] for r in range(2)]
    for (d1, l1, _), (a, la, _), (b, lb, _) in zip(epoch(one, 5, 8, epoch=1), epoch(halves[0], 5, 4, epoch=1),
                                                   epoch(halves[1], 5, 4, epoch=1)):
        torch.testing.assert_close(torch.cat([a, b]), d1, atol=0, rtol=0)
        assert torch.cat([la, lb]).tolist() == l1.tolist()


def test_epochs_are_reproducible_and_differ(batches):
    train, _ = build_sources(config(batches), CPU, 0, 1, None)
    first, again, other = (torch.cat([d for d, _, _ in epoch(train, 5, 8, epoch=e)]) for e in (3, 3, 4))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_alternating_flip_mirrors_each_image_the_other_way_next_epoch(batches):
    train, _ = build_sources(config(batches, crop_padding=0, flip="alternating"), CPU, 0, 1, None)
    plain = fake_images(N_TRAIN, 0)
    mirrored = {}
    for e in range(3):
        for data, _, _ in epoch(train, 5, 8, epoch=e):
            for image in pixels(data).round().to(torch.uint8).numpy():
                index = int(image[0, 0, 0])
                assert np.array_equal(image, plain[index]) or np.array_equal(image, plain[index][:, ::-1])
                mirrored.setdefault(index, []).append(not np.array_equal(image, plain[index]))
    assert 5 < sum(m[0] for m in mirrored.values()) < 35
    assert all(m[1] != m[0] and m[2] == m[0] for m in mirrored.values())


def test_cutout_sets_one_clipped_square_per_training_image_to_the_mean(batches):
    train, val = build_sources(config(batches, val_batch=6, crop_padding=0, flip="none", cutout=8), CPU, 0, 1, None)
    plain, sides = torch.from_numpy(fake_images(N_TRAIN, 0)).float(), set()
    for data, _, _ in epoch(train, 5, 8):
        for image in data:
            cut = (image == 0).all(-1)  # normalized 0 is the mean
            rows, cols = cut.any(1).nonzero()[:, 0], cut.any(0).nonzero()[:, 0]
            # one square of side 8 centered in the image, or what of it the edges leave
            assert len(rows) and len(cols) and cut.sum() == len(rows) * len(cols)
            assert 4 <= len(rows) <= 8 and 4 <= len(cols) <= 8
            assert rows[-1] - rows[0] + 1 == len(rows) and cols[-1] - cols[0] + 1 == len(cols)
            sides.add((len(rows), len(cols)))
            index = int(pixels(image[None])[0][~cut][0, 0].round())  # red: the image's index
            torch.testing.assert_close(pixels(image[None])[0][~cut], plain[index][~cut], atol=1e-3, rtol=0)
    assert (8, 8) in sides and len(sides) > 2  # inside the image, and clipped by its edges
    data = torch.cat([d for d, _, _ in epoch(val, 2, 6)])  # evaluation: no cutout
    torch.testing.assert_close(pixels(data), torch.from_numpy(fake_images(N_VAL, 100)).float(), atol=1e-3, rtol=0)


def test_cutout_wider_than_the_stored_images_is_a_clear_error(batches):
    with pytest.raises(DataError, match=r"data.cutout=33 is wider than the stored images \(32x32\)"):
        build_sources(config(batches, cutout=33), CPU, 0, 1, None)


def test_last_partial_batch_and_low_resolution(batches):
    train, _ = build_sources(config(batches, batch=16, drop_last=False), CPU, 0, 1, None)
    assert train.size == 40
    train.start_epoch(0, 32)
    seen = []
    for n in (16, 16, 8):  # the last batch is the 8 left over
        data, label = torch.empty(n, 32, 32, 3), torch.empty(n, dtype=torch.int32)
        train.fill(data, label, None, None)
        seen += pixels(data)[:, 16, 16, 0].round().long().tolist()
    assert sorted(seen) == list(range(40))
    # low resolution: the same crops and flips (same epoch), resized
    hi = epoch(train, 1, 16, epoch=5)[0][0]
    lo = epoch(train, 1, 16, resolution=16, epoch=5)[0][0]
    expected = F.interpolate(hi.permute(0, 3, 1, 2), size=(16, 16), mode="bilinear", antialias=True)
    torch.testing.assert_close(lo, expected.permute(0, 2, 3, 1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_data_has_a_zero_fourth_channel(batches, half):
    train, _ = build_sources(config(batches), CPU, 0, 1, half)
    data = epoch(train, 1, 8, channels=4, dtype=half)[0][0]
    reference = epoch(build_sources(config(batches), CPU, 0, 1, None)[0], 1, 8)[0][0]
    assert torch.all(data[..., 3] == 0)
    torch.testing.assert_close(data[..., :3].float(), reference, atol=0.02, rtol=0.01)


def test_fill_writes_in_place_and_leaves_the_other_buffer_alone(batches):
    train, _ = build_sources(config(batches), CPU, 0, 1, None)
    arena = torch.zeros(2 * 8 * 32 * 32 * 3)
    a, b = arena[:8 * 32 * 32 * 3].view(8, 32, 32, 3), arena[8 * 32 * 32 * 3:].view(8, 32, 32, 3)
    pointers = (a.data_ptr(), b.data_ptr())
    label = torch.empty(8, dtype=torch.int32)
    train.start_epoch(0, 32)
    train.fill(a, label, None, None)
    kept = a.clone()
    train.fill(b, label, None, None)
    assert (a.data_ptr(), b.data_ptr()) == pointers
    assert torch.equal(a, kept) and b.abs().sum() > 0 and not torch.equal(a, b)


def test_sources_run_their_kernel_in_the_arenas_layout_when_built(batches, monkeypatch):
    """Set-up compiles the fill kernel for the layout the timed fills write (fp16, 4 channels)."""
    from kernels import reference
    seen, kernel = [], reference.crop_flip_normalize_
    monkeypatch.setattr(reference, "crop_flip_normalize_",
                        lambda *a: seen.append((a[5].dtype, a[5].shape[3], a[7] is not None)) or kernel(*a))
    build_sources(config(batches, val_batch=6), CPU, 0, 1, torch.float16)
    assert seen == [(torch.float16, 4, True)] * 2  # training and evaluation


def test_peek_is_normalized_unaugmented_nchw(batches):
    train, _ = build_sources(config(batches), CPU, 0, 1, None)
    images = train.peek(6)
    assert images.shape == (6, 3, 32, 32) and images.dtype == torch.float32
    indices = [int(v) for v in pixels(images.permute(0, 2, 3, 1))[:, 0, 0, 0].round()]
    expected = torch.from_numpy(fake_images(N_TRAIN, 0)[indices]).float()
    torch.testing.assert_close(pixels(images.permute(0, 2, 3, 1)), expected, atol=1e-3, rtol=0)
    assert indices != list(range(6))  # epoch 0's shuffled order, the same on every rank


@pytest.mark.parametrize("split, size, wanted", [
    ("train", 0, "CIFAR-10's full 50000 that data.train_size=0 stands for"),  # nothing asked for: all
    ("val", 50, "the data.val_size=50 asked for"),
])
def test_too_few_images_for_the_configured_size(archive, split, size, wanted):
    cfg = config(archive)
    setattr(cfg.data, f"{split}_size", size)
    have = N_TRAIN if split == "train" else N_VAL
    with pytest.raises(DataError, match=f"{archive} holds {have} {split} images, fewer than {wanted}; "
                                        f"set data.{split}_size={have} or less$"):
        build_sources(cfg, CPU, 0, 1, None)


@pytest.mark.parametrize("split", ["train", "val"])
def test_more_images_than_cifar10s_full_split_are_refused_under_size_0(archive, monkeypatch, split):
    """data.<split>_size=0 stands for CIFAR-10's full split: a data set of 50,001 training
    and 10,001 test images trained on 50,000 and evaluated 10,000 without a word."""
    have = {"train": N_TRAIN, "val": N_VAL}
    full = {**have, split: have[split] - 1}  # CIFAR-10's split as one image fewer than the batches hold
    monkeypatch.setitem(_FULL_SIZE, "cifar10", (full["train"], full["val"]))
    cfg = config(archive)
    setattr(cfg.data, f"{split}_size", 0)
    with pytest.raises(DataError, match=f"^{archive} holds {have[split]} {split} images, 1 more than CIFAR-10's full "
                                        f"{full[split]} that data.{split}_size=0 stands for: remove the extra images, "
                                        f"give data.{split}_size={full[split]} or fewer to take a subset, or use "
                                        "data=imagefolder for a data set of another size$"):
        build_sources(cfg, CPU, 0, 1, None)


def test_a_class_count_other_than_the_batches_ten_is_refused(batches):
    with pytest.raises(DataError, match="python batches, 10 classes, but data.num_classes=100; set data.num_classes=10"):
        build_sources(config(batches, num_classes=100), CPU, 0, 1, None)


class Runs:
    """Unpickled, it would run a command: what a pickle that is not a batch may do."""
    def __reduce__(self):
        return (shutil.rmtree, ("/nonexistent",))


@pytest.mark.parametrize("damage, why", [
    ("cut short", "UnpicklingError: pickle data was truncated"),
    ("keys as str", "KeyError: b'data'"),
    ("64x64 images", r"its data is uint8 of shape \(2, 12288\), not rows of 3x32x32 bytes"),
    ("a label short", "it has 1 labels for 2 images"),
    ("label 10", "its labels run from 0 to 10, not 0 to 9"),
    ("code", "UnpicklingError: it names shutil.rmtree")])
def test_a_python_batch_that_is_not_one_is_named_with_why(batches, tmp_path, damage, why):
    """A damaged batch ended in the unpickler's or numpy's traceback; one of 64x64 images
    trained on each cut in four 32x32 ones, each with another image's label."""
    root = tmp_path / "cifar-10-batches-py"
    shutil.copytree(batches / "cifar-10-batches-py", root)
    rows, labels = np.zeros((2, 3 * 32 * 32), np.uint8), [0, 1]
    batch = {"cut short": None, "keys as str": {"data": rows, "labels": labels},
             "64x64 images": {b"data": np.zeros((2, 3 * 64 * 64), np.uint8), b"labels": labels},
             "a label short": {b"data": rows, b"labels": [0]}, "label 10": {b"data": rows, b"labels": [0, 10]},
             "code": {b"data": Runs(), b"labels": labels}}[damage]
    data = pickle.dumps(batch) if batch else (root / "data_batch_3").read_bytes()[:3000]
    (root / "data_batch_3").write_bytes(data)
    with pytest.raises(DataError, match=f"^data_batch_3 in {tmp_path} is not a CIFAR-10 python batch \\({why}\\): get "
                                        "cifar-10-batches-py again, or give the JPEG tree$"):
        build_sources(config(tmp_path), CPU, 0, 1, None)


CLASSES = list(CIFAR10_CLASSES)


def jpeg_tree(root: Path, test_classes: list[str]) -> Path:
    """train/<class>/ with 4 and test/<class>/ with 2 JPEGs per class, red 25 x the class's place in CLASSES."""
    for split, classes, per_class in (("train", CLASSES, 4), ("test", test_classes, 2)):
        for k, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for i, image in enumerate(fake_images(per_class, 25 * k)):
                Image.fromarray(image).save(root / split / name / f"{i}.jpg", quality=95)
    return root


@pytest.mark.parametrize("packed", ["tree", "archive"])
def test_test_class_folders_named_otherwise_than_trains_are_refused(tmp_path, packed):
    renamed = ["car" if c == "automobile" else c for c in CLASSES]
    roots = [jpeg_tree(tmp_path / name, classes) for name, classes in (("same", CLASSES), ("renamed", renamed))]
    if packed == "archive":
        for i, root in enumerate(roots):
            roots[i] = root.with_suffix(".tgz")
            with tarfile.open(roots[i], "w:gz") as tar:
                tar.add(root, arcname="cifar10")
    _, val = build_sources(config(roots[0], val_batch=N_VAL), CPU, 0, 1, None)
    red = pixels(epoch(val, 1, N_VAL)[0][0])[..., 0].mean((1, 2))
    assert (red / 25).round().int().tolist() == val.labels.tolist()  # each test image has its class's label
    # with test/car where train has automobile, sorted order would label car 2 and bird to frog one more
    with pytest.raises(DataError, match=r"'s test and .*'s train differ in their class folders \(automobile, car\): "
                                        r"both need the same ones, or the labels would not match$"):
        build_sources(config(roots[1]), CPU, 0, 1, None)


def test_sources_name_their_classes_as_a_checkpoint_keeps_them(tmp_path, batches):
    """Label k is the k-th class folder's name: checkpoints keep the names (trainer/loop.py),
    so that a tree renamed since is refused rather than read under other labels. An
    archive's entry in the decode cache keeps them too; the python batches' are CIFAR-10's."""
    tree = jpeg_tree(tmp_path / "tree", CLASSES)
    train, val = build_sources(config(tree), CPU, 0, 1, None)
    assert train.classes == val.classes == list(CLASSES)
    with tarfile.open(tmp_path / "tree.tgz", "w:gz") as tar:
        tar.add(tree, arcname="cifar10")
    cached = config(tmp_path / "tree.tgz", decode_cache=str(tmp_path / "cache"))
    for _ in range(2):  # decoded, then loaded from the entry
        assert build_sources(cached, CPU, 0, 1, None)[1].classes == list(CLASSES)
    assert build_sources(config(batches), CPU, 0, 1, None)[1].classes == list(CIFAR10_CLASSES)


def test_evaluation_alone_decodes_the_test_split_only(tmp_path):
    """A damaged training JPEG stood in the way of mode=eval, which decoded both splits."""
    root = jpeg_tree(tmp_path / "tree", CLASSES)
    (root / "train" / "cat" / "0.jpg").write_bytes(b"")
    with pytest.raises(DataError, match="corrupt JPEG"):
        build_sources(config(root), CPU, 0, 1, None)
    train, val = build_sources(config(root, val_batch=N_VAL), CPU, 0, 1, None, read_train=False)
    red = pixels(epoch(val, 1, N_VAL)[0][0])[..., 0].mean((1, 2))
    assert train is None and (red / 25).round().int().tolist() == val.labels.tolist()
    # the training split's folder names still check the labels; without it, the test split's own
    (root / "train" / "cat").rename(root / "train" / "kitten")
    with pytest.raises(DataError, match=r"differ in their class folders \(cat, kitten\)"):
        build_sources(config(root), CPU, 0, 1, None, read_train=False)
    shutil.rmtree(root / "train")
    assert torch.equal(build_sources(config(root), CPU, 0, 1, None, read_train=False)[1].labels, val.labels)


def test_evaluation_alone_takes_the_test_split_from_the_entry_training_kept(archive, tmp_path, caplog):
    """Its entry was named by the test split alone: evaluation decoded the archive again
    beside training's entry, and kept one more entry for each data.val_size."""
    cfg = config(archive, decode_cache=str(tmp_path / "cache"))
    trained = build_sources(cfg, CPU, 0, 1, None)[1]
    with caplog.at_level("INFO"):
        _, val = build_sources(cfg, CPU, 0, 1, None, read_train=False)
    assert "decoded images from" in caplog.text and len(list((tmp_path / "cache").iterdir())) == 1
    assert torch.equal(val.images, trained.images) and torch.equal(val.labels, trained.labels)
    # without an entry, the test split alone is decoded, and no entry is kept of it
    shutil.rmtree(tmp_path / "cache")
    _, val = build_sources(cfg, CPU, 0, 1, None, read_train=False)
    assert torch.equal(val.images, trained.images) and not (tmp_path / "cache").exists()


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux's /proc/self/mem")
def test_a_jpeg_that_cannot_be_read_is_named_with_the_reason(tmp_path):
    root = jpeg_tree(tmp_path / "tree", CLASSES)
    bad = root / "train" / "cat" / "bad.jpg"
    bad.symlink_to("/proc/self/mem")  # its first page is unmapped: reading it fails with EIO, as a failing disk's
    cfg = config(root)
    cfg.data.train_size = N_TRAIN + 1  # every file, the bad one too
    with pytest.raises(DataError, match=f"^cannot read {bad} \\(Input/output error\\): check the file"):
        build_sources(cfg, CPU, 0, 1, None)


@pytest.mark.parametrize("folder, named", [("test/cat", "test/cat"), (".", "data_batch_1")])
def test_a_folder_that_cannot_be_read_is_named(tmp_path, as_a_user, folder, named):
    """It ended in PermissionError's traceback. data.root itself: the python batches are looked for first."""
    root = jpeg_tree(tmp_path / "tree", CLASSES)
    (root / folder).chmod(0o000)
    with pytest.raises(DataError, match=f"^cannot read {root / named} \\(Permission denied\\): check its permissions "
                                        "and those of the folders that hold it$"):
        build_sources(config(root), CPU, 0, 1, None)


def test_every_corrupt_jpeg_of_both_splits_is_named_in_one_message(tmp_path):
    """The training split's were named, and the test split's only once they were mended, as
    a JPEG folder's are all at once."""
    root = jpeg_tree(tmp_path / "tree", CLASSES)
    bad = [root / "train" / "cat" / "1.jpg", root / "test" / "dog" / "0.jpg", root / "test" / "frog" / "1.jpg"]
    for path in bad:
        path.write_bytes(b"")
    cfg = config(root)
    cfg.data.val_size = 2 * len(CLASSES)  # every test image
    shown = "; ".join(f"{path}: empty file \\(0 bytes\\)" for path in bad)
    with pytest.raises(DataError, match=f"^3 corrupt JPEGs: {shown}; replace the files or delete them$"):
        build_sources(cfg, CPU, 0, 1, None)


@pytest.mark.parametrize("packed, sizes", [("tree", [(40, 30)] * 2), ("archive", [(40, 30)] * 2),
                                           ("tree", [(32, 32), (40, 30)])], ids=["tree", "archive", "mixed"])
def test_images_other_than_32x32_are_refused(tmp_path, packed, sizes):
    """They were stretched to 32x32 in training, and the decode cache, which keeps 32x32
    images, missed in every run; among 32x32 ones, DALI's message on images of different
    sizes came first, and named neither the one at fault nor the size asked for."""
    root = tmp_path / "tree"
    for split, per_class in (("train", 2), ("test", 1)):
        for name in ("cat", "dog"):
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", sizes[i], (100, 50 * i, 0)).save(root / split / name / f"{i}.jpg")
    if packed == "archive":
        with tarfile.open(tmp_path / "tree.tgz", "w:gz") as tar:
            tar.add(root, arcname="cifar10")
        root = tmp_path / "tree.tgz"
    cfg = TrainConfig(data=DataConfig(name="cifar10", root=str(root), num_classes=2, train_size=4, val_size=2,
                                      decode_cache=str(tmp_path / "cache")), trainer=TrainerConfig(batch_size=2))
    first = sizes.index((40, 30))
    with pytest.raises(DataError, match=rf"train/(cat|dog)/{first}.jpg is 40x30 pixels, but data=cifar10 reads CIFAR-10's "
                                        r"32x32 images: use data=imagefolder for images of other sizes$"):
        build_sources(cfg, CPU, 0, 1, None)


@pytest.mark.skipif(not ARCHIVE.exists(), reason=f"{ARCHIVE} is absent (the shared CIFAR-10 JPEG archive)")
def test_the_cifar10_jpeg_archive():
    cfg = TrainConfig(data=DataConfig(name="cifar10", root=str(ARCHIVE), train_size=1000, val_size=500),
                      trainer=TrainerConfig(batch_size=500))
    train, val = build_sources(cfg, CPU, 0, 1, None)
    assert train.images.shape == (1000, 32, 32, 3) and val.images.shape == (500, 32, 32, 3)
    counts = torch.bincount(train.labels.long(), minlength=10)
    assert counts.min() > 60  # a random subset keeps every class
    data, label, _ = epoch(val, 1, 500)[0]
    assert abs(data.mean()) < 0.15 and 0.85 < data.std() < 1.15  # CIFAR's statistics fit these files
    # labels follow the sorted folder names: airplanes are mostly blue sky, frogs green-brown
    blue_minus_red = (data[..., 2] - data[..., 0]).mean((1, 2))
    assert blue_minus_red[label == 0].mean() > blue_minus_red[label == 6].mean() + 0.2


@pytest.fixture
def archive(batches, tmp_path) -> Path:
    path = tmp_path / "cifar-10-python.tgz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(batches / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    return path


def images_and_labels(cfg) -> list[torch.Tensor]:
    train, val = build_sources(cfg, CPU, 0, 1, None)
    return [train.images, train.labels, val.images, val.labels]


def test_an_archive_decodes_once_and_later_runs_load_what_it_decoded_to(archive, tmp_path, monkeypatch):
    cfg = config(archive, decode_cache=str(tmp_path / "cache"))
    first = images_and_labels(cfg)
    assert len(list((tmp_path / "cache").iterdir())) == 1
    monkeypatch.setattr(cifar, "decode", lambda *a: pytest.fail("decoded again despite the cache"))
    for a, b in zip(first, images_and_labels(cfg)):
        assert torch.equal(a, b)
    cfg.data.val_size = N_VAL - 2  # another subset is another entry, not the same one cut short
    with pytest.raises(pytest.fail.Exception, match="decoded again"):
        images_and_labels(cfg)


def test_a_changed_archive_misses_the_cache(archive, tmp_path, batches):
    cfg = config(archive, decode_cache=str(tmp_path / "cache"))
    before = images_and_labels(cfg)
    with tarfile.open(archive, "w:gz") as tar:  # the same names, other pixels in the training batches
        for name in sorted((batches / "cifar-10-batches-py").iterdir()):
            batch = pickle.loads(name.read_bytes(), encoding="bytes")
            if name.name.startswith("data"):
                batch[b"data"] = 255 - batch[b"data"]
            data = pickle.dumps(batch)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name.name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    after = images_and_labels(cfg)
    assert torch.equal(after[0], 255 - before[0]) and torch.equal(after[2], before[2])
    assert len(list((tmp_path / "cache").iterdir())) == 2


@pytest.mark.parametrize("damage", ["cut short", "one byte flipped"])
def test_an_unreadable_cache_entry_is_decoded_again_and_rewritten(archive, tmp_path, caplog, damage):
    cfg = config(archive, decode_cache=str(tmp_path / "cache"))
    first = images_and_labels(cfg)
    (entry,) = (tmp_path / "cache").iterdir()
    data = bytearray(entry.read_bytes())
    if damage == "cut short":  # as by a full disk
        data = data[:1000]
    else:  # in the middle of the training pixels: the zip's CRC tells
        data[len(data) // 3] ^= 0xFF
    entry.write_bytes(bytes(data))
    for a, b in zip(first, images_and_labels(cfg)):
        assert torch.equal(a, b)
    assert "cannot be read" in caplog.text
    assert cifar.decoded_cache.load(entry, {"train_labels": (N_TRAIN,)}) is not None  # whole again


@pytest.mark.parametrize("below", ["", "cache"])
def test_a_cache_that_cannot_be_written_only_warns(archive, tmp_path, caplog, below):
    """A file given as the folder, or above it, is named as such: the file itself was told
    "cannot write FILE/decoded-....npz (File exists)"."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    first = images_and_labels(config(archive, decode_cache=str(blocker / below)))
    assert f"cannot keep the decoded images: {blocker} is a file, not a folder; the next run decodes" in caplog.text
    assert torch.equal(first[0], images_and_labels(config(archive))[0])
