"""The one-shot all-reduce over peer memory: which all-reduces take it (CPU), and on two GPUs its sums
against NCCL's for many sizes, eagerly and replayed from a CUDA graph many times."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.config import Config
from nanovllm.kernels.all_reduce import PROGRAMS, one_shot_all_reduce
from nanovllm.distributed.group import TensorParallelGroup
from nanovllm.distributed.peer_memory import max_one_shot_bytes, takes

SUM, MIN = dist.ReduceOp.SUM, dist.ReduceOp.MIN


def test_small_float_sums_take_peer_memory_and_the_rest_nccl():
    limit = max_one_shot_bytes(2)
    assert takes(torch.empty(256, 4096, dtype=torch.bfloat16), SUM, limit)       # a decode step's 2 MiB
    assert takes(torch.empty(limit // 4, dtype=torch.float32), SUM, limit)
    assert not takes(torch.empty(limit // 2 + 1, dtype=torch.bfloat16), SUM, limit)   # prefill-sized
    assert not takes(torch.empty(8, dtype=torch.bfloat16), MIN, limit)          # only sums
    assert not takes(torch.empty(8, dtype=torch.int64), SUM, limit)             # the KV block count's MIN
    assert not takes(torch.empty(8, 4, dtype=torch.bfloat16).t(), SUM, limit)   # not contiguous


def test_the_cut_off_shrinks_as_ranks_grow():
    """One-shot reads every peer's copy: with more ranks NCCL wins sooner."""
    assert max_one_shot_bytes(2) >= 2 * 4096 * 256 and max_one_shot_bytes(2) >= max_one_shot_bytes(4) \
        >= max_one_shot_bytes(8) > 0


def test_nccl_can_be_forced_and_cpu_never_uses_peer_memory(tiny_model):
    assert Config(str(tiny_model), disable_custom_all_reduce=True).disable_custom_all_reduce
    with pytest.raises(TypeError, match="disable_custom_all_reduce"):
        Config(str(tiny_model), disable_custom_all_reduce="yes")
    assert TensorParallelGroup().peer is None


interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter on CPU tensors; "
                                      "the two-GPU test covers the device")


class FakePeers:
    """Rank 0's view of two ranks' buffers and flags in host memory (Triton's interpreter): rank 1's
    part of each call is written by hand, as rank 1's kernel would."""

    def __init__(self, half_bytes=8192 * 4):
        self.half_bytes = half_bytes
        self.buffers = [torch.zeros(2 * half_bytes, dtype=torch.uint8) for _ in range(2)]
        self.flags = [torch.zeros(3 * PROGRAMS, dtype=torch.int32) for _ in range(2)]
        self.abort = torch.zeros(1, dtype=torch.int32)

    def half(self, rank, epoch, n):
        start = (epoch % 2) * self.half_bytes // 4
        return self.buffers[rank].view(torch.float32)[start:start + n]

    def rank1_sends(self, x1, epoch):
        self.half(1, epoch, x1.numel())[:] = x1             # rank 1's copy into its own buffer
        self.flags[0][PROGRAMS:2 * PROGRAMS] = epoch       # flag [rank 1, program p] on rank 0

    def rank0_reduces(self, x0):
        return one_shot_all_reduce(x0, torch.tensor([b.data_ptr() for b in self.buffers]),
                                   torch.tensor([f.data_ptr() for f in self.flags]), self.abort.data_ptr(),
                                   self.half_bytes, 0, 2, spins_per_abort_check=2)   # the interpreter is slow


@interpreter_only
@pytest.mark.timeout(120)
def test_the_kernel_sums_both_ranks_on_alternate_halves_and_signals_the_peer():
    peers = FakePeers()
    for epoch, n in [(1, 5000), (2, 8192), (3, 1)]:
        x0, x1 = torch.randn(n), torch.randn(n)
        peers.rank1_sends(x1, epoch)
        assert torch.equal(peers.rank0_reduces(x0.clone()), x0 + x1)
        assert (peers.flags[1][:PROGRAMS] == epoch).all()          # told rank 1, every program
        assert (peers.flags[0][2 * PROGRAMS:] == epoch).all()      # its own epoch counters
        assert torch.equal(peers.half(0, epoch, n), x0)            # its own copy, in this call's half


@interpreter_only
@pytest.mark.timeout(120)
def test_a_wait_for_a_dead_rank_ends_when_the_engine_aborts():
    peers = FakePeers()
    peers.abort[0] = 1                 # rank 1 never signals; the engine has seen it die
    peers.rank0_reduces(torch.randn(100))
    assert (peers.flags[1][:PROGRAMS] == 1).all()


SIZES = [1, 7, 1000, 4096, 65536 + 3, 256 * 4096, 512 * 4096]


def _worker(rank: int, port: int, failures) -> None:
    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
        group = TensorParallelGroup.connect(rank, 2, store, device)
        assert group.enable_peer_all_reduce(device, [torch.device("cuda", 0), torch.device("cuda", 1)])

        def nccl(x):
            opts = dist.AllreduceOptions()
            group.backend.allreduce([x], opts).wait()
            return x

        for dtype in (torch.bfloat16, torch.float32):
            for n in SIZES:
                x = torch.randn(n, device=device, dtype=dtype) * (rank + 1)
                ours, theirs = group.all_reduce(x.clone()), nccl(x.clone())
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
        # captured: three all-reduces of different sizes per replay, replayed many times with new inputs
        inputs = [torch.zeros(n, device=device, dtype=torch.bfloat16) for n in (4096, 256 * 4096, 7)]
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for x in inputs:
                group.all_reduce(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for x in inputs:
                group.all_reduce(x)
        for step in range(50):
            torch.manual_seed(step * 2 + rank)
            fresh = [torch.randn_like(x) for x in inputs]
            for x, f in zip(inputs, fresh):
                x.copy_(f)
            expected = [nccl(f.clone()) for f in fresh]
            graph.replay()
            for x, e in zip(inputs, expected):
                torch.testing.assert_close(x, e, rtol=1e-2, atol=1e-2)
        # every rank holds the very same bits (the sum runs in rank order everywhere)
        gathered = [torch.empty_like(inputs[1]) for _ in range(2)]
        group.backend.allgather([gathered], [inputs[1]]).wait()
        assert torch.equal(gathered[0], gathered[1])
        torch.cuda.synchronize()
        group.close()
    except BaseException as error:     # noqa: BLE001 - reported to the parent
        failures.put(f"rank {rank}: {type(error).__name__}: {error}")
        raise


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_sums_match_nccl_eagerly_and_through_graph_replays():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, failures)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    errors = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
    assert all(p.exitcode == 0 for p in procs) and not errors, (errors, [p.exitcode for p in procs])
