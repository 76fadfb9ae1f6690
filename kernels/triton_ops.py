"""Triton twins of kernels.reference: the same functions with the same signatures, each one
fused pass over a flat range (every input read once, every output written once; lars_
makes two: the per-tensor norms, then the update; under torch's deterministic mode the
norms are the reference's, whose sums keep a fixed order).

Scalars (learning rate, decay, betas, step, skip flag, ...) stay in device memory and are
loaded inside the kernels, so a captured CUDA graph replays with their current values.
Nothing here synchronizes with the host or allocates, so every function can be captured.
Set TRITON_INTERPRET=1 before importing this module to run it on CPU tensors.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.reference import CHUNK, TABLE_COLUMNS, layout, memory_format

# Memory-bound kernels: 4096 elements per program gives a 25.6M-element range 6250 programs
# (several waves on 132 SMs), and at 8 warps each thread moves 16 fp32 per tensor as four
# 16-byte accesses. One BLOCK for every kernel keeps compilations to one per kernel variant.
BLOCK = 4096
NUM_WARPS = 8
_CHUNK = tl.constexpr(CHUNK)
_FP32_MAX = tl.constexpr(3.4028234663852886e38)


# -- shared pieces ---------------------------------------------------------------------
@triton.jit
def _span(n, BLOCK: tl.constexpr):
    """This program's element offsets and their in-range mask."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return offs, offs < n


@triton.jit
def _chunk_tile(n, BLOCK: tl.constexpr):
    """This program's elements as a (chunks, CHUNK) tile, for kernels that work per chunk."""
    chunk = tl.program_id(0) * (BLOCK // _CHUNK) + tl.arange(0, BLOCK // _CHUNK)
    offs = chunk[:, None] * _CHUNK + tl.arange(0, _CHUNK)[None, :]
    return chunk, offs, offs < n


@triton.jit
def _live(skip_ptr):
    """False on a skipped step: every load and store is then masked off, so no byte changes."""
    return tl.load(skip_ptr) == 0


@triton.jit
def _grad(g_ptr, offs, mask, g_scale_ptr, G_SCALE: tl.constexpr):
    """The gradient in fp32 at unit scale: a half one under AMP is unscaled as it is read."""
    g = tl.load(g_ptr + offs, mask).to(tl.float32)
    if G_SCALE:
        g = g * tl.load(g_scale_ptr)
    return g


@triton.jit
def _pow(base, exponent):
    """base ** exponent for an integer exponent >= 0, by squaring in float64 so that the
    float32 result is as close as torch's pow (Adam's bias correction 1 - beta2**t cancels
    most of its leading digits at small t, so a few float32 roundings would show)."""
    b = base.to(tl.float64)
    result = tl.full((), 1.0, tl.float64)
    e = exponent
    while e > 0:
        result = tl.where((e & 1) == 1, result * b, result)
        b = b * b
        e = e >> 1
    return result.to(tl.float32)


def _or(pointer, unused):
    """A kernel's optional pointer, or a tensor it will not read in its place."""
    return unused if pointer is None else pointer


def _launch(kernel, n: int, *args, **constexprs):
    """One program per BLOCK elements. n stays a specialized argument: Triton then knows it
    is a multiple of 16 (every range is a multiple of CHUNK), which keeps masked accesses
    16 bytes wide, and since that holds for every range it adds no compilations."""
    if n == 0:  # a disabled region: nothing to do
        return
    assert n + BLOCK <= 2**31, "offsets are int32: a range must stay under 2**31 elements"
    kernel[(triton.cdiv(n, BLOCK),)](*args, n, BLOCK=BLOCK, num_warps=NUM_WARPS, **constexprs)


# -- optimizer updates -----------------------------------------------------------------
@triton.jit
def _sgd_kernel(w_ptr, g_ptr, m_ptr, lr_ptr, wd_ptr, mu_ptr, skip_ptr, g_scale_ptr, n,
                HAS_M: tl.constexpr, NESTEROV: tl.constexpr, G_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs, mask = _span(n, BLOCK)
    mask &= _live(skip_ptr)
    lr, wd = tl.load(lr_ptr), tl.load(wd_ptr)
    w = tl.load(w_ptr + offs, mask)
    d = _grad(g_ptr, offs, mask, g_scale_ptr, G_SCALE) + wd * w
    if HAS_M:
        mu = tl.load(mu_ptr)
        m = mu * tl.load(m_ptr + offs, mask) + d
        tl.store(m_ptr + offs, m, mask)
        if NESTEROV:
            d = d + mu * m
        else:
            d = m
    tl.store(w_ptr + offs, w - lr * d, mask)


def sgd_(w, g, m, lr, wd, momentum, skip, nesterov: bool, g_scale=None):
    has_m = m is not None
    _launch(_sgd_kernel, w.numel(), w, g, m if has_m else w, lr, wd, momentum, skip, _or(g_scale, lr),
            HAS_M=has_m, NESTEROV=has_m and nesterov, G_SCALE=g_scale is not None)


@triton.jit
def _adam_kernel(w_ptr, g_ptr, m_ptr, v_ptr, lr_ptr, wd_ptr, b1_ptr, b2_ptr, eps_ptr, step_ptr,
                 skip_ptr, g_scale_ptr, n, DECOUPLED: tl.constexpr, G_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs, mask = _span(n, BLOCK)
    mask &= _live(skip_ptr)
    lr, wd, b1, b2, eps = tl.load(lr_ptr), tl.load(wd_ptr), tl.load(b1_ptr), tl.load(b2_ptr), tl.load(eps_ptr)
    t = tl.load(step_ptr)
    # IEEE division and roots here and below, as torch computes them (Triton's defaults
    # approximate them and flush denormals)
    step_size = tl.div_rn(lr, 1 - _pow(b1, t))
    bias2_sqrt = tl.sqrt_rn(1 - _pow(b2, t))
    w = tl.load(w_ptr + offs, mask)
    g = _grad(g_ptr, offs, mask, g_scale_ptr, G_SCALE)
    if DECOUPLED:
        w = w * (1 - lr * wd)
    else:
        g = g + wd * w
    m = b1 * tl.load(m_ptr + offs, mask) + (1 - b1) * g
    v = b2 * tl.load(v_ptr + offs, mask) + (1 - b2) * g * g
    tl.store(m_ptr + offs, m, mask)
    tl.store(v_ptr + offs, v, mask)
    tl.store(w_ptr + offs, w - tl.div_rn(step_size * m, tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps), mask)


def adam_(w, g, m, v, lr, wd, beta1, beta2, eps, step, skip, decoupled: bool, g_scale=None):
    _launch(_adam_kernel, w.numel(), w, g, m, v, lr, wd, beta1, beta2, eps, step, skip, _or(g_scale, lr),
            DECOUPLED=decoupled, G_SCALE=g_scale is not None)


@triton.jit
def _lars_norms_kernel(w_ptr, g_ptr, norms_ptr, norms_stride, seg_ptr, g_scale_ptr, n, G_SCALE: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Adds |w|^2 and |g|^2 of this program's chunks into norms[segment, 0:2]. Chunks of one
    segment are summed here first, so a program issues one atomic per segment it touches,
    not one per chunk (a 2.4M-element conv would otherwise serialize 18K atomics on one word)."""
    CHUNKS: tl.constexpr = BLOCK // _CHUNK
    chunk, offs, mask = _chunk_tile(n, BLOCK)
    w = tl.load(w_ptr + offs, mask)
    g = _grad(g_ptr, offs, mask, g_scale_ptr, G_SCALE)
    seg = tl.load(seg_ptr + chunk, chunk * _CHUNK < n, other=-1)
    same = seg[:, None] == seg[None, :]
    w_sq = tl.sum(tl.where(same, tl.sum(w * w, 1)[None, :], 0.0), 1)
    g_sq = tl.sum(tl.where(same, tl.sum(g * g, 1)[None, :], 0.0), 1)
    index = tl.arange(0, CHUNKS)
    first = tl.min(tl.where(same, index[None, :], CHUNKS), 1) == index  # segment's first chunk here
    head = first & (seg >= 0)
    tl.atomic_add(norms_ptr + seg * norms_stride, w_sq, mask=head, sem="relaxed")
    tl.atomic_add(norms_ptr + seg * norms_stride + 1, g_sq, mask=head, sem="relaxed")


@triton.jit
def _lars_kernel(w_ptr, g_ptr, m_ptr, norms_ptr, norms_stride, seg_ptr, lr_ptr, wd_ptr, mu_ptr,
                 eta_ptr, skip_ptr, g_scale_ptr, n, TRUST: tl.constexpr, G_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """m = mu*m + lr*trust*(g + wd*w); w -= m, with one trust ratio per chunk from the
    squared norms (TRUST) or none (the bias block)."""
    chunk, offs, mask = _chunk_tile(n, BLOCK)
    mask &= _live(skip_ptr)
    lr, wd, mu = tl.load(lr_ptr), tl.load(wd_ptr), tl.load(mu_ptr)
    if TRUST:
        seg = tl.load(seg_ptr + chunk, chunk * _CHUNK < n, other=0)
        wn = tl.sqrt_rn(tl.load(norms_ptr + seg * norms_stride))
        gn = tl.sqrt_rn(tl.load(norms_ptr + seg * norms_stride + 1))
        use = (wn > 0) & (gn > 0)
        trust = tl.where(use, tl.div_rn(tl.load(eta_ptr) * wn, gn + wd * wn), 1.0)
        scaled = (lr * trust)[:, None]
    else:
        scaled = lr
    w = tl.load(w_ptr + offs, mask)
    g = _grad(g_ptr, offs, mask, g_scale_ptr, G_SCALE)
    m = mu * tl.load(m_ptr + offs, mask) + scaled * (g + wd * w)
    tl.store(m_ptr + offs, m, mask)
    tl.store(w_ptr + offs, w - m, mask)


def lars_norms_(w, g, norms, chunk_segment, g_scale=None):
    assert w.numel() == chunk_segment.numel() * CHUNK
    if torch.are_deterministic_algorithms_enabled():  # the atomics add in no fixed order
        return reference.lars_norms_(w, g, norms, chunk_segment, g_scale)
    _launch(_lars_norms_kernel, w.numel(), w, g, norms, norms.stride(0), chunk_segment, _or(g_scale, norms),
            G_SCALE=g_scale is not None)


def lars_apply_(w, g, m, norms, chunk_segment, lr, wd, momentum, eta, skip, g_scale=None):
    _launch(_lars_kernel, w.numel(), w, g, m, norms, norms.stride(0), chunk_segment,
            lr, wd, momentum, eta, skip, _or(g_scale, lr), TRUST=True, G_SCALE=g_scale is not None)


def lars_(w, g, m, norms, chunk_segment, lr, wd, momentum, eta, skip, g_scale=None):
    """Three launches: zero the norms, sum squares per segment, update."""
    norms[:, :2].zero_()
    lars_norms_(w, g, norms, chunk_segment, g_scale)
    lars_apply_(w, g, m, norms, chunk_segment, lr, wd, momentum, eta, skip, g_scale)


def lars_bias_(w, g, m, lr, wd, momentum, skip):
    # The pointers a bias update never reads (norms, segments, eta, g_scale) are filled with w and lr.
    _launch(_lars_kernel, w.numel(), w, g, m, w, 0, w, lr, wd, momentum, lr, skip, lr, TRUST=False, G_SCALE=False)


# -- loss scaling, casts, EMA ----------------------------------------------------------
@triton.jit
def _convert_kernel(src_ptr, dst_ptr, inv_scale_ptr, found_ptr, n, SCALE: tl.constexpr,
                    WRITE: tl.constexpr, CHECK: tl.constexpr, BLOCK: tl.constexpr):
    """dst = src (* inv_scale) in dst's type; with CHECK, found = 1 if any result is not finite."""
    offs, mask = _span(n, BLOCK)
    x = tl.load(src_ptr + offs, mask).to(tl.float32)
    if SCALE:
        x = x * tl.load(inv_scale_ptr)
    if WRITE:
        tl.store(dst_ptr + offs, x.to(dst_ptr.dtype.element_ty), mask)
    if CHECK:
        # inf exceeds the largest float; nan differs from itself
        bad = tl.max(((tl.abs(x) > _FP32_MAX) | (x != x)).to(tl.int32), 0) > 0
        # A plain store: int8 has no atomics, and every writer writes the same 1.
        tl.store(found_ptr, 1, mask=bad)


def check_finite_(x, found):
    _launch(_convert_kernel, x.numel(), x, x, found, found, SCALE=False, WRITE=False, CHECK=True)


def unscale_(src, dst, inv_scale, found):
    assert src.numel() == dst.numel() and dst.dtype == torch.float32
    _launch(_convert_kernel, dst.numel(), src, dst, inv_scale, found, SCALE=True, WRITE=True, CHECK=True)


def cast_(src, dst):
    assert src.numel() == dst.numel()
    _launch(_convert_kernel, dst.numel(), src, dst, dst, dst, SCALE=False, WRITE=True, CHECK=False)


@triton.jit
def _ema_kernel(e_ptr, w_ptr, decay_ptr, n, BLOCK: tl.constexpr):
    offs, mask = _span(n, BLOCK)
    weight = 1 - tl.load(decay_ptr)
    e = tl.load(e_ptr + offs, mask)
    w = tl.load(w_ptr + offs, mask)
    diff = w - e
    # torch.lerp's two-sided formula: e stays bit for bit when decay is 1 (a step without EMA)
    tl.store(e_ptr + offs, tl.where(tl.abs(weight) < 0.5, e + weight * diff, w - diff * (1 - weight)), mask)


def ema_(e, w, decay):
    _launch(_ema_kernel, e.numel(), e, w, decay)


@triton.jit
def _swap_kernel(a_ptr, b_ptr, n, BLOCK: tl.constexpr):
    offs, mask = _span(n, BLOCK)
    a = tl.load(a_ptr + offs, mask)
    b = tl.load(b_ptr + offs, mask)
    tl.store(a_ptr + offs, b, mask)
    tl.store(b_ptr + offs, a, mask)


def swap_(a, b):
    assert a.numel() == b.numel() and a.dtype == b.dtype
    _launch(_swap_kernel, a.numel(), a, b)


# -- input -------------------------------------------------------------------------------
@triton.jit
def _reflect(i, size):
    i = tl.abs(i)
    return tl.where(i >= size, 2 * (size - 1) - i, i)


@triton.jit
def _crop_flip_normalize_kernel(img_ptr, labels_ptr, table_ptr, mean_ptr, inv_std_ptr, out_ptr, label_ptr,
                                mask_ptr, H, W, C: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr,
                                ROW: tl.constexpr):
    """One program per image: its table row read once, then every pixel and channel. (A
    program per output row did 32x the table reads and scheduling for 32x less work each:
    0.1-0.3 ms for a CIFAR batch of 1024, beside a 3 ms step it slows.)"""
    b = tl.program_id(0)
    row = table_ptr + b * ROW
    example, dy, dx, flip = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    cut_y, cut_x, cut = tl.load(row + 5), tl.load(row + 6), tl.load(row + 7)
    p = tl.arange(0, BLOCK)
    i, j = p // W, p % W
    c = tl.arange(0, 4)
    y = _reflect(i + dy, H)
    x = _reflect(tl.where(flip != 0, W - 1 - j, j) + dx, W)
    inside = (p < H * W)[:, None]
    pixels = tl.load(img_ptr + ((example * H + y) * W + x)[:, None] * 3 + c[None, :],
                     mask=inside & (c[None, :] < 3), other=0).to(tl.float32)
    # channel 3 loads mean 0 and inv_std 0: the padding channel comes out 0
    mean = tl.load(mean_ptr + c, mask=c < 3, other=0.0)
    inv_std = tl.load(inv_std_ptr + c, mask=c < 3, other=0.0)
    value = (pixels - mean[None, :]) * inv_std[None, :]
    kept = ~((i >= cut_y) & (i < cut_y + cut) & (j >= cut_x) & (j < cut_x + cut))
    value = tl.where(kept[:, None], value, 0.0)
    tl.store(out_ptr + (b * H * W + p)[:, None] * C + c[None, :], value.to(out_ptr.dtype.element_ty),
             mask=inside & (c[None, :] < C))
    tl.store(label_ptr + b, tl.load(labels_ptr + example))
    if HAS_MASK:
        tl.store(mask_ptr + b, tl.load(row + 4))


def crop_flip_normalize_(images, labels, table, mean, inv_std, out, out_label, out_mask):
    """One launch for the whole batch (images, label, mask), instead of a dozen torch ops."""
    n, h, w, _ = images.shape
    assert out.shape[1:3] == (h, w) and out.shape[3] in (3, 4)
    assert images.is_contiguous() and out.is_contiguous() and table.is_contiguous() and table.shape[1] == TABLE_COLUMNS
    if len(table) == 0:
        return
    mask = out_mask if out_mask is not None else out_label
    _crop_flip_normalize_kernel[(len(table),)](images, labels, table, mean, inv_std, out, out_label, mask, h, w,
                                               C=out.shape[3], BLOCK=triton.next_power_of_2(h * w),
                                               HAS_MASK=out_mask is not None, ROW=TABLE_COLUMNS, num_warps=4)


# -- model ops ---------------------------------------------------------------------------
class PoolTiles(NamedTuple):
    """A max-pool program covers `pixels` pixels x `channels` channels; the channels are the
    fast axis of channels-last tensors, so each pixel's row is one wide access."""
    pixels: int
    channels: int
    warps: int

    def grid(self, n_pixels: int, c: int) -> tuple[int, int]:
        return triton.cdiv(n_pixels, self.pixels), triton.cdiv(c, self.channels)


# The fastest at ResNet-50 b256's stem on an H200 (bench/max_pool_sweep.py, docs/BENCHMARKS.md)
POOL_FORWARD = PoolTiles(pixels=16, channels=64, warps=8)
POOL_BACKWARD = PoolTiles(pixels=32, channels=64, warps=4)


@triton.jit
def _pool_tile(n_pixels, C, POOL_PIXELS: tl.constexpr, POOL_CHANNELS: tl.constexpr):
    p = tl.program_id(0) * POOL_PIXELS + tl.arange(0, POOL_PIXELS)
    c = tl.program_id(1) * POOL_CHANNELS + tl.arange(0, POOL_CHANNELS)
    return p, c, (p < n_pixels)[:, None] & (c < C)[None, :]


@triton.jit
def _scale_shift(mean_ptr, invstd_ptr, w_ptr, b_ptr, c, live):
    """BatchNorm's normalization as a per-channel affine map at channels c (0 where not
    live): scale = weight * invstd, shift = bias - mean * scale."""
    scale = tl.load(w_ptr + c, live, other=0.0) * tl.load(invstd_ptr + c, live, other=0.0)
    return scale, tl.load(b_ptr + c, live, other=0.0) - tl.load(mean_ptr + c, live, other=0.0) * scale


@triton.jit
def _max_pool_kernel(x_ptr, y_ptr, arg_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, n_out, C: tl.constexpr,
                     H: tl.constexpr, W: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr, XN: tl.constexpr,
                     XC: tl.constexpr, XH: tl.constexpr, XW: tl.constexpr, YN: tl.constexpr, YC: tl.constexpr,
                     YH: tl.constexpr, YW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr,
                     SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, NORMALIZE: tl.constexpr,
                     POOL_PIXELS: tl.constexpr, POOL_CHANNELS: tl.constexpr):
    """Each window's maximum, and its position in the window (kh * KW + kw) as int8, at row
    n * OH * OW + oh * OW + ow and column c of the positions. The scan keeps max_pool2d's
    rule: a value replaces the best so far when greater, or NaN; the first of equal maxima
    stays. Compared in fp32: exact for x in fp32 or narrower. With NORMALIZE, of BatchNorm's
    output from x and the ReLU's, each value rounded to x's type as _bn_normalize_kernel
    stores it, so that the maxima and their positions are those of the two passes."""
    p, c, live = _pool_tile(n_out, C, POOL_PIXELS, POOL_CHANNELS)
    n, oh, ow = p // (OH * OW), (p // OW) % OH, p % OW
    base = x_ptr + n[:, None].to(tl.int64) * XN + c[None, :] * XC
    best = tl.full((POOL_PIXELS, POOL_CHANNELS), float("-inf"), tl.float32)
    arg = tl.full((POOL_PIXELS, POOL_CHANNELS), 0, tl.int32)
    if NORMALIZE:
        scale, shift = _scale_shift(mean_ptr, invstd_ptr, w_ptr, b_ptr, c, c < C)
        scale, shift = scale[None, :], shift[None, :]
    for i in tl.static_range(KH):
        for j in tl.static_range(KW):
            h, w = oh * SH - PH + i, ow * SW - PW + j
            inside = live & ((h >= 0) & (h < H) & (w >= 0) & (w < W))[:, None]
            v = tl.load(base + (h * XH + w * XW)[:, None], inside, other=float("-inf")).to(tl.float32)
            if NORMALIZE:
                v = v * scale + shift
                v = tl.where(v < 0, 0.0, v).to(x_ptr.dtype.element_ty).to(tl.float32)
                v = tl.where(inside, v, float("-inf"))
            take = inside & ((v > best) | (v != v))
            best = tl.where(take, v, best)
            arg = tl.where(take, i * KW + j, arg)
    tl.store(y_ptr + (n.to(tl.int64) * YN + oh * YH + ow * YW)[:, None] + c[None, :] * YC,
             best.to(y_ptr.dtype.element_ty), live)
    tl.store(arg_ptr + p[:, None].to(tl.int64) * C + c[None, :], arg.to(tl.int8), live)


@triton.jit
def _max_pool_backward_kernel(g_ptr, more_ptr, arg_ptr, dx_ptr, n_in, C: tl.constexpr, H: tl.constexpr,
                              W: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr, XN: tl.constexpr,
                              XC: tl.constexpr, XH: tl.constexpr, XW: tl.constexpr, YN: tl.constexpr,
                              YC: tl.constexpr, YH: tl.constexpr, YW: tl.constexpr, MN: tl.constexpr,
                              MC: tl.constexpr, MH: tl.constexpr, MW: tl.constexpr, KH: tl.constexpr,
                              KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr,
                              PW: tl.constexpr, MORE: tl.constexpr, POOL_PIXELS: tl.constexpr,
                              POOL_CHANNELS: tl.constexpr):
    """Each input element's gradient (dx, strides X*): the sum, in fp32 and in increasing
    window order, of grad_out (strides Y*) over the windows whose maximum it is; with MORE,
    of grad_out plus the gradient at more_ptr (strides M*), added first in their type."""
    p, c, live = _pool_tile(n_in, C, POOL_PIXELS, POOL_CHANNELS)
    n, h, w = p // (H * W), (p // W) % H, p % W
    acc = tl.zeros((POOL_PIXELS, POOL_CHANNELS), tl.float32)
    # the windows over row h are oh in (h + PH - KH) // SH + 1 .. (h + PH) // SH: at most ceil(KH / SH)
    for a in tl.static_range((KH + SH - 1) // SH):
        oh = (h + PH) // SH - ((KH + SH - 1) // SH - 1) + a
        for b in tl.static_range((KW + SW - 1) // SW):
            ow = (w + PW) // SW - ((KW + SW - 1) // SW - 1) + b
            i, j = h + PH - oh * SH, w + PW - ow * SW  # the element's place in that window
            window = (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW) & (i < KH) & (j < KW)
            mask = live & window[:, None]
            o = (n * OH + oh) * OW + ow
            arg = tl.load(arg_ptr + o[:, None].to(tl.int64) * C + c[None, :], mask, other=-1)
            g = tl.load(g_ptr + (n.to(tl.int64) * YN + oh * YH + ow * YW)[:, None] + c[None, :] * YC, mask, other=0)
            if MORE:
                m = tl.load(more_ptr + (n.to(tl.int64) * MN + oh * MH + ow * MW)[:, None] + c[None, :] * MC, mask,
                            other=0)
                g = (g.to(tl.float32) + m.to(tl.float32)).to(g_ptr.dtype.element_ty)
            acc += tl.where(mask & (arg == (i * KW + j)[:, None]), g.to(tl.float32), 0.0)
    tl.store(dx_ptr + (n.to(tl.int64) * XN + h * XH + w * XW)[:, None] + c[None, :] * XC,
             acc.to(dx_ptr.dtype.element_ty), live)


def _shapes(x, y) -> dict:
    """The sizes and strides of a pool's input side x (or dx) and output side y (or
    grad_out), as the kernels' constants: one pool is one shape, and known strides let
    Triton prove its accesses wide and aligned."""
    return dict(C=x.shape[1], H=x.shape[2], W=x.shape[3], OH=y.shape[2], OW=y.shape[3],
                **dict(zip(("XN", "XC", "XH", "XW"), x.stride())), **dict(zip(("YN", "YC", "YH", "YW"), y.stride())))


def _window(kernel, stride, padding, tiles: PoolTiles) -> dict:
    assert max(kernel) <= 11 and len(kernel) == len(stride) == len(padding) == 2, "positions must fit in int8"
    return dict(KH=kernel[0], KW=kernel[1], SH=stride[0], SW=stride[1], PH=padding[0], PW=padding[1],
                POOL_PIXELS=tiles.pixels, POOL_CHANNELS=tiles.channels, num_warps=tiles.warps)


@torch.library.custom_op("trainer::max_pool", mutates_args=())
def max_pool(x: torch.Tensor, kernel: list[int], stride: list[int],
             padding: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.max_pool in one pass. A custom op, so that inductor calls it as it
    is: inductor's compile of the torch form was slower, alone and in the step
    (docs/BENCHMARKS.md)."""
    return _max_pool(x, None, kernel, stride, padding)


def batch_norm_max_pool(x, mean, invstd, weight, bias, kernel, stride, padding):
    """kernels.reference.batch_norm_max_pool in one pass over x: the normalized activation
    is never written, nor read back by the pool."""
    return _max_pool(x, (mean, invstd, *_fp32(weight, bias)), kernel, stride, padding)


def _max_pool(x, norm, kernel, stride, padding):
    y, arg = _pooled(x, kernel, stride, padding)
    if y.numel():
        _max_pool_kernel[POOL_FORWARD.grid(*arg.shape)](
            x, y, arg, *(norm or (x,) * 4), len(arg), **_shapes(x, y), NORMALIZE=norm is not None,
            **_window(kernel, stride, padding, POOL_FORWARD))
    return y, arg


@max_pool.register_fake
def _pooled(x, kernel, stride, padding):
    """Empty (y, positions): y in x's layout, as max_pool2d's output; the positions as
    kernels.reference.max_pool's, an (N*OH*OW, C) matrix."""
    n, c, h, w = x.shape
    oh, ow = ((size + 2 * p - k) // s + 1 for size, k, s, p in zip((h, w), kernel, stride, padding))
    y = torch.empty((n, c, oh, ow), dtype=x.dtype, device=x.device, memory_format=memory_format(x))
    return y, torch.empty((n * oh * ow, c), dtype=torch.int8, device=x.device)


@torch.library.custom_op("trainer::max_pool_backward", mutates_args=())
def max_pool_backward(grad_out: torch.Tensor, arg: torch.Tensor, input_shape: list[int], channels_last: bool,
                      kernel: list[int], stride: list[int], padding: list[int],
                      more: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.reference.max_pool_backward in one pass: every input element gathers
    grad_out (plus more) from the windows whose maximum it is."""
    dx = _max_pool_grad(grad_out, arg, input_shape, channels_last, kernel, stride, padding, more)
    if dx.numel():
        n, c, h, w = input_shape
        more_strides = (more if more is not None else grad_out).stride()
        _max_pool_backward_kernel[POOL_BACKWARD.grid(n * h * w, c)](
            grad_out, grad_out if more is None else more, arg, dx, n * h * w, **_shapes(dx, grad_out),
            **dict(zip(("MN", "MC", "MH", "MW"), more_strides)), MORE=more is not None,
            **_window(kernel, stride, padding, POOL_BACKWARD))
    return dx


@max_pool_backward.register_fake
def _max_pool_grad(grad_out, arg, input_shape, channels_last, kernel, stride, padding, more=None):
    return torch.empty(input_shape, dtype=grad_out.dtype, device=grad_out.device, memory_format=layout(channels_last))


# BatchNorm over channels-last activations, seen as the (rows = N*H*W, C) matrix of their
# layout, in tiles of `elements`, `channels` wide at most (64 fp16 channels: a tile row is
# one 128-byte access). A pass's program takes every num_programs(0)-th row tile of its
# channel block; a reduction program sums its tiles, and the last program of a channel
# block to finish adds up every program's partial sums, so each reduction is one launch
# of about `per_sm` programs per SM. The reductions go over the tiles from the last and
# the passes after them from the first, so that a pass after a reduction reads first the
# rows that the reduction read last, which L2 still holds. On two H200s that took
# ResNet-50 b256's step from 29.7 to 29.4 ms and from 30.35 to 30.05 ms; the mirror image
# (reductions from the first tile, the passes after them from the last) measured the same,
# and a reduction program over a stretch of rows with the pass after it back over that
# stretch 30.6 ms (docs/BENCHMARKS.md).
class BnTiles(NamedTuple):
    channels: int
    elements: int
    warps: int
    per_sm: int  # programs per SM (and channel block), each looping over row tiles
    stages: int  # tiles in flight through shared memory (Triton's loop pipelining)

    def block(self, c: int) -> tuple[int, int]:
        """(rows, channels) of a tile over c channels."""
        block_c = min(self.channels, max(16, triton.next_power_of_2(c)))
        return self.elements // block_c, block_c

    def grid(self, x_rows: torch.Tensor) -> tuple[int, int, int, int]:
        """(rows, channels) of a tile, programs per channel block and channel blocks over the
        (rows, C) matrix x_rows: per_sm programs per SM in all, fewer where there are fewer tiles."""
        block_r, block_c = self.block(x_rows.shape[1])
        blocks = triton.cdiv(x_rows.shape[1], block_c)
        return block_r, block_c, max(1, min(triton.cdiv(len(x_rows), block_r), self.per_sm * _sms(x_rows) // blocks)), blocks


# Each pass's tiles, the fastest single choice over ResNet-50 b256's 53 BatchNorms on an
# H200 (bench/batch_norm_sweep.py, docs/BENCHMARKS.md). Every pass loops over tiles whose
# loads go through shared memory 3 to 5 tiles ahead: without that, a pass waiting for each
# tile moved 6-20% fewer bytes a second.
BN_STATS = BnTiles(channels=64, elements=4096, warps=4, per_sm=2, stages=5)
BN_SUMS = BnTiles(channels=64, elements=4096, warps=4, per_sm=2, stages=3)
BN_GRADIENT = BnTiles(channels=128, elements=4096, warps=8, per_sm=2, stages=3)
# the normalization pass (eager training) reads one or two tensors and writes one, as the
# gradient pass does: its tiles, not swept on their own
BN_NORMALIZE = BN_GRADIENT


@triton.jit
def _mask_bytes(r, live_r, cb, C, BLOCK_C: tl.constexpr):
    """Where the bytes of a packed ReLU mask (kernels.reference._relu_mask) for rows r and
    channel block cb lie, and which of them exist."""
    j = cb * (BLOCK_C // 8) + tl.arange(0, BLOCK_C // 8)
    width = (C + 7) // 8
    return r.to(tl.int64)[:, None] * width + j[None, :], live_r[:, None] & (j < width)[None, :]


@triton.jit
def _pack(mask_ptr, keep, r, live_r, cb, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Store keep, a (BLOCK_R, BLOCK_C) tile of 0s and 1s, 8 channels a byte."""
    offs, live = _mask_bytes(r, live_r, cb, C, BLOCK_C)
    bits = tl.reshape(keep.to(tl.int32), (BLOCK_R, BLOCK_C // 8, 8)) << tl.arange(0, 8)[None, None, :]
    tl.store(mask_ptr + offs, tl.sum(bits, 2).to(tl.uint8), live)


@triton.jit
def _unpacked(mask_ptr, r, live_r, cb, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The (BLOCK_R, BLOCK_C) tile of a packed ReLU mask, True where the gradient passes."""
    offs, live = _mask_bytes(r, live_r, cb, C, BLOCK_C)
    packed = tl.load(mask_ptr + offs, live, other=0).to(tl.int32)
    return tl.reshape((packed[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1, (BLOCK_R, BLOCK_C)) != 0


@triton.jit
def _bn_reduce_kernel(x_ptr, g_ptr, more_ptr, mask_ptr, dz_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, part_ptr,
                      count_ptr, out1_ptr, out2_ptr, M, C, HW, programs, momentum, eps, BACKWARD: tl.constexpr,
                      RELU: tl.constexpr, MORE: tl.constexpr, MASK: tl.constexpr, PER_IMAGE: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr):
    """Per channel, over the rows. Forward: the sums of x - x[0] and of its square (shifted
    by the first row, against cancellation), finished as the mean and the inverse standard
    deviation, and the running mean and variance (at mean_ptr and invstd_ptr) moved toward
    the batch's by momentum. Backward: the sums of dz and of dz * (x - mean), finished as
    the bias's and the weight's gradients; dz is grad_out (one row per image of HW rows
    when PER_IMAGE: a mean-pool's gradient; plus the gradient at more_ptr when MORE,
    rounded to grad_out's type as autograd adds two) where the ReLU passed it: after a
    residual add by the output's mask at mask_ptr, packed (MASK "packed") or as the output
    itself (MASK "output", where y <= 0 stops it, NaN passes, as in threshold_backward),
    else by x when RELU. With MORE or a MASK, dz is stored at dz_ptr, for the gradient pass
    and the residual.
    Program i sums the row tiles last - i, last - i - programs, ... (BnTiles says why)."""
    i, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    live = c < C
    if BACKWARD:
        center = tl.load(mean_ptr + c, live, other=0.0)
        invstd = tl.load(invstd_ptr + c, live, other=0.0)
        scale = tl.load(w_ptr + c, live, other=0.0) * invstd
        shift = tl.load(b_ptr + c, live, other=0.0) - center * scale
    else:
        center = tl.load(x_ptr + c, live, other=0.0).to(tl.float32)
    acc1 = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    acc2 = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    last = tl.cdiv(M, BLOCK_R) - 1
    for t in tl.range(i, last + 1, programs, num_stages=STAGES):
        r = (last - t) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (r < M)[:, None] & live[None, :]
        offs = r.to(tl.int64)[:, None] * C + c[None, :]
        x = tl.load(x_ptr + offs, mask, other=0.0).to(tl.float32)
        xc = tl.where(mask, x - center[None, :], 0.0)
        if BACKWARD:
            if PER_IMAGE:
                g = tl.load(g_ptr + (r // HW).to(tl.int64)[:, None] * C + c[None, :], mask, other=0.0)
            else:
                g = tl.load(g_ptr + offs, mask, other=0.0)
            g = g.to(tl.float32)
            if MORE:
                g = (g + tl.load(more_ptr + offs, mask, other=0.0).to(tl.float32)).to(g_ptr.dtype.element_ty)
                g = g.to(tl.float32)
            if MASK == "packed":
                g = tl.where(_unpacked(mask_ptr, r, r < M, cb, C, BLOCK_R, BLOCK_C), g, 0.0)
            elif MASK == "output":
                g = tl.where(tl.load(mask_ptr + offs, mask, other=0.0) <= 0, 0.0, g)
            elif RELU:
                g = tl.where(x * scale[None, :] + shift[None, :] > 0, g, 0.0)
            if MORE or MASK != "":
                tl.store(dz_ptr + offs, g.to(dz_ptr.dtype.element_ty), mask)
            acc1 += g
            acc2 += g * xc
        else:
            acc1 += xc
            acc2 += xc * xc
    tl.store(part_ptr + 2 * i * C + c, tl.sum(acc1, 0), live)
    tl.store(part_ptr + (2 * i + 1) * C + c, tl.sum(acc2, 0), live)
    tl.debug_barrier()  # every thread's partial sums are stored before the count moves
    if tl.atomic_add(count_ptr + cb, 1, sem="acq_rel") == programs - 1:
        t1 = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
        t2 = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
        for p0 in range(0, programs, BLOCK_R):
            p = p0 + tl.arange(0, BLOCK_R)
            mask = (p < programs)[:, None] & live[None, :]
            offs = (2 * p)[:, None] * C + c[None, :]
            # from L2: other SMs wrote these
            t1 += tl.load(part_ptr + offs, mask, other=0.0, cache_modifier=".cg")
            t2 += tl.load(part_ptr + offs + C, mask, other=0.0, cache_modifier=".cg")
        sum1, sum2 = tl.sum(t1, 0), tl.sum(t2, 0)
        if BACKWARD:
            tl.store(out1_ptr + c, sum1, live)
            tl.store(out2_ptr + c, sum2 * invstd, live)
        else:
            d = sum1 / M
            mean = center + d
            var = tl.maximum(sum2 / M - d * d, 0.0)
            tl.store(out1_ptr + c, mean, live)
            tl.store(out2_ptr + c, 1.0 / tl.sqrt(var + eps), live)
            # the running statistics, as nn.BatchNorm2d moves them: toward the unbiased variance
            running_mean = tl.load(mean_ptr + c, live)
            running_var = tl.load(invstd_ptr + c, live)
            tl.store(mean_ptr + c, running_mean + momentum * (mean - running_mean), live)
            tl.store(invstd_ptr + c, running_var + momentum * (var * (M / (M - 1.0)) - running_var), live)
        tl.store(count_ptr + cb, 0)  # every other program has counted: ready for the next launch


@triton.jit
def _bn_backward_apply_kernel(x_ptr, g_ptr, dx_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, dbias_ptr, dweight_ptr,
                              M, C, RELU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                              STAGES: tl.constexpr):
    """dx = scale * (dz - (sum dz + xhat * sum dz*xhat) / M), xhat = (x - mean) * invstd,
    over every num_programs(0)-th row tile from program_id(0) on."""
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = c < C
    mean = tl.load(mean_ptr + c, live, other=0.0)[None, :]
    invstd = tl.load(invstd_ptr + c, live, other=0.0)[None, :]
    scale = tl.load(w_ptr + c, live, other=0.0)[None, :] * invstd
    shift = tl.load(b_ptr + c, live, other=0.0)[None, :] - mean * scale
    dbias = tl.load(dbias_ptr + c, live, other=0.0)[None, :]
    dweight = tl.load(dweight_ptr + c, live, other=0.0)[None, :]
    for t in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_R), tl.num_programs(0), num_stages=STAGES):
        r = t * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (r < M)[:, None] & live[None, :]
        offs = r.to(tl.int64)[:, None] * C + c[None, :]
        x = tl.load(x_ptr + offs, mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask, other=0.0).to(tl.float32)
        if RELU:
            g = tl.where(x * scale + shift > 0, g, 0.0)
        xhat = (x - mean) * invstd
        tl.store(dx_ptr + offs, (scale * (g - (dbias + xhat * dweight) / M)).to(dx_ptr.dtype.element_ty), mask)


@triton.jit
def _bn_normalize_kernel(x_ptr, r_ptr, y_ptr, mask_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, M, C,
                         RESIDUAL: tl.constexpr, RELU: tl.constexpr, MASK: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_C: tl.constexpr, STAGES: tl.constexpr):
    """y = x * scale + shift (+ r), then max(y, 0) when RELU (NaN stays NaN, as torch.relu
    keeps it), and with MASK y's packed ReLU mask at mask_ptr, over every num_programs(0)-th
    row tile from program_id(0) on."""
    cb = tl.program_id(1)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    live = c < C
    scale, shift = _scale_shift(mean_ptr, invstd_ptr, w_ptr, b_ptr, c, live)
    scale, shift = scale[None, :], shift[None, :]
    for t in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_R), tl.num_programs(0), num_stages=STAGES):
        r = t * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (r < M)[:, None] & live[None, :]
        offs = r.to(tl.int64)[:, None] * C + c[None, :]
        y = tl.load(x_ptr + offs, mask, other=0.0).to(tl.float32) * scale + shift
        if RESIDUAL:
            y += tl.load(r_ptr + offs, mask, other=0.0).to(tl.float32)
        if RELU:
            y = tl.where(y < 0, 0.0, y)
        y = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs, y, mask)
        if MASK:  # of y as stored, as threshold_backward would read it
            _pack(mask_ptr, tl.where(y <= 0, 0, 1), r, r < M, cb, C, BLOCK_R, BLOCK_C)


def _fp32(*params: torch.Tensor) -> list[torch.Tensor]:
    """BatchNorm's weight and bias as the kernels read them: fp32, contiguous."""
    return [p.float().contiguous() for p in params]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) as the (N*H*W, C) matrix of its channels-last layout (a view)."""
    return x.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).reshape(-1, x.shape[1])


def _sms(x: torch.Tensor) -> int:
    """The device's SMs (a CPU under Triton's interpreter: 4)."""
    return torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4


_COUNTERS: dict[torch.device, torch.Tensor] = {}
BN_MAX_BLOCKS = 4096  # channel blocks a reduction may have: 262,144 channels at 64 a block


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The device's reduction counters, zeros between launches: each launch's last programs
    set theirs back. Kept rather than zeroed per launch, which in a step of 53 BatchNorms
    would be 106 more kernels; one stream runs the reductions, one at a time. Made once at
    their largest: captured graphs keep their address."""
    if n > BN_MAX_BLOCKS:
        raise ValueError(f"BatchNorm over {n} channel blocks: the kernels count at most {BN_MAX_BLOCKS}")
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(BN_MAX_BLOCKS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def _mask_kind(mask) -> str:
    """How _bn_reduce_kernel reads the ReLU's mask: "" (none), "packed" or "output"."""
    return "" if mask is None else "packed" if mask.dtype == torch.uint8 else "output"


def _bn_reduce(x_rows, g_rows, mean, invstd, weight, bias, out1, out2, relu: bool, backward: bool,
               momentum: float = 0.0, eps: float = 0.0, more_rows=None, mask=None, dz_rows=None):
    """One launch of _bn_reduce_kernel, each program over every programs-th tile. The
    forward pass passes the running mean and variance as mean and invstd, and None for what
    only backward reads; backward passes dz_rows where it has more_rows or a mask (the
    packed mask, uint8, or the output's rows), and g_rows with a row per image where the
    gradient is a mean-pool's."""
    m, c = x_rows.shape
    tiles = BN_SUMS if backward else BN_STATS
    block_r, block_c, programs, blocks = tiles.grid(x_rows)
    part = torch.empty((programs, 2, c), dtype=torch.float32, device=x_rows.device)
    count = _counters(x_rows.device, blocks)
    per_image = g_rows is not None and len(g_rows) != m
    _bn_reduce_kernel[(programs, blocks)](x_rows, *(_or(t, x_rows) for t in (g_rows, more_rows, mask, dz_rows)),
                                          mean, invstd, *(_or(t, out1) for t in (weight, bias)),
                                          part, count, out1, out2, m, c, m // len(g_rows) if per_image else 1,
                                          programs, momentum, eps, BACKWARD=backward, RELU=relu,
                                          MORE=more_rows is not None, MASK=_mask_kind(mask), PER_IMAGE=per_image,
                                          BLOCK_R=block_r, BLOCK_C=block_c, STAGES=tiles.stages,
                                          num_warps=tiles.warps)


@torch.library.custom_op("trainer::batch_norm_stats_", mutates_args=("running",))
def batch_norm_stats_(x: torch.Tensor, running: torch.Tensor, momentum: float, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.batch_norm_stats_ in one pass over x, the running statistics moved
    by the last program of each channel block: no kernels of their own. Under compile=true
    inductor calls it in place on the running statistics (a mutating custom op), one tensor
    (trainer.norm.running_statistics says why)."""
    if running.dtype != torch.float32 or running.stride(1) != 1:
        raise TypeError("the BatchNorm kernels update fp32 running statistics with contiguous rows")
    rows = _rows(x)
    mean = torch.empty(x.shape[1], dtype=torch.float32, device=x.device)
    invstd = torch.empty_like(mean)
    _bn_reduce(rows, None, running[0], running[1], None, None, mean, invstd, relu=False, backward=False,
               momentum=momentum, eps=eps)
    return mean, invstd


@batch_norm_stats_.register_fake
def _(x, running, momentum, eps):
    return x.new_empty(x.shape[1], dtype=torch.float32), x.new_empty(x.shape[1], dtype=torch.float32)


def batch_norm_apply(x, mean, invstd, weight, bias, residual, relu: bool, pack_mask: bool):
    """kernels.reference.batch_norm_apply in one pass over x (and the residual), with
    pack_mask the ReLU's mask packed in the same pass; the output is channels-last. Eager
    training's normalization: inductor fuses its own."""
    x_rows = _rows(x)
    y = torch.empty_like(x, memory_format=torch.channels_last)
    mask = (torch.empty((len(x_rows), triton.cdiv(x.shape[1], 8)), dtype=torch.uint8, device=x.device)
            if pack_mask and relu and residual is not None else None)
    block_r, block_c, programs, blocks = BN_NORMALIZE.grid(x_rows)
    _bn_normalize_kernel[(programs, blocks)](
        x_rows, x_rows if residual is None else _rows(residual), _rows(y), _or(mask, x_rows), mean, invstd,
        *_fp32(weight, bias), len(x_rows), x.shape[1], RESIDUAL=residual is not None, RELU=relu,
        MASK=mask is not None, BLOCK_R=block_r, BLOCK_C=block_c, STAGES=BN_NORMALIZE.stages,
        num_warps=BN_NORMALIZE.warps)
    return y, mask


@torch.library.custom_op("trainer::batch_norm_backward", mutates_args=())
def batch_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                        weight: torch.Tensor, bias: torch.Tensor, relu: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.reference.batch_norm_backward in two passes over x and grad_out: the sums,
    then the input's gradient. A custom op, so that inductor calls it as it is inside a
    compiled backward."""
    return _backward(grad_out, None, None, x, mean, invstd, weight, bias, relu)[:3]


def batch_norm_block_backward(grad_out, grad_shortcut, mask, x, mean, invstd, weight, bias, relu: bool):
    """kernels.reference.batch_norm_block_backward in batch_norm_backward's two passes: the
    first adds grad_shortcut, applies the mask (packed, or the output) and keeps the result,
    which the second reads in place of grad_out; where there is nothing to add or mask,
    batch_norm_backward's.
    The result goes over grad_shortcut (channels-last), which the caller gives up: one
    tensor fewer alive, where backward's memory peaks. A mean-pool's gradient, broadcast
    over (H, W), is read as it is, a value per image and channel: no copy of it either."""
    grad_x, grad_weight, grad_bias, grad_z = _backward(grad_out, grad_shortcut, mask, x, mean, invstd, weight, bias,
                                                       relu)
    return grad_x, grad_weight, grad_bias, None if relu and mask is None else grad_z


def _backward(grad_out, grad_shortcut, mask, x, mean, invstd, weight, bias, relu: bool):
    x_rows = _rows(x)
    # read per image only where the first pass stores dz whole (a mask), for the second to read
    broadcast = mask is not None and grad_shortcut is None and grad_out.stride(2) == grad_out.stride(3) == 0
    g_rows = grad_out[:, :, 0, 0].contiguous() if broadcast else _rows(grad_out)
    grad_x = torch.empty_like(x, memory_format=torch.channels_last)
    grad_weight = torch.empty(x.shape[1], dtype=torch.float32, device=x.device)
    grad_bias = torch.empty_like(grad_weight)
    weight, bias = _fp32(weight, bias)
    kept = grad_shortcut is not None or mask is not None  # the first pass stores dz
    if grad_shortcut is not None:
        grad_z = grad_shortcut.contiguous(memory_format=torch.channels_last)
    else:
        grad_z = torch.empty_like(x, dtype=grad_out.dtype, memory_format=torch.channels_last) if kept else grad_out
    z_rows = _rows(grad_z) if kept else g_rows
    _bn_reduce(x_rows, g_rows, mean, invstd, weight, bias, grad_bias, grad_weight, relu=relu and mask is None,
               backward=True, more_rows=None if grad_shortcut is None else z_rows,
               mask=mask if _mask_kind(mask) != "output" else _rows(mask), dz_rows=z_rows if kept else None)
    block_r, block_c, programs, blocks = BN_GRADIENT.grid(x_rows)
    _bn_backward_apply_kernel[(programs, blocks)](
        x_rows, z_rows, _rows(grad_x), mean, invstd, weight, bias, grad_bias, grad_weight, len(x_rows),
        x.shape[1], RELU=relu and not kept, BLOCK_R=block_r, BLOCK_C=block_c, STAGES=BN_GRADIENT.stages,
        num_warps=BN_GRADIENT.warps)
    return grad_x, grad_weight, grad_bias, grad_z


@batch_norm_backward.register_fake
def _(grad_out, x, mean, invstd, weight, bias, relu):
    channels = x.new_empty(x.shape[1], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.channels_last), channels, torch.empty_like(channels)
