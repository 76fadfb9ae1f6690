"""Export: the arena's weights as a plain state_dict, loadable into the unbound model
(torchvision's, for its model names) with load_state_dict(strict=True)."""
import torch

from trainer.arena import Arena
from trainer.plan import Baseline
from trainer.planner import ModelTensors


def state_dict(tensors: ModelTensors, arena: Arena, use_ema: bool) -> dict:
    """Weights as evaluation sees them: EMA when EMA is on, and the rank-averaged BN
    statistics (B_PREV)."""
    out = {}
    for name, t in tensors.params.items():
        out[name] = arena[t.e if use_ema else t.w].detach().to("cpu", memory_format=torch.contiguous_format).clone()
    step = int(arena[arena.plan[Baseline.STEP]][0])
    for name, s in tensors.bn.items():
        prefix = f"{name}." if name else ""
        out[prefix + "running_mean"] = arena[s.prev_mean].cpu().clone()
        out[prefix + "running_var"] = arena[s.prev_var].cpu().clone()
        out[prefix + "num_batches_tracked"] = torch.tensor(step, dtype=torch.int64)
    return out
