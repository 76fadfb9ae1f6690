"""The process group: who this process is among the ranks, and the collective range ops.
With one process every collective is the identity (BN statistics are copied to B_PREV)."""
import os
from dataclasses import dataclass

import torch


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def check_fingerprint(self, fingerprint: str):
        """Every rank must have built the same plan."""

    def grad_sync_factory(self, ops):
        """A callable that all-reduces the gradient regions inside the step, or None."""
        return None

    def average_bn(self, ops):
        """BN_STATS_ALLREDUCE: B_PREV = the mean over ranks of B_NEXT."""
        ops.bn_stats_to_prev()

    def all_sum_(self, x: torch.Tensor):
        """Sum a small tensor (metric sums) over ranks, in place."""


def from_env() -> Dist:
    """torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or a single process."""
    return Dist(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                int(os.environ.get("LOCAL_RANK", 0)))


def device_for(choice: str, d: Dist) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", d.local_rank)
