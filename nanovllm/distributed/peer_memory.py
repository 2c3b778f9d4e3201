"""The one-shot all-reduce's memory: a buffer and a flag array per rank, mapped into every rank's
process through CUDA IPC handles exchanged over the group's rendezvous store, and the choice of which
all-reduces take it (small ones: decode steps) rather than NCCL (prefill-sized ones).

Peer memory only, never NVLink multicast: plain allocations mapped through IPC handles, no symmetric
memory and no multicast object.
"""
import inspect
import pickle

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from nanovllm.kernels.all_reduce import PROGRAMS, one_shot_all_reduce

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def max_one_shot_bytes(world_size: int) -> int:
    """The largest message the one-shot kernel takes. It reads world_size - 1 remote copies, where a
    ring moves about two: past a few MiB NCCL's bandwidth wins (2 x H200: see docs/benchmarks.md)."""
    return (8 << 20) if world_size <= 2 else (4 << 20) if world_size <= 4 else (2 << 20)


def takes(x: torch.Tensor, op, max_bytes: int) -> bool:
    """Whether an all-reduce of x goes through peer memory."""
    return (op == dist.ReduceOp.SUM and x.dtype in DTYPES and x.is_contiguous()
            and x.numel() * x.element_size() <= max_bytes)


def _open_here(rebuild, args: tuple, device: torch.device) -> torch.Tensor:
    """A peer's tensor mapped into this device's context (CUDA IPC, peer access enabled as it opens),
    not into a context of the peer's device in this process (that would cost a whole context). Its
    data_ptr is what this device's kernels dereference; it is no tensor to compute with."""
    fields = dict(zip(inspect.signature(rebuild).parameters, args))
    fields.update(storage_device=device.index, event_sync_required=False)   # the owner synchronized first
    return rebuild(**fields)


def _agree(store: dist.Store, key: str, rank: int, world_size: int, ok: bool) -> bool:
    """True on every rank if `ok` is true on every rank."""
    store.set(f"{key}/{rank}", "1" if ok else "0")
    store.wait([f"{key}/{r}" for r in range(world_size)])
    return all(store.get(f"{key}/{r}") == b"1" for r in range(world_size))


class PeerAllReduce:
    """Every rank's buffer and flags, mapped here; call it on a tensor that `takes` accepts."""

    def __init__(self, rank: int, world_size: int, device: torch.device, store: dist.Store, max_bytes: int):
        self.rank, self.world_size, self.max_bytes = rank, world_size, max_bytes
        # two halves (alternate calls), each max_bytes; flags [world, PROGRAMS] + epoch counters [PROGRAMS]
        self.buffer = torch.empty(2 * max_bytes, dtype=torch.uint8, device=device)
        self.flags = torch.zeros((world_size + 1) * PROGRAMS, dtype=torch.int32, device=device)
        self.abort_flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)   # read by spinning kernels
        torch.cuda.synchronize(device)           # the flags are zero before any peer can see them
        store.set(f"peer_all_reduce/{rank}", pickle.dumps((reduce_tensor(self.buffer), reduce_tensor(self.flags))))
        self.peer_tensors = []                   # keeps the peers' mappings open
        buffers, flags = [], []
        for r in range(world_size):
            if r == rank:
                buffer, flag = self.buffer, self.flags
            else:
                (rebuild_b, args_b), (rebuild_f, args_f) = pickle.loads(store.get(f"peer_all_reduce/{r}"))
                buffer, flag = _open_here(rebuild_b, args_b, device), _open_here(rebuild_f, args_f, device)
                self.peer_tensors += [buffer, flag]
            buffers.append(buffer.data_ptr())
            flags.append(flag.data_ptr())
        self.buffer_ptrs = torch.tensor(buffers, dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor(flags, dtype=torch.int64, device=device)

    @classmethod
    def connect(cls, rank: int, world_size: int, device: torch.device, store: dist.Store,
                devices: list[torch.device]) -> "PeerAllReduce | None":
        """Set it up on every rank at once, or on none (None) where some pair of GPUs has no peer access
        or a mapping fails; the ranks agree through the store."""
        ok = all(torch.cuda.can_device_access_peer(device, d) for d in devices if d != device)
        if not _agree(store, "peer_all_reduce/access", rank, world_size, ok):
            return None
        try:
            peer = cls(rank, world_size, device, store, max_one_shot_bytes(world_size))
        except RuntimeError:
            peer = None
        return peer if _agree(store, "peer_all_reduce/mapped", rank, world_size, peer is not None) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return one_shot_all_reduce(x, self.buffer_ptrs, self.flag_ptrs, self.abort_flag.data_ptr(),
                                   self.max_bytes, self.rank, self.world_size)

    def abort(self) -> None:
        """Let kernels waiting for a dead rank's flag return (with garbage)."""
        self.abort_flag[0] = 1
