"""mode=bench: our training step against the loops a PyTorch user writes by hand, side by
side in one process, on the same model, batch, resolution and device, with synthetic
input already on the device. Each method's numbers: median ms/step, images/s, peak
device memory (ours: and its arena's share), and time to first step (build, warm-up,
capture and one step); with bench.profile, where its step's time goes, kernel by kernel."""
import contextlib
import copy
import gc
import logging
import re
import statistics
import threading
import time
from dataclasses import dataclass
from datetime import date

import torch
from torch.nn import functional as F

from trainer.config import TrainConfig
from trainer.feeder import BUFFERS
from trainer.setup import assemble, make_model, use_device

log = logging.getLogger("trainer")


@dataclass
class Result:
    method: str
    ms: float
    images_per_s: float
    peak_gib: float | None  # from the build on: warm-up, autotuning and capture included; None on a CPU
    first_step_s: float
    profile: str = ""
    arena_gib: float | None = None  # ours: the plan's persistent tensors, part of its peak


def _timed_steps(step, steps: int, warmup: int, device) -> list[float]:
    """Per-step milliseconds: device events around each step on a GPU, host clock on a CPU."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            times.append((start, end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1000)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in times]
    return times


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fresh(device):
    """Each method's peak counts only its own memory: what the last one left cached goes,
    cuBLAS's per-stream workspaces included."""
    gc.collect()
    if device.type == "cuda":
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def plain_loop(cfg: TrainConfig, method: str, device) -> Result:
    """The hand-written loop: channels_last, autocast (bf16, or fp16 with GradScaler),
    fused SGD with momentum, optionally torch.compile, and cuDNN's autotuning as
    cfg.bench.baseline_autotune says (on by default, as a loop written for speed has it),
    whatever cfg.model.cudnn_benchmark asks of ours. It runs in a thread of its own: torch
    keeps the cuDNN plan it ran for each convolution per thread, under a key that leaves
    out whether it was autotuned, so a plain loop run in this thread would hand its plans
    to ours, whose autotuning would then time nothing (ResNet-18's step ran 7% slower
    after the fp16 loop's heuristic choices)."""
    out, stop, done = {}, threading.Event(), threading.Event()

    def run():
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                out["result"] = _plain_loop(cfg, method, device, stop)
        except BaseException as e:  # raised again in the caller's thread
            out["error"] = e
        finally:
            done.set()

    ours_autotune, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, cfg.bench.baseline_autotune
    try:
        threading.Thread(target=run, name=method).start()
        done.wait()
    except BaseException:
        # Ctrl-C or SIGTERM, raised here: the worker stops after its step and is waited for,
        # as the interpreter exiting under a thread in torch's C++ code aborts ("terminate
        # called without an active exception", exit 134), through further Ctrl-Cs too (a
        # first step may compile for minutes). Not with Thread.join: Python 3.11's, once
        # interrupted, takes the thread for stopped while it runs on.
        stop.set()
        while not done.is_set():
            try:
                done.wait()
            except BaseException:
                pass
        raise
    finally:
        torch.backends.cudnn.benchmark = ours_autotune
    if "error" in out:
        raise out["error"]
    return out["result"]


class _Stopped(Exception):
    """A plain loop stopped between steps: the caller was interrupted."""


def _plain_loop(cfg: TrainConfig, method: str, device, stop: threading.Event) -> Result:
    _fresh(device)
    t0 = time.perf_counter()
    b, r = cfg.trainer.batch_size, cfg.data.resolution
    model = make_model(cfg).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=cfg.optimizer.weight_decay,
                          **({"fused": True} if device.type == "cuda" else {}))
    dtype = torch.float16 if "fp16" in method else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    net = torch.compile(model) if method.startswith("compile") else model
    x = torch.randn(b, 3, r, r, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, cfg.model.num_classes, (b,), device=device)

    def step():
        if stop.is_set():
            raise _Stopped
        with torch.autocast(device.type, dtype=dtype):
            loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    result = _measure(cfg, method, step, t0, device)
    del model, opt, net, x, y
    return result


def ours(cfg: TrainConfig, device) -> Result:
    """The trainer's step: plan, arena, bind, range ops, one captured graph per buffer."""
    _fresh(device)
    t0 = time.perf_counter()
    engine = assemble(cfg, device)
    tensors = engine.plans.tensors["train_base"]
    gen = torch.Generator(device).manual_seed(0)
    for buf in BUFFERS:
        data = engine.arena.view(tensors.input.data[buf], padded=True)
        data[..., :3].copy_(torch.randn(data[..., :3].shape, generator=gen, device=device))
        engine.arena[tensors.input.label[buf]].random_(0, cfg.model.num_classes, generator=gen)
    engine.executor.capture([("train_base", b) for b in BUFFERS])
    i = 0

    def step():
        nonlocal i
        engine.executor.run("train_base", BUFFERS[i % 2])
        i += 1

    name = f"ours {cfg.optimizer.name}" + (f" {cfg.amp_dtype}" if cfg.amp else " fp32") + (
        " compile" if cfg.compile else "") + ("" if engine.executor.use_graphs else " eager")
    result = _measure(cfg, name, step, t0, device)
    result.arena_gib = engine.plans.main.total_bytes / 2**30
    del engine
    return result


def _measure(cfg: TrainConfig, method: str, step, t0: float, device) -> Result:
    """One method's numbers: time to first step (from t0 through one step), the median
    step, peak memory, and with bench.profile where the step's time goes."""
    log.info("timing %s: %d warm-up and %d timed steps", method, cfg.bench.warmup, cfg.bench.steps)
    step()
    _sync(device)
    first = time.perf_counter() - t0
    ms = statistics.median(_timed_steps(step, cfg.bench.steps, cfg.bench.warmup, device))
    peak = _peak_gib(device)  # before the profiler's own allocations
    return Result(method, ms, cfg.trainer.batch_size / ms * 1000, peak, first,
                  profile(step, cfg.bench.profile, ms, device, cfg.bench.profile_rows) if cfg.bench.profile else "")


# A GPU kernel's kind, by the first pattern its name matches: inductor names its Triton
# kernels by reduction or pointwise, cuDNN and cuBLAS name their convolution kernels by
# pass (fprop, dgrad, wgrad; nvjet is cuBLAS's GEMM, which cuDNN runs for some 1x1
# convolutions in any pass), and the project's own kernels are their functions in kernels/.
KINDS = (("inductor reductions", "^triton_(red|per)_"), ("inductor pointwise", "^triton_poi_"),
         ("convolution forward", "fprop|first_layer"), ("convolution dgrad", "dgrad"),
         ("convolution wgrad", "wgrad|splitKreduce"), ("BatchNorm (kernels/)", "_bn_(reduce|backward_apply|normalize)_kernel"),
         ("max-pool (kernels/)", "_max_pool(_backward)?_kernel"),
         ("range ops (kernels/)", "_(sgd|adam|lars|lars_norms|convert|ema|swap)_kernel"),
         ("input augmentation (kernels/)", "_crop_flip_normalize_kernel"),
         ("ATen, cuDNN BatchNorm", "batch_norm|bn_fw|bn_bw"), ("GEMM (cuBLAS, cuDNN)", "nvjet|gemm|cutlass|cublas|cudnn"),
         ("ATen other", "at::native"), ("memset, memcpy", "(?i)memset|memcpy"))


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name)), "other")


def profile(step, steps: int, step_ms: float, device, rows: int = 25) -> str:
    """Where a step's time goes: its kernels (on a CPU, its operators) by their own time per
    step over `steps` steps, largest first, as a markdown table; the first row is what they
    add up to against the measured step. On a GPU a second table sums them by kind."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    gpu = device.type == "cuda"
    with torch_profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    own = (lambda e: e.self_device_time_total) if gpu else (lambda e: e.self_cpu_time_total)
    events = sorted((e for e in prof.key_averages() if own(e) > 0), key=own, reverse=True)
    total = sum(own(e) for e in events) / 1000 / steps
    lines = [f"| {'kernel' if gpu else 'operator'} | calls/step | ms/step | share of the step |", "|---|---|---|---|",
             f"| all, against the measured {step_ms:.2f} ms | | {total:.3f} | {total / step_ms:.0%} |"]
    for e in events[:rows]:
        ms = own(e) / 1000 / steps
        lines.append(f"| {e.key[:90]} | {e.count / steps:g} | {ms:.3f} | {ms / step_ms:.1%} |")
    if gpu:
        kinds = {}
        for e in events:
            kind = kernel_kind(e.key)
            calls, us = kinds.get(kind, (0, 0))
            kinds[kind] = calls + e.count, us + own(e)
        lines += ["", "| kind | calls/step | ms/step | share of the step |", "|---|---|---|---|"]
        for kind, (calls, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
            ms = us / 1000 / steps
            lines.append(f"| {kind} | {calls / steps:g} | {ms:.3f} | {ms / step_ms:.1%} |")
    return "\n".join(lines)


def table(cfg: TrainConfig, results: list[Result], device) -> str:
    ref = {r.method: r for r in results}
    eager, compiled = ref.get("eager_bf16"), ref.get("compile_bf16")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [f"{cfg.model.name}, batch {cfg.trainer.batch_size}, {cfg.data.resolution}x{cfg.data.resolution}, "
             f"{gpu}, torch {torch.__version__}, {date.today().isoformat()}"
             + ("" if device.type != "cuda" else "; the plain loops autotune cuDNN" if cfg.bench.baseline_autotune
                else "; the plain loops take cuDNN's heuristic choice")
             + ("; deterministic=true: every method runs deterministic kernels only" if cfg.deterministic else ""), "",
             "| method | ms/step | images/s | vs eager bf16 | vs compile bf16 | peak GiB | first step s |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        vs = lambda base: f"{r.images_per_s / base.images_per_s:.2f}x" if base else "-"
        lines.append(f"| {r.method} | {r.ms:.2f} | {r.images_per_s:,.0f} | {vs(eager)} | {vs(compiled)} | "
                     f"{'-' if r.peak_gib is None else f'{r.peak_gib:.3f}'} | {r.first_step_s:.1f} |")
    arenas = [f"{r.method}: its arena (the plan's persistent tensors) {r.arena_gib * 1024:,.1f} MiB"
              + ("" if r.peak_gib is None else " of its peak") for r in results if r.arena_gib is not None]
    lines += ["", *arenas] if arenas else []
    for r in results:
        if r.profile:
            lines += ["", f"{r.method}, {cfg.bench.profile} steps profiled:", "", r.profile]
    return "\n".join(lines)


def warm_process(device):
    """One step of a small convolution under autocast with torch's SGD, before any method is
    timed: the process's one-off costs (torch._dynamo, which the optimizer's first step
    imports; cuDNN's and cuBLAS's handles) fell in the first step of whichever method ran
    first, which then seemed seconds slower than the same method run later."""
    conv = torch.nn.Conv2d(3, 8, 3).to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(conv.parameters(), lr=0.01, momentum=0.9, **({"fused": True} if device.type == "cuda" else {}))
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = conv(torch.randn(2, 3, 8, 8, device=device).to(memory_format=torch.channels_last)).float().square().mean()
    loss.backward()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(cfg: TrainConfig, device, optimizers: list[str]) -> str:
    use_device(device, cfg)  # cfg.model.cudnn_benchmark holds for ours; bench.baseline_autotune for the plain loops
    if device.type == "cuda":
        torch.cuda.init()
    warm_process(device)
    results = [plain_loop(cfg, m, device) for m in cfg.bench.baselines]
    results += [ours(c, device) for c in with_optimizers(cfg, optimizers)]
    return table(cfg, results, device)


def with_optimizers(cfg: TrainConfig, optimizers: list[str]) -> list[TrainConfig]:
    """The configuration our step is timed in for each optimizer named (bench.optimizers)."""
    out = [copy.deepcopy(cfg) for _ in optimizers]
    for c, name in zip(out, optimizers):
        c.optimizer.name = name
    return out
