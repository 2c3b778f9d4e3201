"""The warm-up tests' instrument: which Triton kernels compile while a block of code runs (start-up is meant
to have compiled every variant a request can reach)."""
from contextlib import contextmanager


@contextmanager
def recorded_compilations():
    """Yields a list that gains (kernel name, key) for each compilation inside the block."""
    import triton
    compiled = []
    triton.knobs.runtime.jit_cache_hook = lambda *, fn, key, **_: compiled.append((fn.name, key)) and False
    try:
        yield compiled
    finally:
        triton.knobs.runtime.jit_cache_hook = None


def assert_none_compiled(compiled: list) -> None:
    assert not compiled, f"compiled after start-up: {sorted({name for name, _ in compiled})}: {compiled[:3]}"
