"""The Triton kernels against their torch references: on CPU through Triton's interpreter,
or on the GPU where there is one.

Every test runs both implementations on clones of the same random inputs and compares
every element of every tensor argument, so an output element a kernel forgot to write
(dst outputs start as nan) or a byte a skipped step changed shows up; sentinels after
each tensor catch writes past the end of a range.
"""
import os
import re

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:  # before triton.jit decorates the kernels; on a GPU they run compiled
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

pytest.importorskip("triton", reason="Triton is not installed: its kernels cannot be tested")

import kernels  # noqa: E402
from kernels import reference, triton_ops  # noqa: E402
from kernels.reference import CHUNK  # noqa: E402
from trainer.errors import ConfigError  # noqa: E402

N = CHUNK * 37  # two programs, the second one partly out of range
assert N % triton_ops.BLOCK
HALF = (torch.float16, torch.bfloat16)
GUARD, SENTINEL = triton_ops.BLOCK, 77
# float32 rounding: the interpreter computes in the reference's order, the GPU contracts
# a*b + c into FMAs
RTOL, ATOL = (1e-5, 1e-6) if ON_GPU else (2e-6, 1e-7)


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def scalar(value, dtype=torch.float32):
    return torch.tensor([value], dtype=dtype, device=DEVICE)


def guarded_clone(a):
    """A copy of a inside a buffer that continues with GUARD sentinel elements, which
    catch writes past the end of a range."""
    buf = torch.full((a.numel() + GUARD,), SENTINEL, dtype=a.dtype, device=a.device)
    buf[:a.numel()] = a.flatten()
    return buf, buf[:a.numel()].view(a.shape)


def run_both(fn_name, *args):
    """Call reference and Triton on guarded clones of args (an argument passed twice stays
    one tensor); check the guards and return both argument lists."""
    outs = []
    for impl in (reference, triton_ops):
        clones = {id(a): guarded_clone(a) for a in args if isinstance(a, torch.Tensor)}
        copy = [clones[id(a)][1] if id(a) in clones else a for a in args]
        getattr(impl, fn_name)(*copy)
        for buf, view in clones.values():
            assert (buf[view.numel():] == SENTINEL).all(), f"{impl.__name__}.{fn_name} wrote past a range"
        outs.append([a for a in copy if isinstance(a, torch.Tensor)])
    return outs


def assert_same(ref, tri, rtol=RTOL, atol=ATOL):
    for r, t in zip(ref, tri):
        torch.testing.assert_close(t, r, rtol=rtol, atol=atol, equal_nan=True)


def assert_untouched(before, after):
    for b, a in zip(before, after):
        assert torch.equal(b, a), "a skipped step changed its tensors"


def hyper(lr=0.1, wd=1e-2, skip=0):
    return scalar(lr), scalar(wd), scalar(skip, torch.int8)


SCALE = 1024.0
GRADS = ["fp32", *HALF]  # fp32 gradients, or half ones still multiplied by the loss scale (AMP)


def gradient(dtype, seed=2):
    """A gradient and the g_scale argument that goes with it: None, or 1/SCALE for a half
    gradient of SCALE times the values."""
    g = rand(N, seed=seed)
    return (g, []) if dtype == "fp32" else ((g * SCALE).to(dtype), [scalar(1 / SCALE)])


@pytest.mark.parametrize("grad", GRADS)
@pytest.mark.parametrize("skip", [0, 1])
@pytest.mark.parametrize("rule", ["sgd", "momentum", "nesterov"])
def test_sgd(rule, skip, grad):
    lr, wd, flag = hyper(skip=skip)
    (g, g_scale), w, m = gradient(grad), rand(N, seed=1), (None if rule == "sgd" else rand(N, seed=3))
    args = [w, g, m, lr, wd, scalar(0.9), flag, rule == "nesterov", *g_scale]
    ref, tri = run_both("sgd_", *args)
    assert_same(ref, tri)
    if skip:
        assert_untouched([w, g] + ([m] if m is not None else []), tri)


@pytest.mark.parametrize("grad", GRADS)
@pytest.mark.parametrize("skip", [0, 1])
@pytest.mark.parametrize("step", [1, 5])
@pytest.mark.parametrize("decoupled", [False, True])
def test_adam(decoupled, step, skip, grad):
    lr, wd, flag = hyper(lr=1e-3, skip=skip)
    (g, g_scale), w, m, v = gradient(grad), rand(N, seed=1), rand(N, seed=3) * 0.1, rand(N, seed=4).square() * 0.01
    ref, tri = run_both("adam_", w, g, m, v, lr, wd, scalar(0.9), scalar(0.999), scalar(1e-8),
                        scalar(step, torch.int32), flag, decoupled, *g_scale)
    assert_same(ref, tri)
    if skip:
        assert_untouched([w, g, m, v], tri)


@pytest.mark.parametrize("grad", GRADS)
@pytest.mark.parametrize("skip", [0, 1])
def test_lars(skip, grad):
    # Chunks per segment: segment 2 crosses the program boundary at chunk 32; segment 1 has
    # |w| = 0 and segment 3 |g| = 0 (trust ratio 1 for both).
    lengths = torch.tensor([3, 1, 30, 1, 2])
    chunk_segment = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths).to(DEVICE)
    starts = (torch.cumsum(lengths, 0) - lengths) * CHUNK
    (g, g_scale), w, m = gradient(grad), rand(N, seed=1), rand(N, seed=3)
    w[starts[1]:starts[1] + CHUNK] = 0
    g[starts[3]:starts[3] + CHUNK] = 0
    norms = rand(len(lengths), CHUNK, seed=4)  # junk the op must overwrite (columns 0, 1) or keep
    lr, wd, flag = hyper(skip=skip)
    ref, tri = run_both("lars_", w, g, m, norms, chunk_segment, lr, wd, scalar(0.9), scalar(0.02), flag, *g_scale)
    assert_same(ref, tri)
    if skip:
        assert_untouched([w, g, m], tri[:3])


@pytest.mark.parametrize("rule", ["nesterov", "adamw", "lars"])
@pytest.mark.parametrize("dtype", HALF)
def test_reading_scaled_half_gradients_is_unscaling_them_first(rule, dtype):
    """AMP's fused unscale: an update given half gradients and g_scale writes exactly what
    unscale_ into fp32 and then the update of those would, bit for bit."""
    g16, (g_scale,) = gradient(dtype)
    lr, wd, flag = hyper()
    g32 = torch.empty(N, device=DEVICE)
    reference.unscale_(g16, g32, g_scale, scalar(0, torch.int8))
    segments = torch.arange(N // CHUNK, dtype=torch.int32, device=DEVICE)
    results = []
    for g, extra in ((g32, []), (g16, [g_scale])):
        w, m, v, norms = rand(N, seed=1), rand(N, seed=3), rand(N, seed=4).square(), torch.zeros(N // CHUNK, CHUNK)
        if rule == "nesterov":
            reference.sgd_(w, g, m, lr, wd, scalar(0.9), flag, True, *extra)
        elif rule == "adamw":
            reference.adam_(w, g, m, v, lr, wd, scalar(0.9), scalar(0.999), scalar(1e-8), scalar(3, torch.int32),
                            flag, True, *extra)
        else:
            reference.lars_(w, g, m, norms.to(DEVICE), segments, lr, wd, scalar(0.9), scalar(0.02), flag, *extra)
        results.append(torch.cat([w, m, v]))
    assert torch.equal(*results)


@pytest.mark.parametrize("skip", [0, 1])
def test_lars_bias(skip):
    lr, wd, flag = hyper(skip=skip)
    w, g, m = rand(N, seed=1), rand(N, seed=2), rand(N, seed=3)
    ref, tri = run_both("lars_bias_", w, g, m, lr, wd, scalar(0.9), flag)
    assert_same(ref, tri)
    if skip:
        assert_untouched([w, g, m], tri)


@pytest.mark.parametrize("plant", [None, "inf", "nan"])
@pytest.mark.parametrize("found", [0, 1])
def test_check_finite(plant, found):
    x = rand(N, seed=1)
    if plant:
        x[-1] = float(plant)
    ref, tri = run_both("check_finite_", x, scalar(found, torch.int8))
    assert_same(ref, tri)
    assert tri[1].item() == (1 if plant or found else 0)


@pytest.mark.parametrize("plant", [None, "inf", "nan"])
@pytest.mark.parametrize("src_dtype", ["same", *HALF])
def test_unscale(src_dtype, plant):
    src = rand(N, seed=1) * 1024
    if src_dtype == "same":  # in place
        dst = src
    else:
        src, dst = src.to(src_dtype), torch.full((N,), float("nan"), device=DEVICE)
    if plant:
        src[-1] = float(plant)
    ref, tri = run_both("unscale_", src, dst, scalar(1 / 1024), scalar(0, torch.int8))
    assert_same(ref, tri)
    assert tri[-1].item() == (1 if plant else 0)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", HALF)
def test_cast(dtype):
    src = rand(N, seed=1) * 100
    src[0] = 1e5  # overflows fp16 to inf, as torch does
    ref, tri = run_both("cast_", src, torch.full((N,), float("nan"), dtype=dtype, device=DEVICE))
    assert torch.equal(ref[0], tri[0])
    if dtype == torch.bfloat16 and not ON_GPU:  # the interpreter truncates to bf16: 1 ulp
        assert_same(ref, tri, rtol=2 ** -7, atol=0)
    else:  # rounded to nearest even, as torch does
        assert torch.equal(ref[1], tri[1])


@pytest.mark.parametrize("decay", [0.999, 1.0])
def test_ema(decay):
    e, w = rand(N, seed=1), rand(N, seed=2)
    ref, tri = run_both("ema_", e, w, scalar(decay))
    assert_same(ref, tri)
    if decay == 1.0:
        assert torch.equal(tri[0], e), "a step without EMA changed the EMA weights"


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_swap(dtype):
    a, b = rand(N, seed=1, dtype=dtype), rand(N, seed=2, dtype=dtype)
    ref, tri = run_both("swap_", a, b)
    assert torch.equal(tri[0], b) and torch.equal(tri[1], a)


@pytest.mark.parametrize("dtype,channels,with_mask", [(torch.float16, 4, True), (torch.float32, 3, False),
                                                      (torch.bfloat16, 4, True)])
def test_crop_flip_normalize(dtype, channels, with_mask):
    """Crops reaching past every edge (reflected back), flipped and not, repeated examples,
    cutout squares inside, clipped by an edge, and of side 0."""
    g = torch.Generator().manual_seed(0)
    n, h, w, b = 20, 8, 6, 9
    images = torch.randint(0, 256, (n, h, w, 3), dtype=torch.uint8, generator=g).to(DEVICE)
    labels = torch.randint(0, 10, (n,), dtype=torch.int32, generator=g).to(DEVICE)
    table = torch.stack([torch.randint(0, n, (b,), generator=g), torch.randint(-3, 4, (b,), generator=g),
                         torch.randint(-3, 4, (b,), generator=g), torch.arange(b) % 2,
                         torch.randint(0, 2, (b,), generator=g), torch.randint(-2, h, (b,), generator=g),
                         torch.randint(-2, w, (b,), generator=g), torch.arange(b) % 4], 1).to(DEVICE)
    mean, inv_std = rand(3, seed=1).abs() * 255, 1 / (rand(3, seed=2).abs() * 255 + 1)
    out = torch.full((b, h, w, channels), float("nan"), dtype=dtype, device=DEVICE)
    label, mask = torch.full((b,), -1, dtype=torch.int32, device=DEVICE), torch.full((b,), -1, dtype=torch.int8,
                                                                                     device=DEVICE)
    ref, tri = run_both("crop_flip_normalize_", images, labels, table, mean, inv_std, out, label,
                        mask if with_mask else None)
    assert torch.equal(ref[-1], tri[-1]) and torch.equal(ref[-2], tri[-2])  # labels and mask, or out
    if dtype == torch.bfloat16 and not ON_GPU:  # the interpreter truncates to bf16: 1 ulp
        assert_same(ref, tri, rtol=2 ** -7, atol=0)
    else:
        assert all(torch.equal(r, t) for r, t in zip(ref, tri))


# each window in float32, and the halves in the ResNet stem's (the dtype changes the loads and
# stores, not the windows' indexing; each case takes Triton's interpreter seconds)
@pytest.mark.parametrize("dtype,kernel,stride,padding", [
    *((torch.float32, *window) for window in [(3, 2, 1), (2, 2, 0), (3, 1, 1), (4, 3, 2), ((3, 2), (2, 1), (1, 0))]),
    *((half, 3, 2, 1) for half in HALF)], ids=str)
@pytest.mark.parametrize("channels_last", [True, False])
def test_max_pool(dtype, kernel, stride, padding, channels_last):
    """Against max_pool2d and its own backward, exactly, for both implementations: small
    integer values make ties in most windows (the first maximum in row-major order takes
    the gradient), a NaN is a window's maximum, odd sizes leave rows and columns no window
    covers (floor mode), 70 channels fill one channel block and part of a second, and
    integer gradients sum exactly, a second one (in the other layout) among them. Both give
    the same int8 positions."""
    kernel, stride, padding = ([v, v] if isinstance(v, int) else list(v) for v in (kernel, stride, padding))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (3, 70, 11, 9), generator=g).to(dtype)
    x[1, 5, 4, 4] = float("nan")
    x = x.to(DEVICE, memory_format=reference.layout(channels_last))
    y, indices = torch.ops.aten.max_pool2d_with_indices(x, kernel, stride, padding)
    grad_out = torch.randint(-4, 5, y.shape, generator=g).to(DEVICE, dtype)
    other_layout = reference.layout(not channels_last)
    more = torch.randint(-4, 5, y.shape, generator=g).to(DEVICE, dtype, memory_format=other_layout)
    dx = torch.ops.aten.max_pool2d_with_indices_backward(grad_out, x, kernel, stride, padding, [1, 1], False, indices)
    assert dx.abs().sum() > 0
    args = []
    for impl in (reference, triton_ops):
        y_impl, arg = impl.max_pool(x, kernel, stride, padding)
        torch.testing.assert_close(y_impl, y, rtol=0, atol=0, equal_nan=True)
        assert y_impl.stride() == y.stride() and arg.dtype == torch.int8 and arg.shape == (y[:, 0].numel(), 70)
        dx_impl = impl.max_pool_backward(grad_out, arg, list(x.shape), channels_last, kernel, stride, padding)
        assert torch.equal(dx_impl, dx) and dx_impl.stride() == x.stride()
        # a second gradient of the output, in the other layout, added as autograd adds
        dx_more = impl.max_pool_backward(grad_out - more, arg, list(x.shape), channels_last, kernel, stride, padding,
                                         more)
        assert torch.equal(dx_more, dx)
        args.append(arg)
    assert torch.equal(*args)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_batch_norm_max_pool(dtype):
    """The stem's BatchNorm, ReLU and max-pool in one pass: the maxima and their positions
    of the normalization pooled after it, exactly. Small integer inputs and dyadic
    statistics and parameters make every value exact in any order of operations, and
    ties in most windows, zeros from the ReLU among them; a NaN is a window's maximum, a
    negative scale keeps the padding out, odd sizes leave rows no window covers."""
    g = torch.Generator().manual_seed(0)

    def dyadic(low, high, scale):
        return (torch.randint(low, high, (70,), generator=g) * scale).to(DEVICE)

    x = torch.randint(-3, 4, (3, 70, 11, 9), generator=g).to(DEVICE, dtype).to(memory_format=torch.channels_last)
    x[1, 5, 4, 4] = float("nan")
    weight = dyadic(-2, 3, 0.5)
    weight[0] = -1.0
    norm = (dyadic(-4, 5, 0.25), 2.0 ** dyadic(-1, 2, 1), weight, dyadic(-4, 5, 0.125))
    window = ([3, 3], [2, 2], [1, 1])
    want = triton_ops.max_pool(triton_ops.batch_norm_apply(x, *norm, None, True, False)[0], *window)
    for impl in (reference, triton_ops):
        got = impl.batch_norm_max_pool(x, *norm, *window)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0, equal_nan=True)
        assert torch.equal(got[1], want[1]) and (want[1] != 0).float().mean() > 0.3


def test_a_compiled_max_pool_is_the_kernel_as_it_is():
    """Under torch.compile the Triton module's max_pool stays one opaque op that inductor
    calls as it is (inductor's compiled torch form of it was slower, docs/BENCHMARKS.md),
    with the reference's results."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    x = rand(2, 8, 9, 9).to(memory_format=torch.channels_last)
    y, arg = torch.compile(triton_ops.max_pool, backend=record)(x, [3, 3], [2, 2], [1, 1])
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert "trainer.max_pool.default" in targets and not any("aten" in t for t in targets), targets
    assert all(torch.equal(a, b) for a, b in zip((y, arg), reference.max_pool(x, [3, 3], [2, 2], [1, 1])))


def test_a_compiled_network_keeps_the_max_pool_positions_as_they_are():
    """Inductor lays out a convolutional network's 4-d tensors channels-last; positions
    kept as a 4-d tensor were copied into that layout after the forward pass and back for
    the backward (0.08 ms of ResNet-50's step). Kept as a matrix, no int8 buffer of
    inductor's own appears in the compiled forward or backward."""
    from torch._inductor.utils import run_and_get_code

    from trainer.pooling import use_max_pool_kernel
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.MaxPool2d(3, 2, 1),
                                torch.nn.Conv2d(16, 16, 3)).to(DEVICE, memory_format=torch.channels_last)
    assert use_max_pool_kernel(model, triton_ops) == 1
    compiled = torch.compile(model, dynamic=False)
    x = rand(2, 3, 12, 12).to(memory_format=torch.channels_last)
    _, code = run_and_get_code(lambda: compiled(x).square().sum().backward())
    assert len(code) == 2 and not any(re.search(r"empty_strided\w*\([^\n]*torch\.int8\)", c) for c in code)
    assert "trainer.max_pool.default" in code[0] and "trainer.max_pool_backward.default" in code[1]


def resnet18_and_swapped(swap, kernels):
    """A torchvision ResNet-18 (channels-last) and a copy changed by swap(copy, kernels),
    with what swap returned."""
    import copy

    import torchvision
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(num_classes=10).to(DEVICE, memory_format=torch.channels_last)
    swapped = copy.deepcopy(plain)
    return plain, swapped, swap(swapped, kernels)


@pytest.mark.parametrize("impl", [reference, triton_ops])
def test_a_resnet_with_the_max_pool_kernel_keeps_its_gradients(impl):
    """The stem pool swapped for the kernels' backward: the same logits and the same
    gradient for every parameter as torchvision's model, whose pool keeps its indices."""
    from trainer.pooling import MaxPool2d, use_max_pool_kernel
    plain, swapped, swaps = resnet18_and_swapped(use_max_pool_kernel, impl)
    assert swaps == 1 and type(swapped.maxpool) is MaxPool2d
    x = rand(2, 3, 32, 32).to(memory_format=torch.channels_last)
    for model in (plain, swapped):
        model(x).square().sum().backward()
    torch.testing.assert_close(swapped(x), plain(x), rtol=0, atol=0)
    for (name, p), q in zip(plain.named_parameters(), swapped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def compiled_against_eager(swap):
    """A ResNet-18 and a copy changed by swap(copy, triton_ops) and compiled, each run
    forward and backward on one batch with the same cuDNN rounding: (plain, swapped, their
    logits)."""
    plain, swapped, _ = resnet18_and_swapped(swap, triton_ops)
    x = rand(8, 3, 64, 64).to(memory_format=torch.channels_last)
    logits = []
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for model in (plain, torch.compile(swapped, dynamic=False)):
            logits.append(model(x))
            logits[-1].square().sum().backward()
    return plain, swapped, *logits


@pytest.mark.skipif(not ON_GPU, reason="inductor compiles the backward around the kernel for the GPU")
def test_the_max_pool_kernel_inside_a_compiled_backward():
    """Inductor calls the custom op inside the compiled backward: the gradients of a
    compiled model with the swapped pool are the eager model's."""
    from trainer.pooling import use_max_pool_kernel
    plain, swapped, _, _ = compiled_against_eager(use_max_pool_kernel)
    for (name, p), q in zip(plain.named_parameters(), swapped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-3, msg=name)


# (N, C, H, W): one program's row tiles and one channel block; several programs and channel
# blocks, the last ones partial; a few channels
BN_SHAPES = [(3, 70, 5, 7), (8, 200, 12, 12), (16, 16, 9, 9)]


def truth(fn, *args):
    """The reference computed in float64 (a packed ReLU mask as it is)."""
    return getattr(reference, fn)(*[a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args])


def rel_err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def batch_stats(x):
    """The batch's mean and biased variance over (N, H, W), in float64."""
    var, mean = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    return mean, var


# tiles of a few rows, one program an SM: programs take unequal numbers of tiles, and the
# last tile is partial in (3, 70, 5, 7)
SMALL_TILES = triton_ops.BnTiles(64, 256, 4, per_sm=1, stages=2)
# the tiles as set over every shape; the small ones over the shapes where programs loop over
# 14 to 20 of them (in (8, 200, 12, 12) one program loops over 288, which Triton's
# interpreter takes seconds a case to run, and checks nothing the others do not)
BN_TILED = [*((None, shape) for shape in BN_SHAPES), *((SMALL_TILES, shape) for shape in BN_SHAPES[::2])]


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("tiles,shape", BN_TILED)
def test_batch_norm_stats(dtype, shape, tiles, monkeypatch):
    """Each channel's mean and inverse standard deviation against float64, where the values
    sit far from zero (the sums are shifted by the first row against cancellation) and the
    input is channels-last or not; the running statistics moved as nn.BatchNorm2d moves them
    (toward the unbiased variance). With the tiles as set, or small ones."""
    if tiles is not None:
        monkeypatch.setattr(triton_ops, "BN_STATS", tiles)
    x = (rand(*shape, dtype=torch.float32) * 0.5 + 40).to(dtype)
    for layout in (torch.channels_last, torch.contiguous_format):
        running = torch.stack((rand(shape[1], seed=4), rand(shape[1], seed=5).abs() + 0.5))
        torch_bn = torch.nn.BatchNorm2d(shape[1], device=DEVICE, dtype=torch.float64)
        torch_bn.running_mean.copy_(running[0])
        torch_bn.running_var.copy_(running[1])
        want_mean, want_invstd = truth("batch_norm_stats_", x, running, 0.1, 1e-5)
        mean, invstd = triton_ops.batch_norm_stats_(x.contiguous(memory_format=layout), running, 0.1, 1e-5)
        assert mean.dtype == invstd.dtype == torch.float32
        assert (mean.double() - want_mean).abs().max() < 4e-6 and rel_err(invstd, want_invstd) < 1e-4
        torch_bn(x.double())
        assert (running[0].double() - torch_bn.running_mean).abs().max() < 1e-6
        assert rel_err(running[1], torch_bn.running_var) < 1e-4


def test_a_batch_norm_with_the_kernels_needs_two_values_per_channel():
    from trainer.norm import use_batch_norm_kernels
    bn = torch.nn.Sequential(torch.nn.BatchNorm2d(8))
    use_batch_norm_kernels(bn, triton_ops)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(rand(1, 8, 1, 1))


def test_batch_norm_reductions_count_in_one_place_for_good():
    """The reductions' counters stay where the first launch put them, however many channel
    blocks a later one has: a captured graph replays with the address it was captured with."""
    small, x = rand(2, 16, 3, 3), rand(2, 5000, 1, 3)  # 1 and 79 blocks of 64 channels
    triton_ops.batch_norm_stats_(small, torch.zeros(2, 16, device=DEVICE), 0.1, 1e-5)
    where = triton_ops._COUNTERS[small.device].data_ptr()
    mean, _ = triton_ops.batch_norm_stats_(x, torch.zeros(2, 5000, device=DEVICE), 0.1, 1e-5)
    assert triton_ops._COUNTERS[x.device].data_ptr() == where
    assert (mean.double() - batch_stats(x)[0]).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("tiles,shape", BN_TILED)
def test_batch_norm_backward(dtype, shape, relu, tiles, monkeypatch):
    """The input's and both parameters' gradients against float64, with the ReLU's mask
    found again from x (about half the elements are masked); both passes with the tiles as
    set, or with small ones, each program looping over many."""
    if tiles is not None:
        monkeypatch.setattr(triton_ops, "BN_SUMS", tiles)
        monkeypatch.setattr(triton_ops, "BN_GRADIENT", tiles)
    x = rand(*shape, dtype=dtype).to(memory_format=torch.channels_last)
    grad_out = rand(*shape, seed=1, dtype=dtype).to(memory_format=torch.channels_last)
    mean, var = batch_stats(x)
    c = shape[1]
    args = (grad_out, x, mean.float(), torch.rsqrt(var + 1e-5).float(), rand(c, seed=2).abs() + 0.5,
            rand(c, seed=3) * 0.1, relu)
    got, want = triton_ops.batch_norm_backward(*args), truth("batch_norm_backward", *args)
    assert got[0].dtype == dtype and got[0].is_contiguous(memory_format=torch.channels_last)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert all(rel_err(g, w) < tolerance for g, w in zip(got, want))
    if relu:  # the mask matters: without it the gradients are others
        assert rel_err(got[1], truth("batch_norm_backward", *args[:-1], False)[1]) > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("shape", BN_SHAPES)
@pytest.mark.parametrize("shortcut", [False, True])
@pytest.mark.parametrize("relu", ["none", "x", "y", "packed"],
                         ids=["no-relu", "relu", "relu-after-add", "relu-after-add-packed"])
def test_batch_norm_block_backward(dtype, shape, shortcut, relu):
    """The block BatchNorm's backward against float64: grad_out plus the gradient a later
    shortcut hands back (in their type, as autograd adds them), masked after a residual add
    by the output or its packed mask, or by x; the input's and parameters' gradients, and
    the residual's (None where the ReLU comes right after the BatchNorm), written over the
    handed-back gradient."""
    c = shape[1]
    x = rand(*shape, dtype=dtype).to(memory_format=torch.channels_last)
    grad_out = rand(*shape, seed=1, dtype=dtype).to(memory_format=torch.channels_last)
    more = rand(*shape, seed=4, dtype=dtype).to(memory_format=torch.channels_last) if shortcut else None
    y = rand(*shape, seed=5, dtype=dtype).to(memory_format=torch.channels_last)
    y = {"y": y, "packed": reference._relu_mask(y)}.get(relu)
    mean, var = batch_stats(x)
    args = (grad_out, more, y, x, mean.float(), torch.rsqrt(var + 1e-5).float(), rand(c, seed=2).abs() + 0.5,
            rand(c, seed=3) * 0.1, relu != "none")
    given = None if more is None else more.clone()  # the kernels write the sum over it
    got = triton_ops.batch_norm_block_backward(grad_out, given, *args[2:])
    if shortcut and relu != "x":
        assert got[3].data_ptr() == given.data_ptr()
    # the two gradients' sum in their type, as autograd adds them; the rest in float64
    want = truth("batch_norm_block_backward", grad_out if more is None else grad_out + more, None, *args[2:])
    assert (got[3] is None) == (want[3] is None) == (relu == "x")
    # Triton's interpreter rounds to bfloat16 toward zero, one bit off a GPU's rounding
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2 if ON_GPU else 2e-2}[dtype]
    for g, w in zip(got, want):
        if w is not None:
            assert g.dtype == (dtype if g.dim() == 4 else torch.float32) and rel_err(g, w) < tolerance
    if y is not None:  # the output's mask, not x's
        assert rel_err(got[1], truth("batch_norm_block_backward", *args[:2], None, *args[3:])[1]) > 0.1
    if shortcut:
        assert rel_err(got[2], truth("batch_norm_block_backward", args[0], None, *args[2:])[2]) > 0.1


def aten_ops(fn, *args):
    """fn(*args), and the ops it ran (aten's and custom ones)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Ops():
        return fn(*args), seen


@pytest.mark.parametrize("packed", [False, True])
def test_the_block_batch_norm_backward_of_a_mean_pools_gradient(packed):
    """The last block's BatchNorm gets a mean-pool's gradient, broadcast over (H, W): its
    backward matches float64 and keeps the masked gradient channels-last, reading the
    broadcast one as it is, with no copy (the step's peak memory is at its start)."""
    x = rand(4, 16, 5, 5).to(memory_format=torch.channels_last)
    y = rand(4, 16, 5, 5, seed=5).to(memory_format=torch.channels_last)
    y = reference._relu_mask(y) if packed else y
    grad_out = (rand(4, 16, 1, 1, seed=1) / 25).expand(4, 16, 5, 5)  # as MeanPool2d gives it
    mean, var = batch_stats(x)
    args = (grad_out, None, y, x, mean.float(), torch.rsqrt(var + 1e-5).float(), rand(16, seed=2).abs() + 0.5,
            rand(16, seed=3) * 0.1, True)
    got, ops = aten_ops(triton_ops.batch_norm_block_backward, *args)
    want = truth("batch_norm_block_backward", *args)
    assert got[3].is_contiguous(memory_format=torch.channels_last) and torch.ops.aten.clone.default not in ops
    assert all(rel_err(g, w) < 1e-5 for g, w in zip(got, want))


def test_the_mean_pool_gives_its_gradient_broadcast():
    """MeanPool2d, which eager training's BatchNorm kernels put in place of a mean-pool to
    (1, 1): nn.AdaptiveAvgPool2d's output, and its input's gradient as a value per image and
    channel broadcast over (H, W), which the last block's BatchNorm reads as it is."""
    from trainer.models import build_model
    from trainer.norm import use_batch_norm_kernels
    from trainer.pooling import MeanPool2d
    model = build_model("resnet18", 10, stem="cifar").to(DEVICE)
    use_batch_norm_kernels(model, reference, normalize=True)
    assert type(model.avgpool) is MeanPool2d
    x = rand(4, 8, 5, 5).to(memory_format=torch.channels_last).requires_grad_()
    seen = []
    h = x * 1
    h.register_hook(seen.append)
    y = model.avgpool(h)
    torch.testing.assert_close(y, torch.nn.AdaptiveAvgPool2d(1)(x), rtol=1e-6, atol=1e-7)
    y.backward(rand(4, 8, 1, 1, seed=1))
    assert seen[0].stride()[2:] == (0, 0)
    torch.testing.assert_close(x.grad, rand(4, 8, 1, 1, seed=1).expand(4, 8, 5, 5) / 25)


@pytest.mark.parametrize("stem, size, pack", [("cifar", 16, True), ("imagenet", 32, True), ("cifar", 16, False)])
def test_a_block_hands_its_shortcuts_gradient_to_the_batch_norm_before_it(stem, size, pack):
    """Eager training (the Triton kernels, Triton's interpreter here): a ResNet-18 runs its
    backward with no add of its own where a block reads a BatchNorm's output (each block's
    shortcut, the identity or a downsampling convolution, hands its gradient to that
    BatchNorm): with the CIFAR stem, and with the ImageNet one, whose BatchNorm, ReLU and
    max-pool are one pass that takes the first block's shortcut gradient into the pool's
    backward. No ReLU mask of ATen's either: each block's end reads the mask its
    normalization packed, or its output. The plain model's gradients."""
    import copy

    from trainer.models import build_model
    from trainer.norm import use_batch_norm_kernels
    from trainer.pooling import use_max_pool_kernel
    torch.manual_seed(0)
    plain = build_model("resnet18", 10, stem=stem).to(DEVICE)
    swapped = copy.deepcopy(plain)
    use_max_pool_kernel(swapped, triton_ops)
    use_batch_norm_kernels(swapped, triton_ops, normalize=True, pack_masks=pack)
    x = rand(4, 3, size, size)
    for model in (plain, swapped):
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # TF32 convolutions differ by 1e-4 and more
            _, seen = aten_ops(lambda: model(x).square().sum().backward())
    assert torch.ops.aten.threshold_backward.default not in seen
    assert torch.ops.aten.add.Tensor not in seen
    assert torch.ops.trainer.max_pool.default not in seen
    for (name, p), q in zip(plain.named_parameters(), swapped.parameters()):
        assert rel_err(q.grad, p.grad) < 1e-4, name


@pytest.mark.parametrize("shape", BN_SHAPES)
def test_a_packed_relu_mask_passes_what_threshold_backward_passes(shape):
    """The reference's packed ReLU mask (a byte per 8 channels, the last byte of a row
    partly used where C is no multiple of 8), unpacked, gates a gradient as
    threshold_backward on the output does: zero where y <= 0, NaN y passing it; and it takes
    a sixteenth of a half output's bytes."""
    y = torch.relu(rand(*shape, dtype=torch.float16))
    y[0, 1, 2, 3], y[1, 0, 0, 0] = float("nan"), -0.0
    grad = rand(*shape, seed=1, dtype=torch.float16)
    for layout in (torch.channels_last, torch.contiguous_format):
        mask = reference._relu_mask(y.contiguous(memory_format=layout))
        assert mask.dtype == torch.uint8 and mask.shape == (shape[0] * shape[2] * shape[3], -(-shape[1] // 8))
        got = torch.where(reference._relu_unmask(mask, shape), grad, 0)
        assert torch.equal(got, torch.ops.aten.threshold_backward(grad, y, 0))
    assert (got == 0).float().mean() > 0.3 and got[0, 1, 2, 3] == grad[0, 1, 2, 3]


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("shape", BN_SHAPES)
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("pack", [False, True])
def test_batch_norm_apply(dtype, shape, relu, residual, pack):
    """The normalization, with a residual added and a ReLU after it or not, against float64
    from inputs in either layout: channels-last out, rounded once to x's type, a NaN kept
    through the ReLU as torch.relu keeps it; after a residual add and the ReLU, where asked
    for, the packed mask of the output, which passes the NaN."""
    c = shape[1]
    x = rand(*shape, dtype=dtype)
    mean, var = batch_stats(x)
    x[0, 0, 0, 0] = float("nan")
    res = rand(*shape, seed=1, dtype=dtype).to(memory_format=torch.channels_last) if residual else None
    args = (mean.float(), torch.rsqrt(var + 1e-5).float(), rand(c, seed=2).abs() + 0.5, rand(c, seed=3), res, relu,
            pack)
    for layout in (torch.channels_last, torch.contiguous_format):
        got, mask = triton_ops.batch_norm_apply(x.contiguous(memory_format=layout), *args)
        want = truth("batch_norm_apply", x, *args)[0]
        assert got.dtype == dtype and got.is_contiguous(memory_format=torch.channels_last)
        assert (mask is None) == (not (pack and relu and residual))
        if mask is not None:
            assert torch.equal(mask, reference._relu_mask(got)) and reference._relu_unmask(mask, shape)[0, 0, 0, 0]
        assert got[0, 0, 0, 0].isnan() and want[0, 0, 0, 0].isnan()
        got, want = got.double().flatten()[1:], want.flatten()[1:]
        tolerance = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        torch.testing.assert_close(got, want.to(dtype).double(), rtol=tolerance, atol=tolerance)
        if relu:
            assert (got >= 0).all() and (got == 0).float().mean() > 0.2


@pytest.mark.parametrize("normalize", [False, True], ids=["compiled-form", "eager"])
def test_a_resnet_with_the_batch_norm_kernels_keeps_its_forward_and_gradients(normalize):
    """BatchNorms with the kernels' statistics and backward, and the ReLUs and residual adds
    folded into them (torchvision's Bottleneck, BasicBlock and stem, the CIFAR ResNet's
    block), computed in float64 by the torch reference: the logits, every gradient, the
    running statistics and the evaluation output of the unchanged models; the normalization
    in torch ops (what inductor compiles) or the kernels' (eager training's, with
    ResNet-50's stem pool folded into its BatchNorm)."""
    import copy

    import torchvision

    from trainer.models import CifarResNet
    from trainer.norm import BatchNorm2d, use_batch_norm_kernels
    from trainer.pooling import use_max_pool_kernel
    torch.manual_seed(0)
    x = rand(4, 3, 48, 48).double()
    for model, count in ((torchvision.models.resnet50(num_classes=10), 53),
                         (torchvision.models.resnet18(num_classes=10), 20), (CifarResNet(8, 8, 10), 9)):
        plain = model.to(DEVICE, torch.float64)
        swapped = copy.deepcopy(plain)
        use_max_pool_kernel(swapped, reference)  # as set-up does first: the eager form folds the stem's into bn1
        assert use_batch_norm_kernels(swapped, reference, normalize) == count
        if count == 53:
            assert (swapped.bn1.pool is not None) == swapped.maxpool.folded == normalize
        fused = [m for m in swapped.modules() if type(m) is BatchNorm2d and m.relu]
        assert len(fused) == {53: 49, 20: 17, 9: 6}[count]
        outs = []
        for m in (plain, swapped):
            outs.append(m(x))
            outs[-1].square().sum().backward()
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-12)
        for (name, p), q in zip(plain.named_parameters(), swapped.parameters()):
            assert rel_err(q.grad, p.grad) < 1e-9, name
        for (name, p), q in zip(plain.named_buffers(), swapped.buffers()):
            assert rel_err(q, p) < 1e-10, name
        if count == 53:  # training with the stem's BatchNorm frozen (trainer.stem_norm_freeze_epochs)
            plain.bn1.eval(), swapped.bn1.eval()
            torch.testing.assert_close(swapped(x), plain(x), rtol=1e-10, atol=1e-12)
        plain.eval(), swapped.eval()
        torch.testing.assert_close(swapped(x), plain(x), rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(ON_GPU, reason="on a GPU tests/test_gpu.py compares the steps")
def test_a_resnet_steps_with_the_triton_batch_norm_as_with_atens():
    """Without compile the Triton kernels (Triton's interpreter here) normalize a ResNet's
    BatchNorms, add the residual and apply the ReLU, in the trainer's step; from one state
    and batch, that step gives kernels=torch's (ATen's BatchNorm): every gradient and
    moment, the running statistics. Only one step: a ReLU mask that flips at a rounding
    difference moves the next steps' gradients of a network this small by up to a percent."""
    from trainer.config import compose_config
    from trainer.regions import FAMILY
    from trainer.regions import Region as R
    from trainer.setup import assemble
    engines = [assemble(compose_config(["data.train_size=512", "data.val_size=128", "trainer.batch_size=32", "device=cpu",
                                        f"kernels={kernels}", "optimizer=momentum", "model=cifar_resnet20_narrow",
                                        "data.resolution=8"]), torch.device("cpu"))
               for kernels in ("torch", "triton")]
    assert engines[1].model.layers[0].bn2.normalize and not hasattr(engines[0].model.layers[0].bn2, "normalize")
    batch = torch.Generator().manual_seed(0)
    x = torch.randn(engines[0].programs["train_base", "A"].x.shape, generator=batch)
    y = torch.randint(0, 10, (32,), generator=batch)
    engines[1].arena.storage.copy_(engines[0].arena.storage)
    for engine in engines:
        program = engine.programs["train_base", "A"]
        program.x.copy_(x)
        program.y.copy_(y)
        program()
    plan = engines[0].plans.main
    for r in (*FAMILY["G"].values(), *FAMILY["M"].values(), R.B_NEXT_MEAN, R.B_NEXT_VAR):
        if plan.config.enabled(r) and plan.region_bytes(r):
            a, b = (engine.arena.flat(r, r).view(torch.float32) for engine in engines)
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=r.name)


def test_a_compiled_model_with_the_triton_batch_norm_moves_its_running_statistics():
    """Under compile the statistics kernel is a custom op that updates the running
    statistics in place: after two training steps of a compiled CIFAR ResNet with the
    Triton kernels, its logits and running statistics are the plain model's."""
    import copy

    from trainer.models import CifarResNet
    from trainer.norm import use_batch_norm_kernels
    torch.manual_seed(0)
    plain = CifarResNet(8, 8, 10).to(DEVICE).to(memory_format=torch.channels_last)
    swapped = copy.deepcopy(plain)
    use_batch_norm_kernels(swapped, triton_ops)
    compiled = torch.compile(swapped, dynamic=False)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # TF32 convolutions differ by 1e-4 and more
        for step in range(2):
            x = rand(4, 3, 16, 16, seed=step).to(memory_format=torch.channels_last)
            torch.testing.assert_close(compiled(x), plain(x), rtol=1e-4, atol=1e-4)
    for (name, want), got in zip(plain.named_buffers(), swapped.buffers()):
        if not name.endswith("num_batches_tracked"):
            assert rel_err(got, want.double()) < 1e-5, name


def test_a_compiled_model_moves_the_running_statistics_in_the_arena_in_place():
    """A model bound to the arena, its BatchNorms on the Triton kernels, compiled: the
    statistics op moves each BatchNorm's running mean and variance, two slots of the arena's
    one storage, in place. Passed as two mutated tensors, inductor moved only the first in
    place and, for the second, cloned the arena up to its slot and copied the slot back: two
    as_strided kernels a BatchNorm. After two steps B_NEXT holds nn.BatchNorm2d's
    statistics, and B_PREV is untouched."""
    import copy

    from torch._inductor.utils import run_and_get_code

    from tests.helpers import bound, small_cnn
    from trainer.norm import use_batch_norm_kernels
    from trainer.regions import Region as R
    plain = small_cnn(layers=3).to(DEVICE, memory_format=torch.channels_last)
    model = copy.deepcopy(plain)
    plans, arena, _ = bound(model, device=DEVICE)
    assert use_batch_norm_kernels(model, triton_ops) == 3
    prev = arena.flat(R.B_PREV_MEAN, R.B_PREV_VAR).clone()
    compiled = torch.compile(model, dynamic=False)
    batches = [rand(4, 3, 8, 8, seed=seed).to(memory_format=torch.channels_last) for seed in range(2)]
    step = lambda x: compiled(x).square().sum().backward()  # noqa: E731
    _, code = run_and_get_code(step, batches[0])  # it resets dynamo: one call only
    step(batches[1])
    for x in batches:
        plain(x)
    assert len(code) == 2 and "trainer.batch_norm_stats_.default" in code[0]
    assert not re.search(r"as_strided_(clone|copy)", code[0]), "the running statistics went through copies"
    norms = dict(plain.named_modules())
    for name, s in plans.tensors["train_base"].bn.items():
        for slot, want in ((s.next_mean, norms[name].running_mean), (s.next_var, norms[name].running_var)):
            torch.testing.assert_close(arena[slot], want, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(arena.flat(R.B_PREV_MEAN, R.B_PREV_VAR), prev)


def test_running_statistics_that_cannot_be_one_view_are_refused():
    """Slots of one storage that no (2, C) view covers (the variance before the mean) are
    refused: a copy would leave training moving statistics that evaluation never reads."""
    from trainer.errors import PlanError
    from trainer.norm import running_statistics
    bn, storage = torch.nn.BatchNorm2d(8), torch.zeros(16)
    bn.running_var, bn.running_mean = storage[:8], storage[8:]
    with pytest.raises(PlanError, match="after its running mean"):
        running_statistics(bn)


def test_folded_evaluation_keeps_a_fused_relu_and_pool():
    """fold_bn evaluates each BatchNorm as x * scale + bias: where the ReLU after it was
    folded into the BatchNorm, the folded forward applies it too, and so the stem's
    max-pool where eager training folds it into its BatchNorm."""
    import copy

    from trainer.binding import FoldedForward
    from trainer.models import CifarResNet, build_model
    from trainer.norm import use_batch_norm_kernels
    from trainer.pooling import use_max_pool_kernel
    torch.manual_seed(0)
    for plain, normalize in ((CifarResNet(8, 8, 10), False), (build_model("resnet18", 10), True)):
        plain = plain.to(DEVICE).eval()
        for bn in plain.modules():
            if isinstance(bn, torch.nn.BatchNorm2d):
                bn.running_mean.uniform_(-1, 1)  # some pre-activations negative: the ReLU matters
        swapped = copy.deepcopy(plain)
        use_max_pool_kernel(swapped, reference)
        use_batch_norm_kernels(swapped, reference, normalize)
        for model in (plain, swapped):
            for bn in model.modules():
                if isinstance(bn, torch.nn.BatchNorm2d):
                    scale = bn.weight.detach() * torch.rsqrt(bn.running_var + bn.eps)
                    bn.forward = FoldedForward(scale, bn.bias.detach() - bn.running_mean * scale,
                                               getattr(bn, "relu", False), getattr(bn, "pool", None))
        x = rand(2, 3, 32, 32)
        torch.testing.assert_close(swapped(x), plain(x))


@pytest.mark.skipif(not ON_GPU, reason="inductor compiles the model around the kernels for the GPU")
def test_the_batch_norm_kernels_inside_a_compiled_model():
    """Inductor calls the custom ops inside the compiled forward and backward: the logits
    and gradients of a compiled ResNet with the kernels' BatchNorms are the eager model's.
    Per tensor, in L2: a ReLU mask that flips at a rounding difference moves a few
    gradients of a network this small by up to 7% (seen with statistics 4e-8 apart)."""
    from trainer.norm import use_batch_norm_kernels
    plain, swapped, want, got = compiled_against_eager(use_batch_norm_kernels)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(plain.named_parameters(), swapped.parameters()):
        assert ((q.grad - p.grad).norm() / p.grad.norm()).item() < 2e-2, name


def test_every_reference_function_has_a_twin():
    public = {n for n, f in vars(reference).items() if callable(f) and not n.startswith("_")
              and f.__module__ == reference.__name__}
    assert public - set(vars(triton_ops)) == set()


def test_load(monkeypatch):
    cpu = torch.device("cpu")
    assert kernels.load("torch", cpu) is reference
    assert kernels.load("auto", cpu) is reference
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.load("triton", cpu) is triton_ops
    with pytest.raises(ConfigError, match="kernels="):
        kernels.load("cuda", cpu)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="CUDA device"):
        kernels.load("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(__import__("sys").modules, "triton", None)  # as if not installed
    with pytest.raises(ConfigError, match="not importable"):
        kernels.load("triton", cpu)
