"""Cross-entropy with label smoothing as one op that also writes the gradient of the
logits (pre-scaled for loss scaling) and the batch's metrics, so backward starts from a
gradient slot in the arena and the loss itself never enters autograd."""
import torch


def cross_entropy_(logits: torch.Tensor, labels: torch.Tensor, smoothing: float, results: tuple,
                   grad_out: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None, nan_seen: torch.Tensor | None = None,
                   sums: torch.Tensor | None = None):
    """results: the (loss, top1, top5) 1-element tensors to write, means over the batch
    (over mask==1 examples when a mask is given). grad_out receives
    d(mean loss)/d(logits) * grad_scale. nan_seen (int8) is raised when the loss is not finite.
    sums (ACCUM_METRICS): the epoch's (loss, top-1 hits, top-5 hits, examples), to which
    this batch's are added. Hits are added as counts, so an epoch's accuracy, read on the
    host as hits / examples, is exact: from means times counts, 14 hits of 14 read
    1.0000001. They are counted here, before a distributed step averages results over ranks."""
    x = logits.detach().float()
    n, k = x.shape
    labels = labels.long()
    logp = torch.log_softmax(x, dim=1)
    nll = -logp.gather(1, labels[:, None]).squeeze(1)
    per_example = (1 - smoothing) * nll - smoothing * logp.mean(1)
    hits = torch.topk(x, min(5, k), dim=1).indices == labels[:, None]
    top1, top5 = hits[:, 0].float(), hits.any(1).float()
    counted = torch.ones_like(top1) if mask is None else mask.float()
    weight = counted / counted.sum().clamp(min=1)
    # summed, not a matmul, which may round its inputs to TF32. fp32 counts are exact
    # integers up to 2**24 (16.7M) examples an epoch, all ranks together: ImageNet's
    # 1.28M training images are well inside.
    batch = (torch.stack([per_example, top1, top5, counted]) * counted).sum(1)
    loss, acc1, acc5 = results
    loss.copy_((per_example * weight).sum().reshape(1))
    acc1.copy_(batch[1:2] / batch[3].clamp(min=1))
    acc5.copy_(batch[2:3] / batch[3].clamp(min=1))
    if sums is not None:
        sums.add_(batch)
    if grad_out is not None:
        target = torch.full_like(x, smoothing / k).scatter_add_(
            1, labels[:, None], torch.full((n, 1), 1 - smoothing, device=x.device))
        grad = (logp.exp() - target) * weight[:, None]
        grad_out.copy_(grad * grad_scale if grad_scale is not None else grad)
    if nan_seen is not None:
        nan_seen.copy_(nan_seen | (~torch.isfinite(loss)).to(nan_seen.dtype))
