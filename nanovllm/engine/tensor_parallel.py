"""Starting and stopping the worker processes of ranks 1..N-1 (rank 0 runs in the caller's process)."""
import os
from dataclasses import dataclass, field
from uuid import uuid4

import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.config import Config


@dataclass
class Workers:
    processes: list = field(default_factory=list)
    events: list = field(default_factory=list)
    store: "dist.TCPStore | None" = None     # the rendezvous; its port is this engine's own
    store_port: int = 0
    shm_name: str = ""


def start_workers(config: Config, runner_cls) -> Workers:
    world_size = config.tensor_parallel_size
    if world_size == 1:
        return Workers()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    workers = Workers(store=store, store_port=store.port, shm_name=f"nanovllm-{os.getpid()}-{uuid4().hex[:12]}")
    ctx = mp.get_context("spawn")
    for rank in range(1, world_size):
        event = ctx.Event()
        process = ctx.Process(target=runner_cls, args=(config, rank, event, workers.store_port, workers.shm_name),
                              daemon=True)
        process.start()
        workers.processes.append(process)
        workers.events.append(event)
    return workers


def check_workers(workers: Workers) -> None:
    """Raise, rather than wait forever in a collective, when a worker process has died."""
    for rank, process in enumerate(workers.processes, start=1):
        if not process.is_alive():
            raise RuntimeError(f"tensor-parallel worker of rank {rank} died (exit code {process.exitcode})")


def stop_workers(workers: Workers, timeout: float = 30.0) -> None:
    """Wait up to `timeout` seconds for the workers to leave their loop, then kill what is left."""
    for process in workers.processes:
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
    workers.processes.clear()
    workers.store = None
