"""Who this process is in its tensor-parallel group, and the two collectives the layers need.

Layers read the group while the model is being built (`building_with(group)`) and keep it, so several
engines can live in one process, each with its own group.
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist


class TensorParallelGroup:
    def __init__(self, rank: int = 0, size: int = 1, process_group: "dist.ProcessGroup | None" = None):
        self.rank, self.size, self.process_group = rank, size, process_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.process_group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dim on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, group_dst=0, group=self.process_group)
        return torch.cat(parts, -1) if self.rank == 0 else None


SINGLE = TensorParallelGroup()
_building: list[TensorParallelGroup] = []


@contextmanager
def building_with(group: TensorParallelGroup):
    _building.append(group)
    try:
        yield group
    finally:
        _building.pop()


def current_group() -> TensorParallelGroup:
    return _building[-1] if _building else SINGLE
