"""Who this process is in its tensor-parallel group, and the collectives the layers need.

Each engine builds its own process group straight from a rendezvous store (no global default group),
so several engines can live in one process. Layers read the group while the model is being built
(`building_with(group)`) and keep it.
"""
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(minutes=10)


class TensorParallelGroup:

    def __init__(self, rank: int = 0, size: int = 1, backend=None, store=None):
        self.rank, self.size, self.backend, self.store = rank, size, backend, store

    @classmethod
    def connect(cls, rank: int, size: int, store_port: int, device: torch.device) -> "TensorParallelGroup":
        """Join the group whose rendezvous store listens on 127.0.0.1:store_port (NCCL on CUDA, else gloo)."""
        store = dist.TCPStore("127.0.0.1", store_port, size + 1, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        if device.type == "cuda":
            backend = dist.ProcessGroupNCCL(store, rank, size, COLLECTIVE_TIMEOUT)
        else:
            backend = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
        return cls(rank, size, backend, store)

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            self.backend.allreduce([x], opts).wait()
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dim on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.backend.gather([parts] if self.rank == 0 else [], [x], opts).wait()
        return torch.cat(parts, -1) if self.rank == 0 else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrite x on every rank with rank 0's x."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self.backend.broadcast([x], opts).wait()
        return x

    def announce(self, key: str) -> None:
        """Tell the other ranks, through the store, that `key` is ready (the host side, not a stream)."""
        self.store.set(key, "1")

    def wait_for(self, key: str) -> None:
        """Block this host thread until some rank announced `key`. (A collective would not do: an NCCL
        all-reduce returns to the host at once and only orders the GPU stream.)"""
        self.store.wait([key])

    def close(self) -> None:
        """Release the communicator now rather than whenever the object is collected: what
        destroy_process_group would do for a global group (without it NCCL warns at exit)."""
        shutdown = getattr(self.backend, "shutdown", None) or getattr(self.backend, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        self.backend = self.store = None


SINGLE = TensorParallelGroup()
_building: list[TensorParallelGroup] = []   # only non-empty while a model is being constructed


@contextmanager
def building_with(group: TensorParallelGroup):
    _building.append(group)
    try:
        yield group
    finally:
        _building.pop()


def current_group() -> TensorParallelGroup:
    return _building[-1] if _building else SINGLE
