"""The input pipelines on a GPU (run on the GPU machine: pytest -m gpu). Skipped without CUDA.

Every batch is filled on a side stream, as the double buffer does, with torch's sync
debug mode raising on any host synchronization, and compared with the CPU pipelines'.
"""
import pytest
import torch

from tests.test_data_cifar import batches, config as cifar_config  # noqa: F401  (batches: a fixture)
from tests.test_data_jpeg_folder import LABEL_OF_COLOR, colors_of, config as folder_config, photo_tree, tree  # noqa: F401
from tests.test_data_synthetic import config as synthetic_config
from trainer.data import build_sources
from trainer.errors import DataError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
HALVES = [None, torch.float16, torch.bfloat16]


def run_epoch(source, sizes, resolution, half, device, epoch=0):
    """Fill every batch of an epoch; on CUDA on a side stream, the host never waiting."""
    channels, dtype = (3, torch.float32) if half is None else (4, half)
    stream = torch.cuda.Stream() if device.type == "cuda" else None
    source.start_epoch(epoch, resolution)
    out = []
    for n in sizes:
        data = torch.empty(n, resolution, resolution, channels, dtype=dtype, device=device)
        label = torch.empty(n, dtype=torch.int32, device=device)
        mask = torch.empty(n, dtype=torch.int8, device=device)
        pointer = data.data_ptr()
        if stream is None:
            source.fill(data, label, mask, None)
        else:
            stream.wait_stream(torch.cuda.current_stream())  # the buffers' allocation
            with torch.cuda.stream(stream):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    source.fill(data, label, mask, stream)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.current_stream().wait_stream(stream)
        assert data.data_ptr() == pointer
        out.append((data, label, mask))
    return [(d.float().cpu(), lab.cpu(), m.cpu()) for d, lab, m in out]


def assert_same(gpu, cpu, atol):
    for (d, lab, m), (dc, labc, mc) in zip(gpu, cpu):
        torch.testing.assert_close(d, dc, atol=atol, rtol=0)
        assert torch.equal(lab, labc) and torch.equal(m, mc)


@pytest.mark.parametrize("half", HALVES)
def test_cifar_resident_on_the_gpu_matches_the_cpu(batches, half):
    cfg = cifar_config(batches, batch=16, val_batch=6, drop_last=False)
    (gpu_train, gpu_val), (cpu_train, cpu_val) = (build_sources(cfg, dev, 0, 1, half) for dev in (CUDA, CPU))
    tol = 1e-5 if half is None else 0.02
    assert_same(run_epoch(gpu_train, (16, 16, 8), 32, half, CUDA, 1), run_epoch(cpu_train, (16, 16, 8), 32, half, CPU, 1), tol)
    assert_same(run_epoch(gpu_train, (16, 16, 8), 16, half, CUDA, 2), run_epoch(cpu_train, (16, 16, 8), 16, half, CPU, 2), 1e-3 + tol)
    assert_same(run_epoch(gpu_val, (6, 6), 32, half, CUDA), run_epoch(cpu_val, (6, 6), 32, half, CPU), tol)
    torch.testing.assert_close(gpu_train.peek(8).cpu(), cpu_train.peek(8), atol=1e-5, rtol=0)


@pytest.mark.parametrize("half", HALVES)
def test_synthetic_through_dali_on_the_gpu_matches_the_cpu(half):
    cfg = synthetic_config(train_size=256, val_size=100, batch=32, val_batch=32)
    (gpu_train, gpu_val), (cpu_train, cpu_val) = (build_sources(cfg, dev, 0, 1, half) for dev in (CUDA, CPU))
    tol = 1e-3 if half is None else 0.02
    assert_same(run_epoch(gpu_train, [32] * 8, 16, half, CUDA, 1), run_epoch(cpu_train, [32] * 8, 16, half, CPU, 1), tol)
    assert_same(run_epoch(gpu_val, (32, 32, 32, 4), 16, half, CUDA), run_epoch(cpu_val, (32, 32, 32, 4), 16, half, CPU), tol)
    low = run_epoch(gpu_train, [32] * 8, 8, half, CUDA, 2)  # progressive resizing: a second pipeline
    assert all(d.shape[1:3] == (8, 8) and d.abs().sum() > 0 for d, _, _ in low)
    torch.testing.assert_close(gpu_train.peek(16).cpu(), cpu_train.peek(16), atol=1e-3, rtol=0)


@pytest.mark.parametrize("host_decode, parts", [(0.0, 1), (0.5, 2), (1.0, 1)])
@pytest.mark.parametrize("half", HALVES)
def test_jpeg_folders_decoded_on_the_gpu_keep_their_labels(tree, half, host_decode, parts):
    # batches of 7, 7 and 1: split between the host's and the GPU's decoders, the last made by both;
    # epoch 2 fed while epoch 1 is served, at its resolution
    train, val = build_sources(folder_config(tree, batch=7, val_batch=4, drop_last=False, host_decode=host_decode),
                               CUDA, 0, 1, half)
    assert train.parts == parts
    for source, sizes, resolution, epoch in ((train, (7, 7, 1), 16, 0), (train, (7, 7, 1), 24, 1),
                                             (train, (7, 7, 1), 24, 2), (val, (4, 2), 24, 0)):
        for data, label, mask in run_epoch(source, sizes, resolution, half, CUDA, epoch):
            assert [LABEL_OF_COLOR[c] for c in colors_of(data)] == label.tolist()
            assert half is None or torch.all(data[..., 3] == 0)
    assert train.peek(5).device.type == "cuda"


def test_a_file_the_gpu_decoder_cannot_decode_is_named(tree):
    bad = tree / "train" / "mango" / "1.jpg"
    bad.write_bytes(b"\xff\xd8" + bytes(range(256)) * 4 + b"\xff\xd9")
    train, _ = build_sources(folder_config(tree, batch=15, host_decode=0.0), CUDA, 0, 1, None)
    with pytest.raises(DataError, match=f"corrupt JPEG {bad}"):
        run_epoch(train, (15,), 24, None, CUDA)


@pytest.mark.parametrize("host_decode", [0.0, 0.5])
def test_under_deterministic_the_gpu_decoder_crops_a_resumed_epoch_as_the_uninterrupted_run(photo_tree, host_decode):
    """deterministic=true: the crop windows drawn on the host from the seed and the epoch,
    cut by the GPU's decoder (or the host's, for a share), in a pipeline that starts again
    at epoch 2 as a resumed run's does."""
    cfg = folder_config(photo_tree, num_classes=2, batch=4, host_decode=host_decode, flip="none")
    torch.use_deterministic_algorithms(True)  # as use_device sets it before the data is built (conftest resets it)
    went_on, _ = build_sources(cfg, CUDA, 0, 1, torch.float16)
    epochs = [run_epoch(went_on, (4, 4, 4), 24, torch.float16, CUDA, epoch) for epoch in range(3)]
    resumed, _ = build_sources(cfg, CUDA, 0, 1, torch.float16)
    assert_same(run_epoch(resumed, (4, 4, 4), 24, torch.float16, CUDA, 2), epochs[2], atol=0)
