"""A small-image split kept on the device as uint8, augmented per batch by one kernel
(kernels.*.crop_flip_normalize_) that writes straight into the arena: no decoder and no
host work per step. The kernel follows the device, Triton on a GPU: a dozen small torch
launches per batch on the loader's stream cost the step beside them 6% (CIFAR-10,
batch 1024)."""
import numpy as np
import torch
import torch.nn.functional as F

import kernels
from kernels.reference import TABLE_COLUMNS
from trainer.config import DataConfig
from trainer.data.source import EpochPlan, Shard, check_crop_padding, crop_offsets, cutout_corners, flips, on
from trainer.errors import DataError

PAD = "by reflecting them"  # how training crops pad the images, as check_crop_padding says it


class ResidentSource:
    """Random crop with padding, flip and cutout for training, the plain image for evaluation.

    The padding reflects the image, as airbench's does, rather than adding a border of
    one color. Each epoch's plan (example, crop corner, flip, real, cutout) is one small
    table copied to the device by the epoch's first fill, on the fill's stream.
    """
    classes: list[str] | None = None  # (Source) the data set's to set

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, shard: Shard, num_classes: int,
                 mean, std, d: DataConfig, seed: int, augment: bool, half: torch.dtype | None):
        # (n, H, W, 3) uint8, contiguous as the kernel indexes it, and (n,) int32, on the device
        self.images, self.labels = images.contiguous(), labels
        self.shard, self.size, self.num_classes = shard, shard.size, num_classes
        self.d, self.seed, self.augment = d, seed, augment
        if d.cutout > min(images.shape[1:3]):
            raise DataError(f"data.cutout={d.cutout} is wider than the stored images ({images.shape[1]}x"
                            f"{images.shape[2]}), on which the square is drawn; set data.cutout to at most "
                            f"{min(images.shape[1:3])}")
        if augment:
            check_crop_padding(d.crop_padding, images.shape[1], images.shape[2], PAD)
        self.mean = torch.tensor(mean, device=images.device) * 255
        self.inv_std = 1 / (torch.tensor(std, device=images.device) * 255)
        self._plan: EpochPlan | None = None
        self._table: torch.Tensor | None = None  # the epoch's plan on the host
        self._device_table: torch.Tensor | None = None
        self.k = kernels.load("auto", images.device)
        # One image into a scratch batch of the arena's layout (half: 4 channels of fp16/bf16):
        # the kernel compiles now, in set-up, not in the first timed fill.
        device, (h, w) = images.device, images.shape[1:3]
        channels, dtype = (3, torch.float32) if half is None else (4, half)
        self._write(torch.zeros((1, TABLE_COLUMNS), dtype=torch.int64, device=device),
                    torch.empty((1, h, w, channels), dtype=dtype, device=device),
                    torch.empty(1, dtype=torch.int32, device=device), torch.empty(1, dtype=torch.int8, device=device))

    def start_epoch(self, epoch: int, resolution: int) -> None:
        # resolution: nothing to prepare, fill() resizes to the shape of the buffer it is given
        plan = self.shard.epoch(self.seed, epoch)
        n, examples = self.shard.total, plan.examples
        # filled column by column: np.column_stack of these mixed dtypes took 5 ms of host
        # time for 50,000 examples, this 2.5 ms
        table = np.zeros((len(examples), TABLE_COLUMNS), np.int64)
        table[:, 0], table[:, 4] = examples, plan.real
        if self.augment:
            padding, cut = self.d.crop_padding, self.d.cutout
            table[:, 1:3] = crop_offsets(n, padding, self.seed, epoch)[examples] - padding
            table[:, 3] = flips(self.d.flip, n, self.seed, epoch)[examples]
            if cut:
                table[:, 5:7] = cutout_corners(n, cut, *self.images.shape[1:3], self.seed, epoch)[examples]
                table[:, 7] = cut
        self._plan, self._table, self._device_table = plan, torch.from_numpy(table), None

    def fill(self, data: torch.Tensor, label: torch.Tensor, mask: torch.Tensor | None, stream) -> None:
        span = self._plan.take(len(data))
        with on(stream, data):
            if self._device_table is None:
                # from pinned memory the copy is asynchronous: the host does not wait
                host = self._table.pin_memory() if data.is_cuda else self._table
                self._device_table = host.to(data.device, non_blocking=True)
            self._write(self._device_table[span], data, label, mask)

    def _write(self, table: torch.Tensor, out: torch.Tensor, label: torch.Tensor, mask: torch.Tensor | None):
        """The images, labels and mask of `table`'s rows into out (N, r, r, C)."""
        h, w = self.images.shape[1:3]
        if out.shape[1:3] == (h, w):
            return self.k.crop_flip_normalize_(self.images, self.labels, table, self.mean, self.inv_std,
                                               out, label, mask)
        # progressive resizing: the whole crop, at lower resolution
        full = torch.empty((len(table), h, w, 3), device=out.device)
        self.k.crop_flip_normalize_(self.images, self.labels, table, self.mean, self.inv_std, full, label, mask)
        x = F.interpolate(full.permute(0, 3, 1, 2), size=out.shape[1:3], mode="bilinear", antialias=True,
                          align_corners=False)
        out[..., :3].copy_(x.permute(0, 2, 3, 1))
        out[..., 3:].zero_()

    def peek(self, n: int) -> torch.Tensor:
        """The first n images of epoch 0's order, uncropped, unflipped, (n, 3, r, r) fp32."""
        idx = torch.from_numpy(self.shard.order(self.seed, 0)[:n] % self.shard.total)
        table = torch.zeros((len(idx), TABLE_COLUMNS), dtype=torch.int64)
        table[:, 0] = idx
        r = self.d.resolution
        out = torch.empty((len(idx), r, r, 3), device=self.images.device)
        label = torch.empty(len(idx), dtype=self.labels.dtype, device=self.images.device)
        self._write(table.to(self.images.device), out, label, None)
        return out.permute(0, 3, 1, 2).contiguous()
