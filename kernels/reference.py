"""Torch reference implementations of the range-op kernels.

Each works in place on flat tensors covering a whole region range, whatever the number
of parameters in it. Scalars (learning rate, decay, flags, step) are 1-element tensors
in device memory, so a captured graph reads their current values at every replay.
`skip` is the int8 overflow flag: when it is set the update leaves every byte as it was.
`g_scale`, where given, is the inverse loss scale: the gradients are then half precision
and still scaled (AMP's weight block), and the update unscales them in fp32 as it reads
them, so that no fp32 copy of them is ever written.
The Triton kernels in this package compute the same functions; tests hold them to these.
"""
import torch

CHUNK = 128  # fp32 slots are multiples of 512 bytes: a 128-element chunk never straddles two tensors
# a row of crop_flip_normalize_'s table: example, crop corner (dy, dx), flip, real, cutout corner (y, x), cutout side
TABLE_COLUMNS = 8


def _commit(skip: torch.Tensor, *pairs):
    """Write new values over old ones unless the step is skipped."""
    keep = skip.bool()
    for old, new in pairs:
        old.copy_(torch.where(keep, old, new))


def _unscaled(g, g_scale):
    return g if g_scale is None else g.to(torch.float32) * g_scale


def sgd_(w, g, m, lr, wd, momentum, skip, nesterov: bool, g_scale=None):
    """torch.optim.SGD: d = g + wd*w; m = mu*m + d; w -= lr*(d + mu*m if nesterov else m)."""
    d = _unscaled(g, g_scale) + wd * w
    if m is None:
        return _commit(skip, (w, w - lr * d))
    m_new = momentum * m + d
    step = d + momentum * m_new if nesterov else m_new
    _commit(skip, (w, w - lr * step), (m, m_new))


def adam_(w, g, m, v, lr, wd, beta1, beta2, eps, step, skip, decoupled: bool, g_scale=None):
    """torch.optim.Adam (L2 decay in the gradient) or AdamW (decoupled decay); `step` is
    the count of updates including this one."""
    t = step.to(torch.float32)
    g = _unscaled(g, g_scale)
    if decoupled:
        w_dec = w * (1 - lr * wd)
    else:
        w_dec, g = w, g + wd * w
    m_new = beta1 * m + (1 - beta1) * g
    v_new = beta2 * v + (1 - beta2) * g * g
    bias1, bias2 = 1 - beta1 ** t, 1 - beta2 ** t
    denom = v_new.sqrt() / bias2.sqrt() + eps
    _commit(skip, (w, w_dec - (lr / bias1) * m_new / denom), (m, m_new), (v, v_new))


def lars_norms_(w, g, norms, chunk_segment, g_scale=None):
    """Add each tensor's |w|^2 and |g|^2 into norms[:, 0] and norms[:, 1] (the N_ range as
    (tensors, 128)); chunk_segment maps each 128-element chunk of w to its tensor. Squares,
    so that the partial sums of a tensor's shards add up."""
    g = _unscaled(g, g_scale)
    norms[:, 0].index_add_(0, chunk_segment, w.view(-1, CHUNK).square().sum(1))
    norms[:, 1].index_add_(0, chunk_segment, g.view(-1, CHUNK).square().sum(1))


def lars_apply_(w, g, m, norms, chunk_segment, lr, wd, momentum, eta, skip, g_scale=None):
    """MLPerf LARS from the squared norms: per tensor trust = eta*|w| / (|g| + wd*|w|) (1
    where either norm is 0); m = mu*m + lr*trust*(g + wd*w); w -= m."""
    g = _unscaled(g, g_scale)
    wn, gn = norms[:, 0].sqrt(), norms[:, 1].sqrt()
    trust = torch.where((wn > 0) & (gn > 0), eta * wn / (gn + wd * wn), torch.ones_like(wn))
    scaled = (lr * trust)[chunk_segment].unsqueeze(1)  # per chunk
    m_new = momentum * m + (scaled * (g + wd * w).view(-1, CHUNK)).view(-1)
    _commit(skip, (w, w - m_new), (m, m_new))


def lars_(w, g, m, norms, chunk_segment, lr, wd, momentum, eta, skip, g_scale=None):
    """LARS on the weight block: the norms of every tensor, then the update."""
    norms[:, :2].zero_()
    lars_norms_(w, g, norms, chunk_segment, g_scale)
    lars_apply_(w, g, m, norms, chunk_segment, lr, wd, momentum, eta, skip, g_scale)


def lars_bias_(w, g, m, lr, wd, momentum, skip):
    """LARS's bias block: momentum with the learning rate inside, no trust ratio."""
    m_new = momentum * m + lr * (g + wd * w)
    _commit(skip, (w, w - m_new), (m, m_new))


def check_finite_(x, found):
    """found |= any element of x is not finite."""
    found.copy_(found | (~torch.isfinite(x).all()).to(found.dtype))


def unscale_(src, dst, inv_scale, found):
    """dst = src * inv_scale in fp32 (src may be dst, or its half twin); found |= any
    element of dst is not finite."""
    dst.copy_(src.to(torch.float32) * inv_scale)
    check_finite_(dst, found)


def cast_(src, dst):
    dst.copy_(src)


def ema_(e, w, decay):
    """e = decay*e + (1-decay)*w."""
    e.lerp_(w, 1 - decay)


def swap_(a, b):
    tmp = a.clone()
    a.copy_(b)
    b.copy_(tmp)


# -- input -------------------------------------------------------------------------------
def _reflect(i, size: int):
    """Indices past either edge mirrored back inside (the edge pixel not repeated)."""
    i = i.abs()
    return torch.where(i >= size, 2 * (size - 1) - i, i)


def crop_flip_normalize_(images, labels, table, mean, inv_std, out, out_label, out_mask):
    """A batch from resident uint8 images (n, H, W, 3), one row of `table` (example, dy, dx,
    flip, real, cut_y, cut_x, cut_size) per output image: out[b] = (the example's H x W crop
    at (dy, dx) of its reflect-padded self, mirrored where flip, minus mean) * inv_std, in
    out's dtype (b, H, W, C), then 0 (the mean) in the cut_size square at (cut_y, cut_x) of
    the output, clipped by its edges; channels past 3 are zero. out_label[b] =
    labels[example]; out_mask[b] = real (out_mask may be None)."""
    _, h, w, _ = images.shape
    idx, dy, dx, flip = table[:, 0], table[:, 1], table[:, 2], table[:, 3].bool()
    rows = _reflect(dy[:, None] + torch.arange(h, device=dy.device), h)
    cols = _reflect(dx[:, None] + torch.arange(w, device=dx.device), w)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    pixels = images[idx[:, None, None], rows[:, :, None], cols[:, None, :]]
    cut_y, cut_x, cut = table[:, 5, None], table[:, 6, None], table[:, 7, None]
    i, j = torch.arange(h, device=table.device), torch.arange(w, device=table.device)
    in_rows, in_cols = (i >= cut_y) & (i < cut_y + cut), (j >= cut_x) & (j < cut_x + cut)
    kept = ~(in_rows[:, :, None] & in_cols[:, None, :])
    out[..., :3].copy_(torch.where(kept[..., None], (pixels.float() - mean) * inv_std, 0.0))
    out[..., 3:].zero_()
    out_label.copy_(labels[idx])
    if out_mask is not None:
        out_mask.copy_(table[:, 4])


# -- model ops ---------------------------------------------------------------------------
def layout(channels_last: bool):
    """The memory format a channels_last flag names (the model ops take the flag: a custom
    op's schema has no memory-format type)."""
    return torch.channels_last if channels_last else torch.contiguous_format


def memory_format(x):
    """The layout max_pool2d gives its output: channels-last where x is (and not also plainly
    contiguous)."""
    return layout(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())


def _window_corners(oh, ow, stride, padding, device):
    """Each window's top row (oh, 1) and left column (ow,) in the input."""
    rows = torch.arange(oh, device=device).view(-1, 1) * stride[0] - padding[0]
    return rows, torch.arange(ow, device=device) * stride[1] - padding[1]


def max_pool(x, kernel, stride, padding):
    """max_pool2d(x, kernel, stride, padding) (no dilation, floor mode), and each window's
    maximum as its position in the window, kh * kernel[1] + kw: the first maximum in
    row-major order, as max_pool2d's indices, in one byte where those take eight. The
    positions are an int8 (N*OH*OW, C) matrix, not a 4-d tensor: inductor lays out 4-d
    tensors of a network with convolutions channels-last, and would copy them to and fro."""
    y, indices = torch.ops.aten.max_pool2d_with_indices(x, kernel, stride, padding)
    rows, cols = _window_corners(*y.shape[2:], stride, padding, x.device)
    width = x.shape[3]
    arg = (indices // width - rows) * kernel[1] + indices % width - cols
    return y, arg.to(torch.int8).permute(0, 2, 3, 1).reshape(-1, x.shape[1])


def max_pool_backward(grad_out, arg, input_shape, channels_last: bool, kernel, stride, padding, more=None):
    """The gradient of max_pool2d for an input of `input_shape` (channels-last or not) from
    grad_out and max_pool's positions: each input element gets the sum of grad_out over the
    windows whose maximum it is. `more`: a second gradient of the output, which a shortcut
    reading it hands over (trainer.norm), added to grad_out in their type, as autograd adds."""
    if more is not None:
        grad_out = grad_out + more
    n, c, oh, ow = grad_out.shape
    rows, cols = _window_corners(oh, ow, stride, padding, grad_out.device)
    arg = arg.view(n, oh, ow, c).permute(0, 3, 1, 2).long()
    indices = (rows + arg // kernel[1]) * input_shape[3] + cols + arg % kernel[1]
    like = grad_out.new_empty(()).expand(input_shape)  # ATen's backward reads only its shape
    dx = torch.ops.aten.max_pool2d_with_indices_backward(grad_out, like, kernel, stride, padding, [1, 1], False,
                                                         indices)
    return dx.contiguous(memory_format=layout(channels_last))


def _at_least_fp32(x):
    return x.to(torch.promote_types(x.dtype, torch.float32))


def batch_norm_stats_(x, running, momentum: float, eps: float):
    """BatchNorm's training statistics over (N, H, W): each channel's mean and inverse
    standard deviation 1 / sqrt(biased variance + eps), in fp32 (or x's wider type); and
    the running mean and variance, the rows of `running` (2, C), moved toward the batch's
    mean and unbiased variance by `momentum`, in place, as nn.BatchNorm2d moves them (one
    tensor: trainer.norm.running_statistics says why)."""
    count = x.numel() // x.shape[1]
    var, mean = torch.var_mean(_at_least_fp32(x), dim=(0, 2, 3), correction=0)
    running.lerp_(torch.stack((mean, var * (count / (count - 1)))).to(running.dtype), momentum)
    return mean, torch.rsqrt(var + eps)


def batch_norm_apply(x, mean, invstd, weight, bias, residual, relu: bool, pack_mask: bool):
    """Training-mode BatchNorm's output from the batch's statistics, x * scale + shift
    (scale = weight * invstd, shift = bias - mean * scale), plus `residual` where one is
    given, then a ReLU when `relu`: computed in fp32 (or x's wider type), rounded once to
    x's type, in x's layout. Returns it and, with pack_mask where the ReLU follows a
    residual add, its mask packed for backward (_relu_mask), else None."""
    shape = (1, -1, 1, 1)
    scale = (weight * invstd).view(shape)
    y = _at_least_fp32(x) * scale + (bias.view(shape) - mean.view(shape) * scale)
    if residual is not None:
        y = y + residual
    y = (torch.relu(y) if relu else y).to(x.dtype)
    return y, _relu_mask(y) if pack_mask and relu and residual is not None else None


def _relu_mask(y):
    """Which elements of a ReLU's output y pass its gradient (y > 0, or NaN, as
    threshold_backward passes them), packed 8 channels a byte: (N*H*W, ceil(C / 8)) uint8
    over y's channels-last rows, channel c at bit c % 8 of byte c // 8. A sixteenth of
    a half y's bytes, which backward reads in place of y."""
    rows = (~(y <= 0)).permute(0, 2, 3, 1).reshape(-1, y.shape[1])
    rows = torch.nn.functional.pad(rows, (0, -y.shape[1] % 8)).view(len(rows), -1, 8)
    bits = rows.to(torch.uint8) << torch.arange(8, dtype=torch.uint8, device=y.device)
    return bits.sum(-1, dtype=torch.uint8)


def _relu_unmask(mask, shape):
    """_relu_mask's bits as a bool tensor of `shape` (N, C, H, W)."""
    n, c, h, w = shape
    bits = (mask[..., None] >> torch.arange(8, dtype=torch.uint8, device=mask.device)) & 1
    return bits.view(len(mask), -1)[:, :c].reshape(n, h, w, c).permute(0, 3, 1, 2).bool()


def batch_norm_max_pool(x, mean, invstd, weight, bias, kernel, stride, padding):
    """max_pool of batch_norm_apply's output with the ReLU and no residual: the stem of an
    ImageNet ResNet, whose normalized activation only the pool reads."""
    return max_pool(batch_norm_apply(x, mean, invstd, weight, bias, None, True, False)[0], kernel, stride, padding)


def batch_norm_backward(grad_out, x, mean, invstd, weight, bias, relu: bool):
    """The gradients (x, weight, bias; fp32 for the two parameters) of training-mode
    BatchNorm, y = x * scale + shift with scale = weight * invstd and shift = bias - mean *
    scale from the batch's own statistics, followed by a ReLU when `relu`: the ReLU's mask
    is found again from x, so the forward pass keeps only x and the statistics."""
    x32, shape = _at_least_fp32(x), (1, -1, 1, 1)
    scale = (weight * invstd).view(shape)
    g = _at_least_fp32(grad_out)
    if relu:
        g = torch.where(x32 * scale + (bias.view(shape) - mean.view(shape) * scale) > 0, g, 0.0)
    xhat = (x32 - mean.view(shape)) * invstd.view(shape)
    count = x.numel() // x.shape[1]
    grad_bias, grad_weight = g.sum((0, 2, 3)), (g * xhat).sum((0, 2, 3))
    grad_x = scale * (g - (grad_bias.view(shape) + xhat * grad_weight.view(shape)) / count)
    return grad_x.to(x.dtype), grad_weight, grad_bias


def batch_norm_block_backward(grad_out, grad_shortcut, mask, x, mean, invstd, weight, bias, relu: bool):
    """batch_norm_backward for eager training's BatchNorm in a ResNet block (trainer.norm),
    whose output's gradient may come in two parts: grad_out, and grad_shortcut where the
    next block's identity shortcut hands its gradient back (or None), added in their type
    as autograd adds two gradients; and whose ReLU, where it follows the block's residual
    add, takes its mask from `mask`: the output y itself, or its mask as batch_norm_apply
    packs it (_relu_mask, uint8); zero where y <= 0, NaN passes, as threshold_backward on
    y. Returns batch_norm_backward's gradients and, fourth, the gradient at the residual
    add, which is the residual's: None where the ReLU comes right after the BatchNorm (relu
    and mask is None), so that there is no add. The caller gives up grad_shortcut: an
    implementation may write the result over it."""
    g = grad_out if grad_shortcut is None else grad_out + grad_shortcut
    if mask is not None and mask.dtype == torch.uint8:
        g = torch.where(_relu_unmask(mask, x.shape), g, 0)
    elif mask is not None:
        g = torch.ops.aten.threshold_backward(g, mask, 0)
    grad_x, grad_weight, grad_bias = batch_norm_backward(g, x, mean, invstd, weight, bias, relu and mask is None)
    return grad_x, grad_weight, grad_bias, None if relu and mask is None else g
