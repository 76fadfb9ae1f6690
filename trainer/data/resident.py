"""A small-image split kept on the device as uint8, augmented per batch by torch ops that
write straight into the arena: no decoder and no host work per step."""
import numpy as np
import torch
import torch.nn.functional as F

from trainer.config import DataConfig
from trainer.data.source import EpochPlan, Shard, crop_offsets, flips, on


def _reflect(i: torch.Tensor, size: int) -> torch.Tensor:
    """Indices past either edge mirrored back inside (edge pixel not repeated)."""
    i = i.abs()
    return torch.where(i >= size, 2 * (size - 1) - i, i)


class ResidentSource:
    """Random crop with padding and flip for training, the plain image for evaluation.

    The padding reflects the image, as airbench's does, rather than adding a border of
    one color. Each epoch's plan (example, crop corner, flip, real) is one small table
    copied to the device by the epoch's first fill, on the fill's stream.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, shard: Shard, num_classes: int,
                 mean, std, d: DataConfig, seed: int, augment: bool):
        self.images, self.labels = images, labels  # (n, H, W, 3) uint8 and (n,) int32, on the device
        self.shard, self.size, self.num_classes = shard, shard.size, num_classes
        self.d, self.seed, self.augment = d, seed, augment
        self.mean = torch.tensor(mean, device=images.device) * 255
        self.inv_std = 1 / (torch.tensor(std, device=images.device) * 255)
        self._plan: EpochPlan | None = None
        self._table: torch.Tensor | None = None  # the epoch's plan on the host
        self._device_table: torch.Tensor | None = None

    def start_epoch(self, epoch: int, resolution: int) -> None:
        # resolution: nothing to prepare, fill() resizes to the shape of the buffer it is given
        plan = self.shard.epoch(self.seed, epoch)
        n, examples = self.shard.total, plan.examples
        corner, flip = np.zeros((len(examples), 2), int), np.zeros(len(examples), bool)
        if self.augment:
            padding = self.d.crop_padding
            corner = crop_offsets(n, padding, self.seed, epoch)[examples] - padding
            flip = flips(self.d.flip, n, self.seed, epoch)[examples]
        table = np.column_stack([examples, corner, flip, plan.real]).astype(np.int64)
        self._plan, self._table, self._device_table = plan, torch.from_numpy(table), None

    def fill(self, data: torch.Tensor, label: torch.Tensor, mask: torch.Tensor | None, stream) -> None:
        span = self._plan.take(len(data))
        with on(stream, data):
            if self._device_table is None:
                # from pinned memory the copy is asynchronous: the host does not wait
                host = self._table.pin_memory() if data.is_cuda else self._table
                self._device_table = host.to(data.device, non_blocking=True)
            t = self._device_table[span]
            self._render(t[:, 0], t[:, 1], t[:, 2], t[:, 3].bool(), data)
            label.copy_(self.labels[t[:, 0]])
            if mask is not None:
                mask.copy_(t[:, 4])

    def _render(self, idx, dy, dx, flip, out: torch.Tensor) -> None:
        """Crop the images idx at corners (dy, dx) of their reflect-padded selves, mirror
        where flip, normalize, resize to out's resolution, write into out (N, r, r, C)."""
        _, h, w, _ = self.images.shape
        rows = _reflect(dy[:, None] + torch.arange(h, device=dy.device), h)
        cols = _reflect(dx[:, None] + torch.arange(w, device=dx.device), w)
        cols = torch.where(flip[:, None], cols.flip(1), cols)
        pixels = self.images[idx[:, None, None], rows[:, :, None], cols[:, None, :]]
        x = (pixels.float() - self.mean) * self.inv_std
        if out.shape[1:3] != (h, w):  # progressive resizing: the whole crop, at lower resolution
            x = F.interpolate(x.permute(0, 3, 1, 2), size=out.shape[1:3], mode="bilinear",
                              antialias=True, align_corners=False).permute(0, 2, 3, 1)
        out[..., :3].copy_(x)
        if out.shape[3] == 4:
            out[..., 3].zero_()

    def peek(self, n: int) -> torch.Tensor:
        idx = torch.from_numpy(self.shard.order(self.seed, 0)[:n] % self.shard.total).to(self.images.device)
        zero = torch.zeros_like(idx)
        r = self.d.resolution
        out = torch.empty((len(idx), r, r, 3), device=self.images.device)
        self._render(idx, zero, zero, zero.bool(), out)
        return out.permute(0, 3, 1, 2).contiguous()
