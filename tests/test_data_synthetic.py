"""The embedded synthetic data set through its DALI pipeline, and that it can be learned."""
import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import serve
from trainer.config import DataConfig, TrainConfig, TrainerConfig
from trainer.errors import DataError
from trainer.data import build_sources
from trainer.data.dali import IN_FLIGHT
from trainer.data import gratings, synthetic
from trainer.data.synthetic import channel_stats, generate
from trainer.models import FastNet

CPU = torch.device("cpu")


def config(train_size=256, val_size=100, batch=32, val_batch=0, drop_last=True, crop_padding=2, seed=0):
    return TrainConfig(data=DataConfig(name="synthetic", resolution=16, train_size=train_size, val_size=val_size,
                                       crop_padding=crop_padding),
                       trainer=TrainerConfig(batch_size=batch, val_batch_size=val_batch, drop_last=drop_last,
                                             seed=seed))


def denormalize(source, data: torch.Tensor) -> torch.Tensor:
    return data[..., :3].float() * torch.tensor(source.std) + torch.tensor(source.mean)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_data_set_is_the_same_made_in_chunks_or_at_once_on_any_threads(threads, monkeypatch):
    """Large images are made a chunk of images at a time, chunks on threads; each image's
    noise is its own stream."""
    at_once, labels = generate(50, 0, 48)  # 227 images of 48x48 a chunk: 50 in one
    monkeypatch.setattr(gratings, "_CHUNK_PIXELS", 10 * 48 * 48)  # five chunks
    assert np.array_equal(generate(50, 0, 48, threads)[0], at_once)
    monkeypatch.setattr(gratings, "_CHUNK_PIXELS", 1)  # one image a chunk
    chunked, chunked_labels = generate(50, 0, 48, threads)
    assert np.array_equal(chunked, at_once) and np.array_equal(chunked_labels, labels)


def test_a_data_set_larger_than_the_hosts_free_memory_is_refused_before_it_is_made(monkeypatch):
    """data.resolution=3000 asked numpy for 103 GiB, which it refused with a traceback (or,
    on a host that overcommits, the kernel would have killed the run)."""
    monkeypatch.setattr(synthetic, "host_memory_available", lambda: 356 * 16 * 16 * 3 - 1)
    with pytest.raises(DataError, match=r"^the synthetic data set of 356 images at data.resolution=16 takes 0.0 GiB of "
                                        r"host memory, and 0.0 GiB is free: lower data.resolution, data.train_size"):
        build_sources(config(), CPU, 0, 1, None)
    monkeypatch.setattr(synthetic, "host_memory_available", lambda: 356 * 16 * 16 * 3)
    assert build_sources(config(), CPU, 0, 1, None)[0].images.shape == (256, 16, 16, 3)


def test_a_crop_padding_as_wide_as_the_images_is_refused():
    """data.crop_padding=1000 on 16x16 images trained on crops of the pad's color to a NaN loss,
    whose message blamed the learning rate."""
    with pytest.raises(DataError, match=r"^data.crop_padding=16 is not smaller than the images \(16x16\), which "
                                        r"training crops pad with the mean color; set data.crop_padding to at most 15$"):
        build_sources(config(crop_padding=16), CPU, 0, 1, None)
    build_sources(config(crop_padding=15), CPU, 0, 1, None)


def test_channel_statistics_are_the_pixels_mean_and_deviation():
    images, _ = generate(64, 0, 16)
    mean, std = channel_stats(images)
    pixels = images.reshape(-1, 3) / 255
    np.testing.assert_allclose(mean, pixels.mean(0), rtol=1e-12)
    np.testing.assert_allclose(std, pixels.std(0), rtol=1e-12)


def test_val_batches_arrive_in_order_complete_and_in_place_with_a_slow_consumer():
    _, val = build_sources(config(val_size=100, val_batch=32), CPU, 0, 1, None)
    arena = torch.zeros(2, 32, 16, 16, 3)  # I_A and I_B
    labels, masks = torch.zeros(2, 32, dtype=torch.int32), torch.zeros(2, 32, dtype=torch.int8)
    pointers = [arena[i].data_ptr() for i in range(2)]
    images, expected_labels = generate(100, 1, 16)
    val.start_epoch(0, 16)
    got, got_labels = [], []
    for k, n in enumerate((32, 32, 32, 4)):
        buf = k % 2
        data, label, mask = arena[buf, :n], labels[buf, :n], masks[buf, :n]
        val.fill(data, label, mask, None)
        time.sleep(0.05)  # the consumer is slow: DALI's work ahead must not disturb this batch
        assert data.data_ptr() == pointers[buf]
        got.append(denormalize(val, data).clone())
        got_labels += label.tolist()
        assert mask.tolist() == [1] * n
        if k:  # filling this buffer left the other one, still in use, alone
            assert torch.equal(denormalize(val, arena[1 - buf, :len(got[-2])]), got[-2])
    torch.testing.assert_close(torch.cat(got), torch.from_numpy(images).float(), atol=1e-3, rtol=0)
    assert got_labels == expected_labels.tolist()


def test_training_images_are_normalized_padded_crops_of_the_data():
    train, _ = build_sources(config(), CPU, 0, 1, None)
    peek = train.peek(256)
    assert peek.shape == (256, 3, 16, 16)
    assert peek.mean((0, 2, 3)).abs().max() < 0.02 and (peek.std((0, 2, 3)) - 1).abs().max() < 0.02
    images, _ = generate(256, 0, 16)
    padded = np.pad(images.astype(float), ((0, 0), (2, 2), (2, 2), (0, 0)))
    padded[:, :2], padded[:, -2:], padded[:, :, :2], padded[:, :, -2:] = (np.array(train.mean),) * 4
    train.start_epoch(0, 16)
    data, label = torch.empty(32, 16, 16, 3), torch.empty(32, dtype=torch.int32)
    train.fill(data, label, None, None)
    views = set()
    for image, lab in zip(denormalize(train, data).numpy(), label.tolist()):
        candidates = [(i, dy, dx, f) for i in range(lab, 256, 10) for dy in range(5) for dx in range(5)
                      for f in (0, 1)
                      if np.abs(padded[i, dy:dy + 16, dx:dx + 16][:, ::-1 if f else 1] - image).max() < 1]
        assert candidates  # a crop of an image of its label, maybe mirrored, the pad the mean color
        views.add(candidates[0][1:])
    assert len(views) > 5


def test_two_ranks_get_one_ranks_batches():
    one, _ = build_sources(config(batch=32), CPU, 0, 1, None)
    halves = [build_sources(config(batch=16), CPU, r, 2, None)[0] for r in range(2)]
    for s in (one, *halves):
        s.start_epoch(3, 16)
    for _ in range(8):
        whole, parts = torch.empty(32, 16, 16, 3), torch.empty(32, 16, 16, 3)
        labels, part_labels = torch.empty(32, dtype=torch.int32), torch.empty(32, dtype=torch.int32)
        one.fill(whole, labels, None, None)
        halves[0].fill(parts[:16], part_labels[:16], None, None)
        halves[1].fill(parts[16:], part_labels[16:], None, None)
        assert torch.equal(whole, parts) and torch.equal(labels, part_labels)


def test_unfinished_epoch_last_partial_batch_and_low_resolution():
    train, _ = build_sources(config(train_size=100, batch=32, drop_last=False), CPU, 0, 1, None)
    train.start_epoch(0, 16)
    train.fill(torch.empty(32, 16, 16, 3), torch.empty(32, dtype=torch.int32), None, None)
    # a fractional epoch stops early; the next starts clean, at low resolution
    low = serve(train, (32, 32, 32, 4), 8, epoch=1)
    labels = [lab for _, label, _ in low for lab in label.tolist()]
    assert np.bincount(labels).tolist() == [10] * 10  # each of the 100 examples once
    # the same crops and flips (same epoch) at full resolution, resized: antialiased bilinear, whose taps
    # past an edge DALI's resize reads as the edge's pixel; at half size they reach 2 past it, so the crop
    # edged by 2 of its edge's pixels, halved, less its new border, is the same 8x8 (where torch's own
    # border would weigh the taps inside the image alone)
    full = torch.cat([data for data, _, _ in serve(train, (32, 32, 32, 4), 16, epoch=1)]).permute(0, 3, 1, 2)
    edged = F.pad(full, (2, 2, 2, 2), mode="replicate")
    expected = F.interpolate(edged, size=(10, 10), mode="bilinear", antialias=True)[..., 1:-1, 1:-1]
    # within the rounding of DALI's uint8 result, in levels of 0..255
    torch.testing.assert_close(denormalize(train, torch.cat([data for data, _, _ in low])),
                               denormalize(train, expected.permute(0, 2, 3, 1)), atol=0.51, rtol=0)


def test_epochs_shorter_than_the_prefetch_depth():
    # DALI's first run starts IN_FLIGHT iterations at once: a 2-batch epoch must not wait for a third
    assert IN_FLIGHT > 2
    train, _ = build_sources(config(train_size=40, batch=32, drop_last=False), CPU, 0, 1, None)
    for epoch in range(3):
        labels = [lab for _, label, _ in serve(train, (32, 8), 16, epoch=epoch) for lab in label.tolist()]
        assert np.bincount(labels).tolist() == [4] * 10


def test_the_next_epochs_first_batches_are_fed_ahead_and_served_as_a_fresh_start_would():
    """At an epoch's end its successor's first batches are already with DALI, so the run
    does not wait at each epoch's start; they are the batches the next epoch would make anyway."""
    cfg, sizes = config(train_size=160, batch=32), (32,) * 5
    train, _ = build_sources(cfg, CPU, 0, 1, None)
    serve(train, sizes, 16, epoch=0)
    assert (train._next.epoch, train._next.scheduled) == (1, IN_FLIGHT)
    ahead = serve(train, sizes, 16, epoch=1)
    fresh = serve(build_sources(cfg, CPU, 0, 1, None)[0], sizes, 16, epoch=1)
    for (data, label, _), (data_fresh, label_fresh, _) in zip(ahead, fresh):
        assert torch.equal(label, label_fresh) and torch.equal(data, data_fresh)
    # fed ahead at 16 pixels, the next epoch asks for 8: those batches are dropped, none served
    labels = [lab for _, label, _ in serve(train, sizes, 8, epoch=2) for lab in label.tolist()]
    assert np.bincount(labels).tolist() == [16] * 10


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_data_has_a_zero_fourth_channel(half):
    _, val = build_sources(config(), CPU, 0, 1, half)
    _, reference = build_sources(config(), CPU, 0, 1, None)
    data, ref = torch.full((32, 16, 16, 4), 7.0, dtype=half), torch.empty(32, 16, 16, 3)
    for source, target in ((val, data), (reference, ref)):
        source.start_epoch(0, 16)
        source.fill(target, torch.empty(32, dtype=torch.int32), torch.empty(32, dtype=torch.int8), None)
    assert torch.all(data[..., 3] == 0)
    torch.testing.assert_close(data[..., :3].float(), ref, atol=0.02, rtol=0.01)


def test_the_default_run_learns_it_and_one_step_does_not():
    """fastnet_tiny, nesterov lr 0.1, batch 64, 4 epochs, cosine: the default run, as a plain loop."""
    torch.manual_seed(0)
    cfg = config(train_size=4096, val_size=1024, batch=64, val_batch=256)
    train, val = build_sources(cfg, CPU, 0, 1, None)
    model = FastNet(widths=(16, 32, 64)).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    steps = 4 * train.size // 64
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))

    def accuracy() -> float:
        model.eval()
        val.start_epoch(0, 16)
        correct = 0
        x, y, m = torch.empty(256, 16, 16, 3), torch.empty(256, dtype=torch.int32), torch.empty(256, dtype=torch.int8)
        with torch.no_grad():
            for _ in range(4):
                val.fill(x, y, m, None)
                correct += int(((model(x.permute(0, 3, 1, 2)).argmax(1) == y) & (m == 1)).sum())
        model.train()
        return correct / 1024

    x, y = torch.empty(64, 16, 16, 3), torch.empty(64, dtype=torch.int32)
    for epoch in range(4):
        train.start_epoch(epoch, 16)
        for step in range(train.size // 64):
            train.fill(x, y, None, None)
            loss = torch.nn.functional.cross_entropy(model(x.permute(0, 3, 1, 2)), y.long())
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
            if epoch == step == 0:
                assert accuracy() < 0.5
    assert accuracy() >= 0.9
