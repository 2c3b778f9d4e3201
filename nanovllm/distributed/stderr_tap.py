"""A child process's stderr, forwarded to ours and remembered: when the child dies, its last lines can
be quoted in the error rank 0 raises (the user may not see the child's traceback scroll by, or may not
see it at all: a notebook shows only the kernel's own stderr)."""
import os
import threading
from contextlib import contextmanager

from nanovllm.utils.stderr_fd import stderr_to

TAIL_BYTES = 8192
TAIL_LINES = 20


class StderrTap:

    def __init__(self):
        self._read_fd, self._write_fd = os.pipe()
        self._forward_fd = os.dup(2)      # where this process's stderr goes now
        self._tail = b""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name="nanovllm-stderr-tap", daemon=True)
        self._thread.start()

    @contextmanager
    def as_stderr(self):
        """While inside, fd 2 is the tap's pipe: a child started here inherits it as its stderr (spawn
        hands a child our fds 0-2 before any of its Python runs, so even an error in its bootstrap
        comes through). Our own fd 2 is back on leaving."""
        try:
            with stderr_to(self._write_fd):
                yield
        finally:
            os.close(self._write_fd)      # the child holds the only write end now: EOF when it is gone
            self._write_fd = -1

    def _pump(self) -> None:
        while chunk := os.read(self._read_fd, 65536):
            try:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(self._forward_fd, view):]
            except OSError:      # our stderr closed: keep the tail anyway
                pass
            with self._lock:
                self._tail = (self._tail + chunk)[-TAIL_BYTES:]

    def tail(self, wait: float = 0.0) -> str:
        """The last lines the child wrote; `wait`: up to this many seconds for what it wrote before
        it died to come through (the pipe ends when every process holding it is gone)."""
        self._thread.join(wait)
        with self._lock:
            text = self._tail.decode("utf-8", errors="replace")
        return "\n".join(text.rstrip().splitlines()[-TAIL_LINES:])

    def close(self, wait: float = 1.0) -> None:
        """Stop forwarding once the child's output has ended. A grandchild may still hold the pipe: then
        the reader is left running (closing an fd another thread reads from would be unsafe)."""
        if self._read_fd < 0:
            return
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1
        self._thread.join(wait)
        if not self._thread.is_alive():
            os.close(self._read_fd)
            os.close(self._forward_fd)
            self._read_fd = -1
