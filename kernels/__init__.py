"""Range-op kernels: a torch reference (kernels.reference) and Triton twins
(kernels.triton_ops) with the same functions, chosen by `kernels=auto|torch|triton`.
The one input kernel (crop_flip_normalize_, for data resident on the device) lives here
too, for the same reason: one launch where torch needs a dozen; and the model ops
max_pool and max_pool_backward (trainer/pooling.py), which keep one byte per output, and
BatchNorm's batch_norm_stats_ and batch_norm_backward (trainer/norm.py), whose channel
reductions over channels-last activations inductor compiles at half the bandwidth, and
batch_norm_apply, the normalization with the residual add and the ReLU of eager training."""
import importlib
import os

import torch

from trainer.errors import ConfigError


def _triton_unusable(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on this device, or None when they can."""
    if device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        return f"Triton kernels need a CUDA device (this run uses {device}) or TRITON_INTERPRET=1"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"Triton is not importable ({e})"
    return None


def load(name: str, device: torch.device):
    """The module whose functions implement the range ops for `kernels=name` on `device`."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_unusable(device) is None else "torch"
    if name == "torch":
        return importlib.import_module("kernels.reference")
    if name == "triton":
        reason = _triton_unusable(device)
        if reason:
            raise ConfigError(f"kernels=triton: {reason}; use kernels=torch or kernels=auto")
        return importlib.import_module("kernels.triton_ops")
    raise ConfigError(f"kernels={name!r}: choose auto, torch or triton")
