"""GPU behaviour of the whole step (run on the GPU machine: pytest -m gpu). Skipped without CUDA."""
import re
import pytest
import torch
from tests.helpers import assert_same_state, persistent_state, profile_share, table_rows
from trainer.config import compose_config
from trainer.dist import Dist
from trainer.plan import Baseline as B
from trainer.regions import Region as R

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def config(*overrides):
    return compose_config(overrides)


def trainer_for(tmp_path, *overrides, train_size=1024):
    from trainer.loop import Trainer
    return Trainer(config(f"data.train_size={train_size}", "data.val_size=256", *overrides), tmp_path, Dist())


@pytest.mark.parametrize("amp,optimizer", [("amp=false", "optimizer=nesterov"), ("amp=true", "optimizer=nesterov"),
                                           ("amp=true", "optimizer=muon")])
def test_graph_replay_trains_like_eager(tmp_path, amp, optimizer):
    """The captured graphs compute what the eager program computes (cuDNN may pick other
    algorithms between the two, so the comparison is to rounding, over a few steps)."""
    results = []
    for graphs in ("graphs=true", "graphs=false"):
        t = trainer_for(tmp_path / graphs, amp, optimizer, graphs, "trainer.epochs=1", "trainer.seed=3",
                        train_size=256)
        assert t.executor.use_graphs == (graphs == "graphs=true")
        t.fit()
        results.append(t.arena.flat(R.W_BN_BIAS, R.W_DEEP_CONV).cpu())
    torch.testing.assert_close(results[0], results[1], rtol=2e-2 if amp == "amp=true" else 1e-3, atol=1e-3)


@pytest.mark.parametrize("overrides", [["optimizer=lars", "amp=true", "ema=true"],
                                       ["compile=true", "model=resnet18_cifar", "data.resolution=16", "amp=true"]])
def test_deterministic_runs_repeat_bit_for_bit_with_or_without_graphs(tmp_path, overrides):
    """deterministic=true: a second run of one configuration, and the same run without
    graphs, end with every persistent byte of the first (LARS's norms, otherwise summed
    by atomics, and inductor's kernels included). Without it, two runs differ in their
    last bits (cuDNN's autotuned and atomic algorithms)."""
    states = []
    for i, graphs in enumerate(("graphs=true", "graphs=true", "graphs=false")):
        t = trainer_for(tmp_path / str(i), "deterministic=true", graphs, "trainer.epochs=2", "trainer.seed=3",
                        *overrides, train_size=256)
        t.fit()
        states.append(persistent_state(t.arena))
    assert_same_state(*states)


def test_the_compiled_step_trains_like_the_eager_step(tmp_path):
    """compile=true (inductor, and a ResNet's BatchNorms from the kernels with the blocks'
    ReLUs folded into them) computes what compile=false computes: one AMP step's update of
    each weight region, and the folded evaluation, which must apply the folded ReLUs.
    The classifier's update depends on the forward pass alone and agrees to 0.2% of its
    norm. Deeper, this small net at 16x16 amplifies rounding: its BatchNorms over 2x2
    maps flip ReLU masks, and the two steps' other updates differ by 6% of their norm in
    fp32 (TF32 convolutions) and 10-11% under AMP, as much with the torch reference in
    place of the Triton kernels; a gradient without its ReLU mask or with a wrong term is
    off by about its whole size (tests/test_kernels.py checks them to 1e-9 in float64)."""
    regions = (R.W_BN_BIAS, R.W_BN_WEIGHT, R.W_FC_WEIGHT, R.W_FIRST_CONV, R.W_DEEP_CONV)
    updates, losses = [], []
    for compile_ in ("compile=true", "compile=false"):
        t = trainer_for(tmp_path / compile_, compile_, "model=resnet18_cifar", "data.resolution=16", "amp=true",
                        "fold_bn=true", "trainer.epochs=1", "trainer.seed=3", train_size=64)
        before = [t.arena.flat(r).float().cpu() for r in regions]
        t.fit()
        updates.append([t.arena.flat(r).float().cpu() - b for r, b in zip(regions, before)])
        losses.append(t.history[-1]["val_loss"])
    off = {r: ((got - want).norm() / want.norm()).item() for r, got, want in zip(regions, *updates)}
    assert off[R.W_FC_WEIGHT] < 0.01 and max(off.values()) < 0.2, off
    assert losses[0] == pytest.approx(losses[1], rel=2e-2)


def test_epoch_allocates_nothing_and_never_syncs(tmp_path):
    t = trainer_for(tmp_path, "amp=true", "ema=true", "trainer.epochs=3", "trainer.log_every=4")
    t.train_epoch(0)()  # first epoch: DALI and allocator warm up
    torch.cuda.synchronize()
    # no new device memory: no cudaMalloc (segments), nothing more reserved, no retries
    key = lambda s: (s["segment.all.allocated"], s["reserved_bytes.all.current"], s["num_alloc_retries"])
    before = key(torch.cuda.memory_stats())
    torch.cuda.set_sync_debug_mode("error")
    try:  # the whole epoch, its metrics copied out too: the next one can queue behind it
        row = t.train_epoch(1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert key(torch.cuda.memory_stats()) == before
    assert row()["epoch"] == 2


def test_evaluation_alone_captures_only_the_evaluation_graphs(tmp_path):
    from trainer.loop import Trainer
    t = Trainer(config("data.train_size=1024", "data.val_size=256"), tmp_path, Dist(), evaluate_only=True)
    assert set(t.executor.graphs) == set(t.executor.keys(train=False))
    assert 0 <= t.evaluate()["val_top1"] <= 1


def test_after_the_capture_only_the_arena_stays_allocated():
    """Warm-up and capture leave nothing allocated beside the arena and the graphs' pool:
    no cuBLAS workspace of a side stream (tens of MiB each), which would add to the peak."""
    from trainer.feeder import BUFFERS
    from trainer.setup import assemble
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = assemble(config("mode=bench", "amp=true", "trainer.batch_size=64"), torch.device("cuda", 0))
    engine.executor.capture([("train_base", b) for b in BUFFERS])
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before - engine.plans.main.total_bytes < 2**20


def test_amp_overflow_is_skipped_inside_the_graph(tmp_path):
    t = trainer_for(tmp_path, "amp=true", "trainer.epochs=1")
    scale = t.ops.s[B.LOSS_SCALE]
    scale.fill_(2.0 ** 40)  # the scaled gradients overflow fp16 on the next step
    weights = t.arena.flat(R.W_BN_BIAS, R.W_DEEP_CONV).clone()
    steps = t.train_steps(0)[:1]
    t.train_source.start_epoch(0, steps[0].resolution)
    t.run_steps(steps, t.train_source)
    torch.cuda.synchronize()
    assert t.ops.s[B.OVERFLOW].item() == 1 and scale.item() == 2.0 ** 39
    assert torch.equal(t.arena.flat(R.W_BN_BIAS, R.W_DEEP_CONV), weights)


def test_triton_and_torch_kernels_train_alike(tmp_path):
    results = []
    for kernels in ("kernels=triton", "kernels=torch"):
        t = trainer_for(tmp_path / kernels, kernels, "optimizer=lars", "trainer.epochs=1", "schedule.warmup_epochs=0.5",
                        train_size=256)
        t.fit()
        results.append(t.arena.flat(R.W_BN_BIAS, R.W_DEEP_CONV).cpu())
    torch.testing.assert_close(results[0], results[1], rtol=1e-3, atol=1e-4)


def test_the_profile_sees_the_kernels_inside_the_step_graph():
    """bench.profile on a GPU: our step is one graph replay, and the profile lists the
    kernels inside it, whose time adds up to most of the measured step."""
    from trainer import bench
    cfg = config("mode=bench", "amp=true", "data.resolution=32", "trainer.batch_size=512", "bench.steps=10",
                 "bench.warmup=3", "bench.baselines=[]", "bench.profile=5")
    text = bench.run(cfg, torch.device("cuda", 0), cfg.bench.optimizers)
    peak = float(table_rows(text.split("steps profiled:")[0])["ours momentum fp16"][4])
    arena = float(re.search(r"its arena .* ([\d.,]+) MiB of its peak", text)[1].replace(",", "")) / 1024  # GiB
    assert 0 < arena < peak  # the step's activations come on top of the arena
    profiled = text.split("steps profiled:")[1]
    assert 0.3 < profile_share(profiled) < 1.2, profiled
    assert len(table_rows(profiled)) > 10, profiled  # the fast net's convolutions, its fused kernels, the range ops
    kinds = table_rows(profiled.split("| kind |")[1])  # the same kernels again, summed by kind
    total = float(table_rows(profiled)[next(k for k in table_rows(profiled) if k.startswith("all"))][1])
    assert sum(float(v[1]) for v in kinds.values()) == pytest.approx(total, abs=0.01 * len(kinds))
    assert {"convolution forward", "convolution dgrad", "range ops (kernels/)"} <= kinds.keys(), profiled


def test_a_plain_loop_leaves_no_cudnn_plan_to_our_autotuning():
    """mode=bench with bench.baseline_autotune=false: the plain fp16 loop runs cuDNN's
    heuristic plans, for the same convolutions (shapes, layout, fp16) as ours. Ours, which
    autotunes after it in the same process, still times cuDNN's candidates for each of
    them, rather than running the plans the plain loop left in torch's cache (kept per
    thread, under a key without the autotuning flag): its first forward launches more
    convolution kernels than its next."""
    from trainer import bench
    from trainer.setup import make_model
    device = torch.device("cuda", 0)
    cfg = config("mode=bench", "amp=true", "trainer.batch_size=64", "bench.steps=2", "bench.warmup=1",
                 "bench.baseline_autotune=false")
    bench.plain_loop(cfg, "eager_fp16", device)
    model = make_model(cfg).to(device)
    x = torch.randn(64, 3, cfg.data.resolution, cfg.data.resolution, device=device).to(
        memory_format=torch.channels_last)

    def convolution_kernels() -> int:
        cuda = torch.profiler.ProfilerActivity.CUDA
        with torch.profiler.profile(activities=[cuda]) as prof, torch.autocast("cuda", torch.float16):
            model(x)
            torch.cuda.synchronize()
        return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
                   and bench.kernel_kind(e.key) in ("convolution forward", "GEMM (cuBLAS, cuDNN)"))

    autotune, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, True
    try:
        first, second = convolution_kernels(), convolution_kernels()
    finally:
        torch.backends.cudnn.benchmark = autotune
    assert first > second > 0, (first, second)
