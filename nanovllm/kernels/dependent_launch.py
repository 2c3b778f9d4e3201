"""Programmatic dependent launch (Hopper and later): a decode step's kernels start while the kernel before
them finishes, not after it.

A decode step of an 8B model replays ~400 kernels from a CUDA graph, and between two of them the SMs idle
for the first kernel's last programs to drain and the next one's launch to land: a microsecond or two each,
a tenth of a one-stream step. Launched with `launch_pdl`, a kernel's programs may be placed as soon as every
program of the kernel before it has signalled (`gdc_launch_dependents`); they then block in `gdc_wait`
until that kernel has finished and its writes are visible. So each kernel here

  - signals first thing (`start_dependents`), letting the next kernel's programs queue behind it;
  - waits (`wait_for_producers`) before it reads anything an earlier kernel writes or writes anything an
    earlier kernel reads, and on every path (a kernel that never waited could finish before its
    predecessor, and the kernel after it would then wait on the wrong one);
  - may issue work that depends on no earlier kernel before its wait: a GEMV's first weight loads.

Only the kernels of decode graphs of a few rows (up to MAX_ROWS sequences) take part. Elsewhere, off the GPU and
before Hopper `pdl_options` is empty: the kernels compile as before (PDL is a constexpr,
False by default) and launch plainly. A plain kernel after a dependent one waits for it as always.
"""
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Benchmarks set it False to measure what dependent launches are worth.
ENABLED = True
# Decode graphs of more rows than this are captured plain: their kernels' programs fill the GPU, so there is no
# gap to overlap, and on an H100 dependent launches in every decode graph cost bench.py's standard workload
# 0.4-0.6% (Qwen3-8B FP8, Qwen3-0.6B) where graphs of up to 16 rows lose nothing measurable.
MAX_ROWS = 16
_active = False


@contextmanager
def dependent_launches(on: bool) -> Iterator[None]:
    """Kernels launched inside take part when `on` (CudaGraphs captures its decode graphs of up to MAX_ROWS
    rows so). Eager launches stay plain: each is one variant, the one start-up compiles."""
    global _active
    before, _active = _active, on and ENABLED
    try:
        yield
    finally:
        _active = before


@lru_cache(maxsize=None)
def _has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(device: torch.device) -> dict:
    """Extra launch arguments for a kernel taking `PDL: tl.constexpr`: PDL and launch_pdl inside
    `dependent_launches(True)` on a Hopper (or later) GPU, nothing elsewhere."""
    if not _active or device.type != "cuda":
        return {}
    if not _has_pdl(device.index if device.index is not None else torch.cuda.current_device()):
        return {}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def start_dependents(PDL: tl.constexpr):
    """Let the next kernel in the stream place its programs (they wait for this one before touching memory)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def enter(PDL: tl.constexpr):
    """A kernel's first line when nothing it does precedes its inputs: signal, then wait."""
    start_dependents(PDL)
    wait_for_producers(PDL)
