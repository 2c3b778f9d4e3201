"""File descriptor 2 pointed elsewhere for a while: what C++ code and child processes write to stderr goes
there, not only Python's sys.stderr."""
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stderr_to(fd: int) -> Iterator[None]:
    """fd 2 is `fd` while inside; this process's own stderr is back on leaving."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
