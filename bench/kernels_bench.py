"""Range-op kernels on one GPU: every Triton kernel against its torch reference over a
ResNet-50-sized fp32 weight block (its parameters in their arena slots, 25.6M elements),
and torch.optim.SGD(fused=True) with momentum over ResNet-50's own parameters for scale;
then the max-pool backward at ResNet-50's stem (batch 256, fp16, channels-last) against
ATen's, which reads the indices its forward kept, and BatchNorm's statistics and backward
against inductor's.

    python bench/kernels_bench.py

First checks each kernel against the reference at that size (and that a skipped step
changes no byte, and that an inf planted last is found), then times both: CUDA events,
median of 50 after warm-up, GB/s against the bytes the op must move.
"""
import statistics
import sys
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import reference, triton_ops  # noqa: E402
from kernels.reference import CHUNK  # noqa: E402
from trainer.dtensor import slot_bytes  # noqa: E402
from trainer.regions import Region  # noqa: E402

WARMUP, REPEATS = 5, 50
RTOL, ATOL = 1e-5, 1e-6  # float32 rounding; the GPU kernels contract a*b+c into FMAs
DEVICE = torch.device("cuda")


def scalar(value, dtype=torch.float32):
    return torch.tensor([value], dtype=dtype, device=DEVICE)


def resnet50_block():
    """ResNet-50's parameters as slots of one flat fp32 block, and its chunk -> tensor map."""
    model = torchvision.models.resnet50()
    slots = [slot_bytes(tuple(p.shape), "fp32", Region.W_DEEP_CONV) // 4 for p in model.parameters()]
    chunks = torch.tensor(slots) // CHUNK
    chunk_segment = torch.repeat_interleave(torch.arange(len(slots), dtype=torch.int32), chunks)
    return model, sum(slots), chunk_segment.to(DEVICE)


def cases(n, chunk_segment):
    """(name, function, arguments, bytes the op moves) for every kernel."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(dtype=torch.float32):
        return torch.randn(n, generator=gen, device=DEVICE).to(dtype)

    w, g, m, e = rand(), rand(), rand(), rand()
    v = rand().square()
    lr, wd, mu, skip = scalar(0.1), scalar(5e-5), scalar(0.9), scalar(0, torch.int8)
    adam = (scalar(1e-3), wd, scalar(0.9), scalar(0.999), scalar(1e-8), scalar(5, torch.int32), skip)
    norms = torch.rand(int(chunk_segment[-1]) + 1, CHUNK, device=DEVICE)
    found = scalar(0, torch.int8)
    f32 = 4 * n
    yield "sgd", "sgd_", (w, g, None, lr, wd, mu, skip, False), 3 * f32
    yield "momentum", "sgd_", (w, g, m, lr, wd, mu, skip, False), 5 * f32
    yield "nesterov", "sgd_", (w, g, m, lr, wd, mu, skip, True), 5 * f32
    # under AMP: fp16 gradients at the loss scale, unscaled as the update reads them
    yield "momentum, fp16 gradients", "sgd_", (w, rand(torch.float16), m, lr, wd, mu, skip, False, scalar(1 / 1024)), \
        f32 * 9 // 2
    yield "adam", "adam_", (w, g, m, v, *adam, False), 7 * f32
    yield "adamw", "adam_", (w, g, m, v, *adam, True), 7 * f32
    yield "lars", "lars_", (w, g, m, norms, chunk_segment, lr, wd, mu, scalar(0.001), skip), 7 * f32
    yield "lars_bias", "lars_bias_", (w, g, m, lr, wd, mu, skip), 5 * f32
    yield "check_finite", "check_finite_", (g, found), f32
    yield "unscale in place", "unscale_", (g, g, scalar(1 / 1024), found), 2 * f32
    for half in (torch.float16, torch.bfloat16):
        name = str(half).removeprefix("torch.")
        yield f"unscale {name}", "unscale_", (rand(half), g, scalar(1 / 1024), found), f32 * 3 // 2
        yield f"cast {name}", "cast_", (w, rand(half)), f32 * 3 // 2
        yield f"swap {name}", "swap_", (rand(half), rand(half)), 2 * f32
    yield "ema", "ema_", (e, w, scalar(0.999)), 3 * f32
    yield "swap", "swap_", (w, e), 4 * f32


def clone(args):
    """Copies of the tensor arguments; an argument passed twice stays one tensor."""
    copies = {id(a): a.clone() for a in args if isinstance(a, torch.Tensor)}
    return [copies.get(id(a), a) for a in args]


def max_rel_err(tri, ref):
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(tri)):
        return float("inf")
    if not finite.any():
        return 0.0
    t, r = tri[finite].double(), ref[finite].double()
    return ((t - r).abs() / r.abs().clamp_min(ATOL / RTOL)).max().item()


def check(name, fn, args):
    """Worst relative error over every tensor argument, with the checks that need the GPU;
    raises on a mismatch."""
    outs = []
    for impl in (reference, triton_ops):
        copy = clone(args)
        getattr(impl, fn)(*copy)
        outs.append([a for a in copy if isinstance(a, torch.Tensor)])
    ref, tri = outs
    exact = fn in ("cast_", "swap_", "check_finite_")
    err = 0.0
    for r, t in zip(ref, tri):
        if exact and not torch.equal(r, t) or not torch.allclose(t, r, RTOL, ATOL, equal_nan=True):
            raise AssertionError(f"{name}: Triton differs from the reference (max rel err {max_rel_err(t, r):.2e})")
        err = max(err, max_rel_err(t, r) if t.is_floating_point() else 0.0)
    if "skip" in fn_args(fn):  # a skipped step must leave every byte as it was
        skipped = clone(args)
        skipped[fn_args(fn).index("skip")] = scalar(1, torch.int8)
        getattr(triton_ops, fn)(*skipped)
        for before, after, arg in zip(args, skipped, fn_args(fn)):
            if arg in ("w", "m", "v") and after is not None and not torch.equal(before, after):
                raise AssertionError(f"{name}: a skipped step changed {arg}")
    if fn in ("check_finite_", "unscale_"):  # an inf at the very end of the range is found
        planted = clone(args)
        planted[0][-1] = float("inf")
        planted[-1].zero_()
        getattr(triton_ops, fn)(*planted)
        if planted[-1].item() != 1:
            raise AssertionError(f"{name}: an inf in the last element was not found")
    return err


def fn_args(fn):
    return getattr(reference, fn).__code__.co_varnames[:getattr(reference, fn).__code__.co_argcount]


def median_ms(step):
    for _ in range(WARMUP):
        step()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(REPEATS)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def graph_ms(step, calls=10):
    """Median ms of `step` replayed in a CUDA graph of `calls` calls, as the trainer runs it:
    ops this short are otherwise timed at the host's launch rate."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    return median_ms(graph.replay) / calls


def fused_sgd_ms(model):
    """torch.optim.SGD(fused=True) with momentum over ResNet-50's parameter list."""
    params = [p.to(DEVICE).detach().requires_grad_() for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-5, fused=True)
    return median_ms(opt.step), 5 * 4 * sum(p.numel() for p in params)


def stem_pool_inputs(gen):
    """ResNet-50 b256's stem pool: its input (fp16, channels-last, a ReLU's output), a
    gradient for its output, and the window."""
    x = torch.randn(256, 64, 112, 112, generator=gen, device=DEVICE).half().relu()
    window = ([3, 3], [2, 2], [1, 1])
    grad = torch.randn(256, 64, 56, 56, generator=gen, device=DEVICE).half()
    return x.to(memory_format=torch.channels_last), grad.to(memory_format=torch.channels_last), window


def pool_pass_bytes(x, y) -> int:
    """What each max-pool pass over fp16 x (pooled to y) must move: x or dx, y or grad_out,
    and the int8 positions."""
    return x.numel() * 2 + y.numel() * 3


def max_pool_rows():
    """The max-pool at ResNet-50's stem, forward and backward: Triton's (int8 positions)
    against ATen's (int64 indices), each pair checked (a sum of up to four fp16 gradients
    may round differently: ATen adds in fp16) and timed. Bytes: x read, y and positions
    written; grad_out and positions read, dx written."""
    x, grad, window = stem_pool_inputs(torch.Generator(device=DEVICE).manual_seed(0))
    (y, arg), (y_ref, indices) = triton_ops.max_pool(x, *window), torch.ops.aten.max_pool2d_with_indices(x, *window)
    dx = triton_ops.max_pool_backward(grad, arg, list(x.shape), True, *window)

    def aten_backward():
        return torch.ops.aten.max_pool2d_with_indices_backward(grad, x, *window, [1, 1], False, indices)

    dx_ref = aten_backward()
    if not torch.equal(y, y_ref) or not torch.equal(dx != 0, dx_ref != 0) or \
            not torch.allclose(dx, dx_ref, rtol=2 ** -10, atol=2 ** -7):
        raise AssertionError(f"max-pool: Triton differs from ATen (max rel err {max_rel_err(dx, dx_ref):.2e})")
    nbytes = pool_pass_bytes(x, y)
    return [("max-pool forward", nbytes, 0.0, graph_ms(lambda: triton_ops.max_pool(x, *window)),
             graph_ms(lambda: torch.ops.aten.max_pool2d_with_indices(x, *window))),
            ("max-pool backward", nbytes, max_rel_err(dx, dx_ref),
             graph_ms(lambda: triton_ops.max_pool_backward(grad, arg, list(x.shape), True, *window)),
             graph_ms(aten_backward))]


def batch_norm_inputs(c: int, hw: int, gen: torch.Generator, batch: int = 256):
    """One BatchNorm's arguments to batch_norm_backward, but the ReLU flag, at ResNet-50's
    activation shapes (fp16, channels-last, the input off zero): grad_out, x, the batch's
    statistics (mean, invstd) and the affine weight and bias."""
    x = (torch.randn(batch, c, hw, hw, generator=gen, device=DEVICE) + 1).half().to(memory_format=torch.channels_last)
    g = torch.randn(x.shape, generator=gen, device=DEVICE).half().to(memory_format=torch.channels_last)
    var, mean = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    return (g, x, mean.float(), torch.rsqrt(var + 1e-5).float(), torch.rand(c, device=DEVICE) + 0.5,
            torch.randn(c, device=DEVICE) * 0.1)


def batch_norm_rows():
    """BatchNorm's statistics and its backward (with the ReLU) at two of ResNet-50 b256's
    activations (fp16, channels-last): Triton's against the torch reference as inductor
    compiles it, which is what compile=true ran before trainer.norm; both timed inside CUDA
    graphs, as the step runs them. Bytes: the statistics
    read x once; backward reads x and grad_out twice (the sums, then the gradient) and
    writes the gradient."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    compiled = {fn: torch.compile(getattr(reference, fn), dynamic=False)
                for fn in ("batch_norm_stats_", "batch_norm_backward")}
    for c, hw in ((64, 56), (256, 56)):
        g, x, *rest = batch_norm_inputs(c, hw, gen)
        running = torch.stack((torch.zeros(c, device=DEVICE), torch.ones(c, device=DEVICE)))
        args = {"batch_norm_stats_": (x, running, 0.1, 1e-5), "batch_norm_backward": (g, x, *rest, True)}
        for fn, nbytes in (("batch_norm_stats_", 2 * x.numel()), ("batch_norm_backward", 10 * x.numel())):
            truth = getattr(reference, fn)(*[a.double() if torch.is_tensor(a) else a for a in args[fn]])
            err = max(max_rel_err(t.double(), r) for t, r in zip(getattr(triton_ops, fn)(*args[fn]), truth))
            if err > 1e-2:
                raise AssertionError(f"{fn}: Triton differs from the float64 reference by {err:.2e}")
            yield (f"{fn[11:].rstrip('_')} C={c}", nbytes, err, graph_ms(lambda: getattr(triton_ops, fn)(*args[fn])),
                   graph_ms(lambda: compiled[fn](*args[fn])))


def main():
    if not torch.cuda.is_available():
        sys.exit("kernels_bench needs a CUDA GPU")
    model, n, chunk_segment = resnet50_block()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; weight block {n / 1e6:.2f}M fp32 elements, "
          f"{len(chunk_segment.unique())} tensors, BLOCK {triton_ops.BLOCK}, {triton_ops.NUM_WARPS} warps")
    rows = []
    for name, fn, args, nbytes in cases(n, chunk_segment):
        err = check(name, fn, args)
        work = clone(args)  # timing repeats the op in place: keep the cases independent
        times = [median_ms(lambda impl=impl: getattr(impl, fn)(*work)) for impl in (triton_ops, reference)]
        rows.append((name, nbytes, err, *times))
        print(f"  {name}: ok, triton {times[0]:.3f} ms, torch {times[1]:.3f} ms", flush=True)
    sgd_ms, sgd_bytes = fused_sgd_ms(model)

    gbps = lambda nbytes, ms: nbytes / ms / 1e6
    print(f"\n{'kernel':18s} {'MB':>6s} {'max rel err':>11s} {'triton ms':>9s} {'GB/s':>6s} "
          f"{'torch ms':>9s} {'GB/s':>6s} {'speed-up':>8s}")
    for name, nbytes, err, tri, ref in rows:
        print(f"{name:18s} {nbytes / 1e6:6.0f} {err:11.1e} {tri:9.3f} {gbps(nbytes, tri):6.0f} "
              f"{ref:9.3f} {gbps(nbytes, ref):6.0f} {ref / tri:7.1f}x")
    print(f"{'SGD fused (torch)':18s} {sgd_bytes / 1e6:6.0f} {'':11s} {'':9s} {'':6s} "
          f"{sgd_ms:9.3f} {gbps(sgd_bytes, sgd_ms):6.0f}   (torch.optim, {len(list(model.parameters()))} tensors)")
    for name, nbytes, err, tri, ref in max_pool_rows():
        print(f"{name:18s} {nbytes / 1e6:6.0f} {err:11.1e} {tri:9.3f} {gbps(nbytes, tri):6.0f} "
              f"{ref:9.3f} {gbps(nbytes, ref):6.0f} {ref / tri:7.1f}x   (ResNet-50 b256 stem, fp16; torch: ATen's)")
    for name, nbytes, err, tri, ref in batch_norm_rows():
        print(f"{name:18s} {nbytes / 1e6:6.0f} {err:11.1e} {tri:9.3f} {gbps(nbytes, tri):6.0f} "
              f"{ref:9.3f} {gbps(nbytes, ref):6.0f} {ref / tri:7.1f}x   (ResNet-50 b256, fp16; torch: inductor's)")


if __name__ == "__main__":
    main()
