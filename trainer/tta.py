"""Test-time augmentation: evaluation logits as a weighted average over views of a batch."""
import torch
from torch.nn import functional as F


def views(x: torch.Tensor, level: int) -> list[tuple[float, torch.Tensor]]:
    """level 0: the batch; 1: and its mirror image, half each; 2: half of that, and half
    the mirrored pairs of two one-pixel translations (up-left and down-right).

    Every view of levels 1 and 2, x included, comes in one channels-last layout (copied
    where it is not already): a compiled model specializes on strides, and the flipped
    and the translated views, or an input in another layout, would each compile a graph
    of their own. (The Program's input, the whole channel-padded slot, is channels-last
    already, so it is not copied.)"""
    if level == 0:
        return [(1.0, x)]
    alike = lambda v: v.contiguous(memory_format=torch.channels_last)
    mirrored = [(0.5, alike(x)), (0.5, alike(x.flip(-1)))]
    if level == 1:
        return mirrored
    h, w = x.shape[-2:]
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    shifted = [padded[..., :h, :w], padded[..., 2:h + 2, 2:w + 2]]
    return [(0.5 * a, v) for a, v in mirrored] + [(0.125, alike(v)) for s in shifted for v in (s, s.flip(-1))]


def logits(model, x: torch.Tensor, level: int) -> torch.Tensor:
    return sum(weight * model(v).float() for weight, v in views(x, level))
