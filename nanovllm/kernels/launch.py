"""Launching a Triton kernel within the GPU's shared memory.

The tiles are tuned on Hopper, 227 KiB of shared memory a block; an A100 has 163 KiB, Ada and the consumer
Ampere cards 99 KiB. Triton refuses a compiled variant whose pipeline stages need more than the GPU has
(OutOfResources, at its first launch); `launch` then tries the same tiles with one stage fewer, down to one,
as Triton's autotuner prunes such configs. What fitted is remembered per kernel and options, so each variant
is compiled (and warmed up) once, and a GPU where everything fits pays one try/except a launch.
"""
import logging
from functools import lru_cache

import torch
from triton.runtime.errors import OutOfResources

logger = logging.getLogger(__name__)

# (kernel, its options as launched) -> the pipeline stages that fit this GPU; empty where every variant fits
_fitted_stages: dict[tuple, int] = {}


def _key(kernel, options: dict) -> tuple:
    return (kernel, *sorted((name, value) for name, value in options.items()
                            if isinstance(value, (bool, int, float, str, type(None)))))


def launch(kernel, grid, *args, **options) -> None:
    """kernel[grid](*args, **options), with fewer `num_stages` where the GPU's shared memory is too small."""
    key = _key(kernel, options) if _fitted_stages else None
    if key in _fitted_stages:
        options = dict(options, num_stages=_fitted_stages[key])
    try:
        kernel[grid](*args, **options)
        return
    except OutOfResources as refused:
        wanted = options.get("num_stages", 3)          # Triton's default
        if wanted <= 1:
            raise
        first_refusal = refused
    key = key or _key(kernel, options)
    for stages in range(wanted - 1, 0, -1):
        try:
            kernel[grid](*args, **dict(options, num_stages=stages))
        except OutOfResources:
            continue
        _fitted_stages[key] = stages
        logger.info("%s: %s; %d pipeline stages instead of %d (tuned for more shared memory)",
                    getattr(kernel, "__name__", kernel), first_refusal, stages, wanted)
        return
    raise first_refusal


@lru_cache(maxsize=None)
def _shared_memory(index: int) -> int:
    properties = torch.cuda.get_device_properties(index)
    optin = getattr(properties, "shared_memory_per_block_optin", 0)
    if optin:
        return optin
    from triton.runtime import driver
    return driver.active.utils.get_device_properties(index)["max_shared_mem"]


def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory a block may use on this GPU (Hopper 227 KiB, A100 163 KiB, Ada 99 KiB)."""
    return _shared_memory(device.index if device.index is not None else torch.cuda.current_device())
