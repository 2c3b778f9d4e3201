"""All-reduce benchmark on the GPUs of one host: our one-shot kernel over peer memory against NCCL.

One process per GPU (default: every visible GPU). For each message size, bf16 [tokens, hidden]: both
results are checked against each other, then 50 back-to-back all-reduces are captured in one CUDA graph
per implementation and replayed; the table gives microseconds per all-reduce on rank 0 (the first call's
wait for the slowest rank is spread over the 50). The one-shot buffer is made large enough for every
size here, so the table also shows where NCCL overtakes it (the engine's cut-off: max_one_shot_bytes).

    PYTHONPATH=. python benchmarks/bench_all_reduce.py [--world-size N] [--hidden 4096]
"""
import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.distributed.group import TensorParallelGroup
from nanovllm.distributed.peer_memory import PeerAllReduce, max_one_shot_bytes

TOKENS = (1, 8, 64, 256, 512, 1024, 2048, 8192)
CALLS = 50


def graph_us(fn, x, group) -> float:
    """Microseconds per call of fn(x), CALLS calls replayed from one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn(x)
    times = []
    for _ in range(5):
        group.all_reduce(torch.zeros(1, device=x.device))     # line the ranks up
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def worker(rank: int, world_size: int, port: int, hidden: int, results) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0)
    group = TensorParallelGroup.connect(rank, world_size, store, device)
    largest = max(TOKENS) * hidden * 2
    peer = PeerAllReduce(rank, world_size, device, store, largest)

    def nccl(x):
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        group.backend.allreduce([x], opts).wait()

    rows = []
    for tokens in TOKENS:
        torch.manual_seed(rank * 1000 + tokens)
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        ours, theirs = peer(x.clone()), x.clone()
        nccl(theirs)
        diff = (ours.float() - theirs.float()).abs().max().item()
        t_ours = graph_us(peer, x.clone(), group)
        t_nccl = graph_us(nccl, x.clone(), group)
        rows.append((tokens, x.numel() * 2, t_ours, t_nccl, diff))
    if rank == 0:
        results.put(rows)
    group.all_reduce(torch.zeros(1, device=device))
    torch.cuda.synchronize()
    group.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    if args.world_size < 2:
        sys.exit("needs at least 2 CUDA GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.world_size, port, args.hidden, results))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    rows = results.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    print(f"{torch.cuda.get_device_name(0)} x {args.world_size}; torch {torch.__version__}; "
          f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}; engine cut-off "
          f"{max_one_shot_bytes(args.world_size) >> 20} MiB")
    print(f"| bf16 [tokens, {args.hidden}] | bytes | one-shot (us) | NCCL (us) | NCCL / one-shot | max |diff| |")
    print("|---|---|---|---|---|---|")
    for tokens, nbytes, t_ours, t_nccl, diff in rows:
        print(f"| {tokens} | {nbytes / 2**20:.3g} MiB | {t_ours:.1f} | {t_nccl:.1f} | {t_nccl / t_ours:.2f}x | {diff:.3g} |")


if __name__ == "__main__":
    main()
