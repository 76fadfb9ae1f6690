"""UPDATE_WEIGHT_MUON: Muon (momentum orthogonalized by Newton-Schulz) for the deep convs.

Each deep conv's momentum, as a (out channels) x (kh kw in) matrix, is replaced by about
the nearest semi-orthogonal matrix (its singular values end up between about 0.5 and 1.5),
so every direction of the filter bank moves by about the same amount whatever the
gradient's scale. As in the CIFAR-10 speedrun with Muon (airbench94_muon), the filters are first
renormalized to Frobenius norm sqrt(out channels): with a BatchNorm after each conv the
loss does not depend on the filters' scale, and a fixed scale keeps the step size
meaningful without weight decay.

All the convs go through one batched iteration: their matrices are stacked into one
zero-padded (tensors, rows, cols) tensor, since padding rows and columns with zeros leaves
the iteration's result on the original block exactly as it was.
"""
import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: steep at 0, fast over accurate


def orthogonalize(x: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """Newton-Schulz iteration over a batch of wide matrices (rows <= cols), in bfloat16 as
    torch.optim.Muon does: the iteration tolerates its rounding."""
    a, b, c = NS_COEFFICIENTS
    x = x.bfloat16()
    x = x / (torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True) + eps)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


class MuonUpdate:
    """The update of the deep-conv block, bound to its flat W, G and M spans (the same
    offsets in each) and the place of every tensor in them."""

    def __init__(self, w: torch.Tensor, g: torch.Tensor, m: torch.Tensor,
                 tensors: list[tuple[int, int, int]], steps: int):
        """tensors: (start element, out channels, kh*kw*in) of each conv in the spans."""
        self.w, self.g, self.m, self.steps = w, g, m, steps
        self.shapes = [(rows, cols) for _, rows, cols in tensors]
        self.views = [(start, rows * cols) for start, rows, cols in tensors]
        short = max(min(s) for s in self.shapes)
        self.stack_shape = (len(tensors), short, max(max(s) for s in self.shapes))
        self.target_norm = torch.tensor([math.sqrt(rows) for rows, _ in self.shapes], device=w.device)

    def _matrices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[start:start + n].view(shape) for (start, n), shape in zip(self.views, self.shapes)]

    def __call__(self, lr: torch.Tensor, momentum: torch.Tensor, skip: torch.Tensor,
                 g_scale: torch.Tensor | None = None):
        """Nesterov momentum m = mu*m + g, u = g + mu*m; w = w * sqrt(out)/|w| - lr * NS(u).
        A skipped step (overflow) leaves every byte as it was. With g_scale the gradients are
        half precision and scaled (AMP), and are unscaled in fp32 here."""
        keep = skip.bool().logical_not()
        g = self.g if g_scale is None else self.g.float() * g_scale
        self.m.copy_(torch.where(keep, momentum * self.m + g, self.m))
        u = self._matrices(g + momentum * self.m)
        stack = torch.zeros(self.stack_shape, dtype=torch.bfloat16, device=self.w.device)
        for i, x in enumerate(u):  # wide side last
            x = x if x.shape[0] <= x.shape[1] else x.T
            stack[i, :x.shape[0], :x.shape[1]] = x
        # where, not a product: a skipped step's gradients hold inf, which orthogonalize turns
        # into NaN, and NaN * 0 is NaN
        step = torch.where(keep, orthogonalize(stack, self.steps) * lr, 0.0)
        weights = self._matrices(self.w)
        norms = torch.stack(torch._foreach_norm(weights))
        scale = torch.where(keep, self.target_norm / norms, torch.ones_like(norms))
        for i, x in enumerate(weights):
            rows, cols = x.shape
            d = step[i, :rows, :cols] if rows <= cols else step[i, :cols, :rows].T
            x.mul_(scale[i]).sub_(d)
