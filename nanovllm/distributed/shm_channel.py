"""Rank 0's calls to the tensor-parallel workers: one pickled (method name, args) message at a time in a
SharedMemory buffer, and two semaphores per worker, "a message is waiting" and "I have read it".

Semaphores, not multiprocessing Events: Event.set() waits for every sleeper to wake, and a worker
killed while it slept never does, so rank 0 would hang in set(). A semaphore's release never waits."""
import pickle
from multiprocessing.shared_memory import SharedMemory
from typing import Callable

SHM_SIZE = 1 << 24        # 16 MiB for one message
CHECK_SECONDS = 0.1       # how often rank 0, waiting for a worker to read, looks whether it died
IDLE_CHECK_SECONDS = 1.0  # how often a waiting worker looks whether rank 0 still lives


class Signals:
    """One worker's pair of semaphores (made by rank 0, handed to the worker at spawn)."""

    def __init__(self, ctx):
        self.message_waiting = ctx.Semaphore(0)
        self.message_read = ctx.Semaphore(1)      # nothing unread yet


class ShmChannel:

    def __init__(self, shm: SharedMemory, signals: list[Signals], owner: bool):
        self.shm, self.signals, self.owner = shm, signals, owner

    @classmethod
    def create(cls, name: str, signals: list[Signals]) -> "ShmChannel":
        """Rank 0's end: it creates (and will unlink) the buffer."""
        return cls(SharedMemory(name=name, create=True, size=SHM_SIZE), signals, owner=True)

    @classmethod
    def attach(cls, name: str, signals: Signals) -> "ShmChannel":
        """A worker's end. (Spawned, the worker shares rank 0's resource tracker: nothing to unregister.)"""
        return cls(SharedMemory(name=name), [signals], owner=False)

    def send(self, method_name: str, args: tuple, check: Callable[[], None]) -> None:
        """Write one message once every worker has read the previous one. Rank 0 does not wait for a
        step's results before it sends the next call, so this is where it waits for the workers;
        `check` raises if one of them has died meanwhile (else this would wait forever)."""
        data = pickle.dumps([method_name, *args])
        n = len(data)
        if n + 4 > SHM_SIZE:
            raise RuntimeError(f"a {method_name!r} message of {n} bytes outgrows the {SHM_SIZE}-byte shared buffer")
        self._wait_until_read(check)
        self.shm.buf[0:4] = n.to_bytes(4, "little")
        self.shm.buf[4:n + 4] = data
        for signals in self.signals:
            signals.message_waiting.release()

    def _wait_until_read(self, check: Callable[[], None]) -> None:
        """Take every worker's "read" token: the buffer is then free to overwrite."""
        for signals in self.signals:
            while not signals.message_read.acquire(timeout=CHECK_SECONDS):
                check()

    def wait_until_read(self, check: Callable[[], None]) -> None:
        """Wait until every worker has read the last message (and leave the tokens for the next send)."""
        self._wait_until_read(check)
        for signals in self.signals:
            signals.message_read.release()

    def receive(self, idle_check: Callable[[], None]) -> tuple[str, list]:
        """Wait for the next message, calling `idle_check` every IDLE_CHECK_SECONDS while none comes."""
        signals = self.signals[0]
        while not signals.message_waiting.acquire(timeout=IDLE_CHECK_SECONDS):
            idle_check()
        n = int.from_bytes(self.shm.buf[0:4], "little")
        method_name, *args = pickle.loads(self.shm.buf[4:n + 4])
        signals.message_read.release()
        return method_name, args

    def close(self) -> None:
        self.shm.close()
        if self.owner:
            self.shm.unlink()
