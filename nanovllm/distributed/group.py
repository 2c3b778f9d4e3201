"""Who this process is in its tensor-parallel group, and the collectives the layers need.

Each engine builds its own process group straight from a rendezvous store (no global default group),
so several engines can live in one process. Layers read the group while the model is being built
(`building_with(group)`) and keep it.
"""
import threading
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm.distributed.peer_memory import PeerAllReduce, takes

COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def rank_device(device_type: str, rank: int) -> torch.device:
    """Rank r runs on GPU r (one process per GPU), or on the CPU."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def rendezvous_store(port: int) -> dist.TCPStore:
    """A client of the rendezvous store that rank 0's process serves on 127.0.0.1:port."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=COLLECTIVE_TIMEOUT)


class TensorParallelGroup:

    def __init__(self, rank: int = 0, size: int = 1, backend=None, store=None):
        self.rank, self.size, self.backend, self.store = rank, size, backend, store
        self.aborted = False
        self._lock = threading.Lock()     # abort() comes from rank 0's worker monitor thread
        self.peer: PeerAllReduce | None = None    # the one-shot all-reduce, once enabled

    @staticmethod
    def joined_key(rank: int) -> str:
        """The store key a rank sets as it starts joining the group."""
        return f"joined/{rank}"

    @classmethod
    def connect(cls, rank: int, size: int, store: dist.Store, device: torch.device) -> "TensorParallelGroup":
        """Join the group that rendezvouses through `store` (NCCL on CUDA, else gloo)."""
        store.set(cls.joined_key(rank), "1")      # rank 0 waits for the others' keys, watching their processes
        if device.type != "cuda":
            return cls(rank, size, dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT), store)
        backend = dist.ProcessGroupNCCL(store, rank, size, COLLECTIVE_TIMEOUT)
        # Build the communicator now, once every rank is known to be alive: NCCL would otherwise build it
        # in the first collective, and a rank that died before joining would leave the others inside
        # ncclCommInitRank, where nothing can break them off. A wait on the store can be broken off.
        store.wait([cls.joined_key(r) for r in range(size)])
        backend.allreduce([torch.zeros(1, device=device)]).wait()
        torch.cuda.synchronize(device)
        return cls(rank, size, backend, store)

    def _live_backend(self):
        """The backend, unless aborted: an NCCL collective on an aborted communicator would hand back
        garbage, and the host would go on building or stepping with it."""
        if self.aborted:
            raise RuntimeError("the tensor-parallel group was aborted: a rank died")
        return self.backend

    def enable_peer_all_reduce(self, device: torch.device, devices: list[torch.device]) -> bool:
        """Small all-reduces (decode steps) from now on through peer memory, if every pair of the ranks'
        GPUs can reach each other (all ranks call this together; False: NCCL for everything)."""
        self.peer = PeerAllReduce.connect(self.rank, self.size, device, self.store, devices)
        return self.peer is not None

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.peer is not None and takes(x, op, self.peer.max_bytes):
            self._live_backend()
            return self.peer(x)
        if self.size > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            self._live_backend().allreduce([x], opts).wait()
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dim on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._live_backend().gather([parts] if self.rank == 0 else [], [x], opts).wait()
        return torch.cat(parts, -1) if self.rank == 0 else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrite x on every rank with rank 0's x."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self._live_backend().broadcast([x], opts).wait()
        return x

    def announce(self, key: str) -> None:
        """Tell the other ranks, through the store, that `key` is ready (the host side, not a stream)."""
        self.store.set(key, "1")

    def wait_for(self, key: str) -> None:
        """Block this host thread until some rank announced `key`. (A collective would not do: an NCCL
        all-reduce returns to the host at once and only orders the GPU stream.)"""
        self.store.wait([key])

    def abort(self) -> None:
        """Break off every collective in flight, for good: a rank has died. NCCL kernels spinning on the
        dead rank return (with garbage), so a host waiting on them wakes; gloo fails by itself when a
        peer's sockets close."""
        if self.peer is not None:
            self.peer.abort()
        with self._lock:
            if self.aborted or self.backend is None:
                return
            self.aborted, backend = True, self.backend
        backend.abort()

    def close(self) -> None:
        """Release the communicator now rather than whenever the object is collected: what
        destroy_process_group would do for a global group (without it NCCL warns at exit). An aborted
        one has nothing left to shut down (and NCCL's shutdown would wait for the dead rank)."""
        with self._lock:
            backend, self.backend, self.store, self.peer = self.backend, None, None, None
            if self.aborted or backend is None:
                return
        shutdown = getattr(backend, "shutdown", None) or getattr(backend, "_shutdown", None)
        if shutdown is not None:
            shutdown()


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
