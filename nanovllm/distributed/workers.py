"""The worker processes of ranks 1..N-1 (rank 0 runs in the caller's process): starting them, calling
them, noticing at once when one dies, and stopping them.

No failure may leave rank 0 waiting: a monitor thread waits on the workers' process sentinels, and the
moment one dies it records why (exit code, the end of its stderr) and breaks off whatever rank 0 could
be waiting in: NCCL collectives (the group is aborted), the rendezvous store (closed, unless rank 0
noticed by itself first: closing it makes torch print a warning), gloo collectives (they fail by
themselves when the dead peer's sockets close). Where rank 0 waits in Python (for the workers to join,
for them to read a message) it looks itself.
"""
import os
import signal
import threading
import time
from multiprocessing import resource_tracker
from multiprocessing.connection import wait
from typing import Callable
from uuid import uuid4

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.distributed.group import TensorParallelGroup, rank_device, rendezvous_store
from nanovllm.distributed.shm_channel import ShmChannel, Signals
from nanovllm.distributed.stderr_tap import StderrTap

GUARD_MESSAGE = ('tensor-parallel workers are spawned processes, and each one imports your script again: '
                 'a script that builds an LLM when imported starts another engine in every worker. Put the '
                 'script\'s work under `if __name__ == "__main__":`')
# what a worker that re-imported an unguarded script prints: our own refusal, or Python's (when the
# script starts some other process first)
_BOOTSTRAP_MARKERS = (GUARD_MESSAGE[:60], "bootstrapping phase")
STOP_SECONDS = 10.0       # a worker told to exit gets this long before it is killed
DIAGNOSE_SECONDS = 3.0    # how long an error on rank 0 waits for the monitor to name a dead worker
NOTICE_SECONDS = 0.5      # how long the monitor lets rank 0 notice a death by itself before closing the store


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process died: the engine cannot go on (exit() it and build a new one)."""


def refuse_in_spawn_bootstrap() -> None:
    """Raise the guard message in a spawned process that is still importing its parent's script
    (multiprocessing marks a process `_inheriting` exactly then: the check it makes itself)."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(GUARD_MESSAGE)


def _death_message(rank: int, exitcode: int | None, stderr_tail: str) -> str:
    how = f"exit code {exitcode}"
    if exitcode is not None and exitcode < 0:
        how += f", killed by {signal.Signals(-exitcode).name}"
    message = f"tensor-parallel worker of rank {rank} died ({how})"
    if any(marker in stderr_tail for marker in _BOOTSTRAP_MARKERS):
        message += f" while importing your script. {GUARD_MESSAGE}"
    if stderr_tail:
        message += f"\n--- the end of rank {rank}'s error output ---\n{stderr_tail}"
    return message


class Workers:
    """Rank 0's handle on ranks 1..N-1. With world_size=1 there are none and every method is (nearly) free.

    Each worker builds its rank's runner as `build_runner(rank, group)` (picklable: it travels to the
    spawned process; the engine passes its ModelRunner class with the config bound) and then calls the
    runner's methods by name as rank 0 sends them."""

    def __init__(self, world_size: int, device_type: str, build_runner: Callable[[int, TensorParallelGroup], object]):
        self.device_type = device_type
        self.world_size = world_size
        self.processes: list = []
        self.taps: list[StderrTap] = []
        self.channel: ShmChannel | None = None
        self.group: TensorParallelGroup | None = None
        self.failure = ""                     # why a worker died, once one has
        self._died = threading.Event()
        self._noticed = threading.Event()     # rank 0 has seen the failure (and raised it)
        self._stopping = False
        if self.world_size == 1:
            return
        self.store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True, wait_for_workers=False)
        self.store_port = self.store.port
        # rank 0's own connection, made while the master surely lives: when a worker dies, the master is
        # closed and whatever rank 0 waits on through this client fails at once (a client that connects
        # after that would instead keep retrying for COLLECTIVE_TIMEOUT)
        self.rank0_store = rendezvous_store(self.store_port)
        self.shm_name = f"nanovllm-{os.getpid()}-{uuid4().hex[:12]}"
        ctx = mp.get_context("spawn")
        self.signals = [Signals(ctx) for _ in range(1, self.world_size)]
        resource_tracker.ensure_running()     # started now, it does not inherit a worker's stderr pipe
        for rank, signals in enumerate(self.signals, start=1):
            process = ctx.Process(target=worker_main, name=f"nanovllm-rank{rank}", daemon=True,
                                  args=(build_runner, rank, world_size, device_type, signals, self.store_port,
                                        self.shm_name))
            tap = StderrTap()
            with tap.as_stderr():
                process.start()
            self.processes.append(process)
            self.taps.append(tap)
        self._wake_read, self._wake_write = os.pipe()
        self._monitor = threading.Thread(target=self._watch, name="nanovllm-worker-monitor", daemon=True)
        self._monitor.start()

    # ---- noticing a death ---------------------------------------------------------------------------
    def _watch(self) -> None:
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes, start=1)}
        ready = wait([*sentinels, self._wake_read])
        if self._stopping:
            return
        rank = next(sentinels[s] for s in ready if s in sentinels)
        process = self.processes[rank - 1]
        process.join(1.0)
        self.failure = _death_message(rank, process.exitcode, self.taps[rank - 1].tail(wait=1.0))
        self._died.set()
        if self.group is not None:
            self._abort_group()
        if not self._noticed.wait(NOTICE_SECONDS):
            self.store = None      # rank 0 waits on the store, where it cannot look: the master goes away

    def _abort_group(self) -> None:
        """NCCL kernels waiting on the dead rank return. In a thread of its own: ncclCommAbort raises the
        kernels' abort flag first, then may hang freeing its resources (NVIDIA/nccl#1777)."""
        threading.Thread(target=self.group.abort, name="nanovllm-group-abort", daemon=True).start()

    def check(self) -> None:
        """Raise if a worker has died: every step would be garbage or wait forever."""
        if self._died.is_set():
            self._noticed.set()
            raise WorkerDied(self.failure)

    def explain(self, error: BaseException) -> None:
        """Rank 0 got `error` from something shared with the workers: if a worker has died (or dies in
        the next moments: a gloo peer's sockets close a hair before its death is visible), raise why."""
        if not self.processes or self._stopping or isinstance(error, (WorkerDied, KeyboardInterrupt)):
            return
        if self._died.wait(0.2) or (any(not p.is_alive() for p in self.processes)
                                    and self._died.wait(DIAGNOSE_SECONDS)):
            self._noticed.set()
            raise WorkerDied(self.failure) from error

    # ---- rank 0's side of the group --------------------------------------------------------------------
    def join_group(self) -> TensorParallelGroup:
        """Rank 0's tensor-parallel group, aborted the moment a worker dies."""
        if self.world_size == 1:
            return TensorParallelGroup()
        # wait here, watching the workers, until each is at the group's door (it has started, imported
        # and is joining): the wait inside the group's constructor could not look at them
        joined = [TensorParallelGroup.joined_key(rank) for rank in range(1, self.world_size)]
        while not self.rank0_store.check(joined):
            self.check()
            time.sleep(0.02)
        self.group = TensorParallelGroup.connect(0, self.world_size, self.rank0_store, rank_device(self.device_type, 0))
        if self._died.is_set():
            self._abort_group()
        return self.group

    def open_channel(self) -> None:
        """Once rank 0 is built: the message buffer, and the word to the workers that it exists."""
        if self.world_size > 1:
            self.channel = ShmChannel.create(self.shm_name, self.signals)
            self.group.announce("shared_memory")

    def send(self, method_name: str, args: tuple) -> None:
        """Have every worker call its ModelRunner's `method_name(*args)` (rank 0 calls its own)."""
        if self.channel is not None:
            self.check()
            self.channel.send(method_name, args, self.check)

    # ---- stopping ---------------------------------------------------------------------------------------
    def stop(self, exit_rank0=None, graceful: bool = True) -> None:
        """Stop every rank. Graceful (and every worker alive): the workers are told to `exit` and, once each
        has read it (within STOP_SECONDS), rank 0 runs `exit_rank0` beside them (NCCL tears a communicator
        down with all its ranks); they then get STOP_SECONDS to leave. Otherwise they are killed first and
        rank 0's group aborted, so that rank 0's exit cannot wait on a collective they will never join. The
        buffer is unlinked either way."""
        self._stopping = True
        if self.processes:
            os.write(self._wake_write, b"x")
            graceful = graceful and self.channel is not None and not self._died.is_set()
            if graceful:
                deadline = time.monotonic() + STOP_SECONDS

                def check_in_time():    # a worker that neither reads nor dies is killed, not waited for
                    self.check()
                    if time.monotonic() > deadline:
                        raise TimeoutError

                try:       # rank 0 tears its communicator down only beside workers that do the same
                    self.channel.send("exit", (), check_in_time)
                    self.channel.wait_until_read(check_in_time)
                except (WorkerDied, TimeoutError):
                    graceful = False
            if not graceful:
                self._kill()
                if self.group is not None:
                    self._abort_group()
        try:
            if exit_rank0 is not None:
                exit_rank0()
        finally:
            self._reap(STOP_SECONDS if graceful else 0)

    def _kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()

    def _reap(self, timeout: float) -> None:
        for process in self.processes:
            process.join(timeout)
        self._kill()
        for tap in self.taps:
            tap.close()
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.processes:
            self._monitor.join(NOTICE_SECONDS + 5)
            os.close(self._wake_read)
            os.close(self._wake_write)
        self.processes.clear()
        self.taps.clear()
        self.store = self.rank0_store = self.group = None


def worker_main(build_runner: Callable[[int, TensorParallelGroup], object], rank: int, world_size: int,
                device_type: str, signals: Signals, store_port: int, shm_name: str) -> None:
    """A worker process: build this rank's runner (a ModelRunner), then run what rank 0 sends until `exit`."""
    # Ctrl-C in a terminal reaches every process of the group: rank 0 handles it and stops the workers.
    # SIGTERM keeps its default: it ends a worker even inside a collective that will never complete (rank 0
    # gone), which a handler, run only between bytecodes, could not
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    device = rank_device(device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TensorParallelGroup.connect(rank, world_size, rendezvous_store(store_port), device)
    runner = build_runner(rank, group)
    group.wait_for("shared_memory")
    channel = ShmChannel.attach(shm_name, signals)
    parent = mp.parent_process()

    def exit_if_orphaned():
        if not parent.is_alive():      # rank 0 is gone (killed): nobody will send `exit`
            os._exit(1)

    while True:
        method_name, args = channel.receive(exit_if_orphaned)
        getattr(runner, method_name)(*args)
        if method_name == "exit":
            break
    channel.close()
