"""Arena: one uint8 allocation per device that holds every tensor of a MemoryPlan."""
from pathlib import Path

import torch

from trainer.dtensor import DTensor, ITEMSIZE, padded_channels
from trainer.errors import PlanError
from trainer.future import TensorFuture
from trainer.plan import MemoryPlan
from trainer.regions import Region, storage_dtype

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def too_large(plan: MemoryPlan, device: torch.device, why: str = "") -> str:
    """What to say when the device cannot hold the arena: where its bytes go, and the options that size them."""
    largest = [r for r in sorted(Region, key=plan.region_bytes, reverse=True)[:3] if plan.region_bytes(r) * 100 >= plan.total_bytes]
    shown = ", ".join(f"{r.name} {plan.region_bytes(r) / 2**30:,.1f} GiB" for r in largest)
    return (f"the arena of {plan.total_bytes:,} bytes ({plan.total_bytes / 2**30:,.1f} GiB) cannot be allocated on {device}{f' ({why})' if why else ''}; "
            f"its largest regions: {shown}. trainer.epochs sets the size of the learning-rate table (S_SCALAR_FP32, "
            f"a value a step), data.resolution, trainer.batch_size and trainer.val_batch_size that of the inputs (I_*_DATA): "
            f"lower them; mode=plan lists every region")


def host_memory_available(root: Path = Path("/")) -> int | None:
    """The bytes this process may still fill on the host: the kernel's estimate of what can be
    had without swapping (MemAvailable), under its cgroup's limits where they are set (a
    limit less what its group uses, the page cache it can drop not counted, as kubelet
    counts it; for the process's group and each group above it, whose limits bound it too;
    cgroup v2, or v1's memory controller); None where the kernel says neither (not Linux).
    `root`: where /proc and /sys are."""
    def read(path) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            return ""

    def number(text: str) -> int | None:  # v2's "max" (no limit) is none
        try:
            return int(text)
        except ValueError:
            return None

    def field(text: str, name: str) -> int | None:
        return next((number(line.split()[1]) for line in text.splitlines() if line.split()[:1] == [name]), None)
    available = field(read(root / "proc/meminfo"), "MemAvailable:")
    found = [] if available is None else [available * 1024]
    # "0::/path" (v2) and "N:memory:/path" (v1) name the group; a container that mounts its own
    # group at the hierarchy's root shows the host's path, which is not there: the root is read
    groups = {line.split(":", 2)[1]: line.split(":", 2)[2].strip().lstrip("/")
              for line in read(root / "proc/self/cgroup").splitlines() if line.count(":") >= 2}
    for mount, controller, files in (("sys/fs/cgroup", "", ("memory.max", "memory.current", "inactive_file")),
                                     ("sys/fs/cgroup/memory", "memory",
                                      ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))):
        hierarchy = root / mount
        group = hierarchy / groups.get(controller, "")
        for folder in [group, *group.parents][:len(group.relative_to(hierarchy).parts) + 1]:
            limit, used = number(read(folder / files[0]).strip()), number(read(folder / files[1]).strip())
            if limit is not None and used is not None:  # v1's "no limit" is a number beyond any host's
                found.append(max(0, limit - used + (field(read(folder / "memory.stat"), files[2]) or 0)))
    return min(found) if found else None


class Arena:
    def __init__(self, plan: MemoryPlan, device: torch.device | str = "cpu"):
        self.plan = plan
        self.device = torch.device(device)
        self.half = HALF[plan.config.amp_dtype]
        # The CPU allocator hands out any size the address space holds; filling more than the
        # host has would end in the kernel killing the process, without a word.
        available = host_memory_available() if self.device.type == "cpu" else None
        if available is not None and plan.total_bytes > available:
            raise PlanError(too_large(plan, self.device, f"{available / 2**30:,.1f} GiB of this host's memory is free"))
        # Zero-filled: slot padding must hold finite values, since range ops sweep it too.
        try:
            self.storage = torch.zeros(plan.total_bytes, dtype=torch.uint8, device=self.device)
        except RuntimeError as e:  # the CPU allocator's refusal is a plain RuntimeError
            if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
                raise
            raise PlanError(too_large(plan, self.device)) from None

    def torch_dtype(self, dtype: str) -> torch.dtype:
        return {"fp32": torch.float32, "fp16": self.half, "int32": torch.int32, "int8": torch.int8}[dtype]

    def _alias(self, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """A tensor over arena bytes with a version counter of its own. Plain views would
        share the storage's counter, and then a BN statistics update in the forward pass
        would look like a modification of every weight autograd saved for backward."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return torch.empty(0, dtype=dtype, device=self.device).set_(
            self.storage.untyped_storage(), offset // itemsize, shape)

    def view(self, t: DTensor, padded: bool = False) -> torch.Tensor:
        """The DTensor's memory as a tensor. 4-D shapes come back NCHW in channels_last
        memory, the layout the model computes in; padded=True gives the whole padded NHWC
        slot contents instead (what the input pipeline writes)."""
        full = padded_channels(t.shape, t.dtype, t.region)
        x = self._alias(t.offset, self.torch_dtype(t.dtype), full)
        if padded:
            return x
        if full != t.shape:
            x = x[..., :t.shape[-1]]
        return x.permute(0, 3, 1, 2) if len(t.shape) == 4 else x

    def flat(self, start: Region, end: Region | None = None) -> torch.Tensor:
        """Regions start..end as one flat tensor of their (common) element type."""
        end = start if end is None else end
        amp = self.plan.config.amp
        if storage_dtype(start, amp) != storage_dtype(end, amp):
            raise PlanError(f"{start.name}..{end.name} mixes element types: no flat view")
        offset, nbytes = self.plan.range(start, end)
        dtype = self.torch_dtype(storage_dtype(start, amp))
        return self._alias(offset, dtype, (nbytes // ITEMSIZE[storage_dtype(start, amp)],))

    def __getitem__(self, t: DTensor) -> torch.Tensor:
        return self.view(t)

    def to_host_async(self, what: DTensor | Region | tuple) -> TensorFuture:
        """A DTensor, a region or a (start, end) region range, copied to the host behind
        the work already enqueued; see TensorFuture."""
        if isinstance(what, DTensor):
            return TensorFuture(self.view(what))
        return TensorFuture(self.flat(*what) if isinstance(what, tuple) else self.flat(what))
