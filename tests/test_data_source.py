"""The order of examples: sharding, reproducible shuffles, val padding, flips."""
import numpy as np
import pytest

from trainer.config import DataConfig
from trainer.data import dataset_sizes
from trainer.data.source import Shard, crop_offsets, cutout_corners, flips, subset
from trainer.errors import ConfigError


def rank_batches(total, batch, world, epoch, train=True, drop_last=True, seed=3):
    """Per rank, the list of (examples, real) batches of one epoch."""
    out = []
    for rank in range(world):
        shard = Shard(total, batch, rank, world, train, drop_last)
        plan = shard.epoch(seed, epoch)
        out.append([(plan.examples[plan.span(k)], plan.real[plan.span(k)]) for k in range(len(plan))])
    return out


def test_two_ranks_see_the_examples_of_one_rank_per_global_batch():
    one = rank_batches(100, 8, 1, epoch=2)[0]
    two = rank_batches(100, 4, 2, epoch=2)
    assert len(one) == len(two[0]) == len(two[1]) == 100 // 8
    for k, (examples, _) in enumerate(one):
        # rank-major: rank 0's batch k, then rank 1's batch k
        np.testing.assert_array_equal(np.concatenate([two[0][k][0], two[1][k][0]]), examples)


def test_train_order_is_a_reproducible_permutation_that_changes_per_epoch():
    shard = Shard(50, 10, 0, 1, train=True)
    e0, again, e1 = shard.epoch(7, 0).examples, shard.epoch(7, 0).examples, shard.epoch(7, 1).examples
    np.testing.assert_array_equal(e0, again)
    assert sorted(e0) == list(range(50)) and not np.array_equal(e0, e1)
    assert not np.array_equal(e0, Shard(50, 10, 0, 1, train=True).epoch(8, 0).examples)  # the seed matters


def test_every_rank_takes_the_same_number_of_steps_and_drop_last():
    kept = Shard(101, 8, 1, 3, train=True, drop_last=False)
    assert kept.size == 33 and kept.batches == [8, 8, 8, 8, 1]
    assert Shard(101, 8, 1, 3, train=True, drop_last=True).batches == [8, 8, 8, 8]
    ranks = rank_batches(101, 8, 3, epoch=0, drop_last=False)
    seen = np.concatenate([b for r in ranks for b, _ in r])
    assert len(seen) == len(set(seen)) == 99  # 101 // 3 * 3 distinct examples, none twice


def test_val_pads_the_last_batch_with_repeats_and_masks_them():
    ranks = rank_batches(10, 2, 4, epoch=0, train=False)  # ceil(10 / 4) = 3 per rank: 12 slots
    assert [[len(b) for b, _ in r] for r in ranks] == [[2, 1]] * 4
    real = np.concatenate([b[m] for r in ranks for b, m in r])
    padding = np.concatenate([b[~m] for r in ranks for b, m in r])
    assert sorted(real) == list(range(10))  # each real example exactly once
    assert len(padding) == 2 and set(padding) <= set(range(10))
    later = rank_batches(10, 2, 4, epoch=5, train=False)  # val's order is the same every epoch
    assert all(np.array_equal(a, b) for ra, rb in zip(ranks, later) for (a, _), (b, _) in zip(ra, rb))


def test_a_batch_of_the_wrong_size_or_past_the_end_is_refused():
    plan = Shard(10, 4, 0, 1, train=True, drop_last=False).epoch(0, 0)
    with pytest.raises(RuntimeError, match="has 4 examples"):
        plan.take(3)
    plan.take(4), plan.take(4), plan.take(2)
    with pytest.raises(RuntimeError, match="past the end"):
        plan.take(2)


def test_alternating_flips_mirror_exactly_the_images_not_mirrored_the_epoch_before():
    e0, e1, e2 = (flips("alternating", 1000, 5, e) for e in range(3))
    assert 400 < e0.sum() < 600
    np.testing.assert_array_equal(e1, ~e0)
    np.testing.assert_array_equal(e2, e0)
    r0, r1 = flips("random", 1000, 5, 0), flips("random", 1000, 5, 1)
    assert 400 < r0.sum() < 600 and 0.3 < (r0 == r1).mean() < 0.7  # independent per epoch
    assert not flips("none", 1000, 5, 0).any()


def test_crop_offsets_cover_the_padding_range():
    corners = crop_offsets(2000, 2, 0, 0)
    assert corners.shape == (2000, 2) and set(corners.ravel()) == {0, 1, 2, 3, 4}


def test_cutout_squares_are_centered_anywhere_in_the_image():
    corners = cutout_corners(5000, 8, 32, 24, 0, 0)
    centers = corners + 4
    assert centers[:, 0].min() == 0 and centers[:, 0].max() == 31
    assert centers[:, 1].min() == 0 and centers[:, 1].max() == 23
    assert not np.array_equal(corners, cutout_corners(5000, 8, 32, 24, 0, 1))  # drawn anew each epoch


def test_a_capped_split_is_a_fixed_random_subset():
    keep = subset(1000, 100, 0)
    np.testing.assert_array_equal(keep, subset(1000, 100, 0))
    assert len(set(keep)) == 100 and keep.max() > 900  # not just the first (one class of a sorted list)
    np.testing.assert_array_equal(subset(10, 20, 0), np.arange(10))


def test_dataset_sizes():
    assert dataset_sizes(DataConfig(name="synthetic", train_size=300, val_size=0)) == (300, 1024)
    assert dataset_sizes(DataConfig(name="cifar10", train_size=1000)) == (1000, 10000)
    with pytest.raises(ConfigError, match="^data.train_size=60000: cifar10 has 50000 train images; give at most"):
        dataset_sizes(DataConfig(name="cifar10", train_size=60000))  # it trained on 50000, saying nothing


def test_without_data_root_sizes_are_planned_without_reading_files(tmp_path, monkeypatch):
    """mode=plan runs without data.root: CIFAR-10's sizes are known, a JPEG folder's are
    the ones given; nothing is read from the working directory (data.root='' is not '.')."""
    monkeypatch.chdir(tmp_path)  # an empty folder: nothing to count if '' were read as '.'
    assert dataset_sizes(DataConfig(name="cifar10")) == (50000, 10000)
    assert dataset_sizes(DataConfig(name="imagefolder", train_size=1281167, val_size=50000)) == (1281167, 50000)
    for sizes in ({}, {"train_size": 1000}):
        with pytest.raises(ConfigError, match="^data=imagefolder without data.root has no image count to plan for: "
                                              "give data.root=PATH, or data.train_size and data.val_size$"):
            dataset_sizes(DataConfig(name="imagefolder", **sizes))


@pytest.mark.parametrize("padding, refused", [(31, False), (32, True), (40, True)])
def test_a_crop_padding_as_wide_as_the_stored_images_is_refused(padding, refused):
    """Training crops reflect their padding once, which reaches at most a side less one: at 40
    on 32x32 images the indices went past the reflection (wrong pixels on the CPU, reads
    outside the images on a GPU) without a word."""
    import torch

    from trainer.data.resident import ResidentSource
    from trainer.errors import DataError
    images, labels = torch.zeros((8, 32, 32, 3), dtype=torch.uint8), torch.zeros(8, dtype=torch.int32)

    def source(augment):
        return ResidentSource(images, labels, Shard(8, 4, 0, 1, augment, True), 10, [0.5] * 3, [0.25] * 3,
                              DataConfig(name="cifar10", crop_padding=padding), 0, augment, None)
    source(augment=False)  # evaluation does not crop
    if refused:
        with pytest.raises(DataError, match=rf"data.crop_padding={padding} is not smaller than the images "
                                            r"\(32x32\), which training crops pad by reflecting them; set data.crop_padding to at most 31"):
            source(augment=True)
    else:
        source(augment=True)
