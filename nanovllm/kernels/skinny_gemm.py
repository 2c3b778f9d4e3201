"""Triton `skinny_gemm`: y = x @ W^T for the few rows of a decode step, with K split over programs.

A decode step's GEMM is bound by reading the weights, and at few rows its column tiles alone are too few
programs to keep every SM streaming (a 1,024-column projection in 64-column tiles is 16 programs on 132
SMs), which is where cuBLAS falls short at these shapes. Here program (j, s, i) computes column tile j
of row tile i over the s-th range of K; the parts of a tile meet in a float32 buffer, and the last
program to arrive (an atomic counter per tile) adds them in order, so the result does not depend on which
part finished first and a CUDA graph replays it exactly.

One kernel serves the model's dtype and FP8 weights (nanovllm.kernels.fp8_gemm quantizes the activations
first): `SCALES` 0 for none, 1 per row of x and of W (applied after the K loop), 2 per row and 128 columns
of x and per 128x128 block of W (applied to each K step's product). Tiles are chosen on M alone (CONFIGS;
M is never specialized on), so start-up compiles every variant by running one batch per bucket.

`gemv` is the one-row case on CUDA cores (a program streams a few weight rows and sums their products per
lane, its first weight loads issued before it waits for its input where launched dependently:
kernels/dependent_launch.py); fp8_gemm sends a lone FP8 row with per-channel weight scales there, unquantized
or quantized, and the model's-dtype layers (layers/quantization/unquantized.dense_linear) every lone row.
"""
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from nanovllm.kernels.dependent_launch import enter, pdl_options, start_dependents, wait_for_producers
from nanovllm.kernels.launch import launch

NO_SCALES, CHANNEL_SCALES, BLOCK_SCALES = 0, 1, 2


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: float = 1  # K is split until the grid has about this many programs per SM
    block_m: int = 16           # rows per tile (a tensor-core dot takes 16 or more)
    block_k: int = 128          # FP8 block scales: one activation group a step


# (smallest M, config) for weights in the model's dtype: the LM head (N = 151,936), which these tiles stream
# 5-7% faster than cuBLAS at 1-64 rows (H100 sweep, benchmarks/bench_skinny_gemm.py --sweep). The decoder's
# projections stay on cuBLAS: at 1-64 rows it streams them as fast as any tiles swept (within ~0.5 us either
# way, at Qwen3-0.6B's and Qwen3-8B's shapes), but for one row, which the GEMV streams faster than either
# (Qwen3-8B bf16 one stream 6.53 -> 5.95 ms/token with dependent launches, H100). Tried and dropped: SwiGLU's
# gate computed in the down projection's loads (one launch fewer a layer) ran 3x slower in the engine than
# cuBLAS plus the separate kernel: a transformed A operand costs the loop its load pipelining.
CONFIGS: tuple[tuple[int, SkinnyConfig], ...] = (
    (1, SkinnyConfig(64, 4, 3, programs_per_sm=2, block_k=256)),
    (17, SkinnyConfig(128, 8, 4, programs_per_sm=2, block_m=64)),
)


def choose_config(num_rows: int, configs=CONFIGS) -> SkinnyConfig | None:
    """The tiles for num_rows rows, or None where they are too many for a skinny GEMM."""
    fitting = [config for first, config in configs if num_rows >= first]
    return fitting[-1] if fitting and num_rows <= fitting[-1].block_m else None


def config_token_counts(configs=CONFIGS) -> tuple[int, ...]:
    """One row count per bucket (the engine's warm-up runs each once, compiling every variant)."""
    return tuple(first for first, _ in configs)


@lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@lru_cache(maxsize=None)
def _tile_counters(device: torch.device) -> torch.Tensor:
    """Arrival counters, one per output tile, zero between calls (the last program of a tile resets its own)."""
    return torch.zeros(1 << 16, dtype=torch.int32, device=device)


def split_k(num_tiles: int, width: int, config: "SkinnyConfig | GemvConfig", device: torch.device) -> int:
    """Parts of K per output tile: enough programs to keep every SM streaming weights, each part at least
    4 K steps."""
    split = 1
    target = config.programs_per_sm * _multiprocessors(device)
    while num_tiles * split < target and width >= 2 * split * 4 * config.block_k:
        split *= 2
    return split


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr, partial_ptr, counter_ptr,
                        M, N, K, k_per_split, stride_a, stride_a_scale, stride_b, stride_c, stride_b_scale,
                        SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr = False):
    """c [M, N] = a [M, K] @ b [N, K]^T (+ bias). Program (j, s, i) computes rows [i*BLOCK_M, ...) and columns [j*BLOCK_N, ...) over K range
    [s*k_per_split, (s+1)*k_per_split). The parts of a tile meet in a float32 buffer [splits, M, N]; the
    last program to arrive adds them in order."""
    enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    num_splits = tl.num_programs(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (offs_m % M).to(tl.int64)      # ragged tiles read wrapped (in-bounds) rows and store nothing there
    cols = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
    b_ptrs = b_ptr + cols[None, :] * stride_b + offs_k[:, None]            # [BLOCK_K, BLOCK_N], K-major
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_first = pid_k * k_per_split
    for k in range(k_first, tl.minimum(k_first + k_per_split, K), BLOCK_K):
        inside = offs_k < K - k
        a = tl.load(a_ptrs + k) if EVEN_K else tl.load(a_ptrs + k, mask=inside[None, :], other=0.0)
        b = tl.load(b_ptrs + k) if EVEN_K else tl.load(b_ptrs + k, mask=inside[:, None], other=0.0)
        if SCALES == 0:
            acc = tl.dot(a, b, acc)
        else:
            # an FP8 dot's own sum never spans more than one K step: Hopper accumulates FP8 products with
            # ~14 significant bits unless the partial sum joins the float32 accumulator
            part = tl.dot(a, b)
            if SCALES == 2:
                a_scale = tl.load(a_scale_ptr + rows * stride_a_scale + k // 128)
                b_scale = tl.load(b_scale_ptr + (cols // 128) * stride_b_scale + k // 128)
                part = part * a_scale[:, None] * b_scale[None, :]
            acc += part
    if SCALES == 1:
        acc = acc * tl.load(a_scale_ptr + rows)[:, None] * tl.load(b_scale_ptr + cols)[None, :]
    c_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_c + offs_n[None, :]
    if num_splits > 1:
        tile = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(partial_ptr + pid_k * M * N + tile, acc, mask=c_mask)
        counter = counter_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")     # releases the part stored above
        if arrived == num_splits - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for part_index in range(0, num_splits):
                acc += tl.load(partial_ptr + part_index * M * N + tile, mask=c_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
            tl.store(counter, 0)        # ready for the next call (and graph replay)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# ---- one row: CUDA-core products ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8            # weight rows a program streams, BLOCK_K bytes of each per step
    block_k: int = 512
    num_warps: int = 4
    programs_per_sm: int = 4    # K is split until the grid has about this many programs per SM


# A single row on tensor cores pads it to a 16-row tile and its FP8 dots reload operands through shared
# memory; plain products stream the weights faster: FP8 Qwen3-8B projections at M = 1 on an H100 (kernel
# alone, .stagec sweep of 2026-11-26) 12.3-12.5 / 9.1 / 38.2 / 20.5 us (qkv / o / gate_up / down) against
# the dot kernel's 13.8 / 10.0 / 45.3 / 22.5. At 4 rows the dot wins (each row would stream W again).
GEMV_CONFIG = GemvConfig()


@triton.jit
def _gemv_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr, partial_ptr, counter_ptr, N, K,
                 k_per_split, stride_b, A_SCALED: tl.constexpr, B_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """c [1, N] = a [1, K] @ b [N, K]^T (+ bias): program (j, s) reduces weight rows [j*BLOCK_N, ...) over K
    range [s*k_per_split, ...) in float32 (FP8 values convert exactly), each row's scale applied to its sum;
    the parts of a tile meet as in _skinny_gemm_kernel (the last to arrive adds them in order)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_splits = tl.num_programs(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    cols = (offs_n % N).to(tl.int64)
    b_ptrs = b_ptr + cols[:, None] * stride_b + offs_k[None, :]
    # products summed per lane, reduced across K once at the end: no cross-thread reduction in the loop
    k_first = pid_k * k_per_split
    # the weights depend on no earlier kernel: the first step's are in flight before the wait (a split past
    # K's end, possible when the steps do not divide evenly, loads nothing)
    first = offs_k < K - k_first
    b = tl.load(b_ptrs + k_first, mask=first[None, :], other=0.0)
    start_dependents(PDL)
    wait_for_producers(PDL)
    a = tl.load(a_ptr + k_first + offs_k, mask=first, other=0.0)
    acc = b.to(tl.float32) * a.to(tl.float32)[None, :]
    for k in range(k_first + BLOCK_K, tl.minimum(k_first + k_per_split, K), BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr + k + offs_k)
            b = tl.load(b_ptrs + k)
        else:
            inside = offs_k < K - k
            a = tl.load(a_ptr + k + offs_k, mask=inside, other=0.0)
            b = tl.load(b_ptrs + k, mask=inside[None, :], other=0.0)
        acc += b.to(tl.float32) * a.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if A_SCALED:
        y = y * tl.load(a_scale_ptr)
    if B_SCALED:
        y = y * tl.load(b_scale_ptr + cols)
    mask = offs_n < N
    if num_splits > 1:
        tl.store(partial_ptr + pid_k * N + offs_n, y, mask=mask)
        counter = counter_ptr + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")     # releases the part stored above
        if arrived == num_splits - 1:
            y = tl.zeros([BLOCK_N], dtype=tl.float32)
            for part_index in range(0, num_splits):
                y += tl.load(partial_ptr + part_index * N + offs_n, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                y += tl.load(bias_ptr + cols).to(tl.float32)
            tl.store(c_ptr + offs_n, y.to(c_ptr.dtype.element_ty), mask=mask)
            tl.store(counter, 0)        # ready for the next call (and graph replay)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols).to(tl.float32)
        tl.store(c_ptr + offs_n, y.to(c_ptr.dtype.element_ty), mask=mask)


def gemv(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *, a_scale: torch.Tensor | None = None,
         b_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
         config: GemvConfig = GEMV_CONFIG) -> torch.Tensor:
    """a [1, K] @ b [N, K]^T (+ bias [N]) -> [1, N] in out_dtype (default a's), float32 sums. a in the model's
    dtype, or e4m3 with its scale ([1]); b in the model's dtype, or e4m3 with per-row scales ([N])."""
    num_rows, width = a.shape
    num_cols = b.shape[0]
    assert num_rows == 1 and b.shape[1] == width and a.stride(1) == 1 and b.stride(1) == 1
    out = torch.empty(1, num_cols, dtype=out_dtype or a.dtype, device=a.device)
    col_tiles = triton.cdiv(num_cols, config.block_n)
    splits = split_k(col_tiles, width, config, a.device)
    steps = triton.cdiv(triton.cdiv(width, config.block_k), splits)
    partial = torch.empty(splits, num_cols, dtype=torch.float32, device=a.device) if splits > 1 else out
    counters = _tile_counters(a.device)
    assert col_tiles <= counters.numel()
    _gemv_kernel[(col_tiles, splits)](
        a, a if a_scale is None else a_scale, b, b if b_scale is None else b_scale, b if bias is None else bias,
        out, partial, counters, num_cols, width, steps * config.block_k, b.stride(0), A_SCALED=a_scale is not None,
        B_SCALED=b_scale is not None, HAS_BIAS=bias is not None, EVEN_K=width % config.block_k == 0,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps, **pdl_options(a.device))
    return out


def skinny_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                a_scale: torch.Tensor | None = None, b_scale: torch.Tensor | None = None, block_scaled: bool = False,
                out_dtype: torch.dtype | None = None, config: SkinnyConfig | None = None) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T (+ bias [N]) -> [M, N] in out_dtype (default a's), float32 accumulation, for M
    within CONFIGS' buckets. FP8 operands come with their scales: per row of a and of b ([M], [N]), or with block_scaled per row and 128 columns of a
    ([M, ceil(K/128)]) and per 128x128 block of b. `config` overrides the tiles chosen for M."""
    num_rows, width = a.shape
    num_cols = b.shape[0]
    scales = NO_SCALES if a_scale is None else (BLOCK_SCALES if block_scaled else CHANNEL_SCALES)
    assert (a_scale is None) == (b_scale is None) and b.shape[1] == width
    assert a.stride(1) == 1 and b.stride(1) == 1
    config = config or choose_config(num_rows)
    assert config is not None and (scales != BLOCK_SCALES or config.block_k == 128)
    out = torch.empty(num_rows, num_cols, dtype=out_dtype or a.dtype, device=a.device)
    if num_rows == 0:
        return out
    row_tiles, col_tiles = triton.cdiv(num_rows, config.block_m), triton.cdiv(num_cols, config.block_n)
    splits = split_k(row_tiles * col_tiles, width, config, a.device)
    steps = triton.cdiv(triton.cdiv(width, config.block_k), splits)
    partial = (torch.empty(splits, num_rows, num_cols, dtype=torch.float32, device=a.device) if splits > 1
               else out)
    counters = _tile_counters(a.device)
    assert row_tiles * col_tiles <= counters.numel()
    launch(_skinny_gemm_kernel, (col_tiles, splits, row_tiles),
        a, a if a_scale is None else a_scale, b, b if b_scale is None else b_scale, b if bias is None else bias,
        out, partial, counters, num_rows, num_cols, width, steps * config.block_k,
        a.stride(0), a_scale.stride(0) if scales == BLOCK_SCALES else 0, b.stride(0), out.stride(0),
        b_scale.stride(0) if scales == BLOCK_SCALES else 0, SCALES=scales, HAS_BIAS=bias is not None,
        EVEN_K=width % config.block_k == 0, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_options(a.device))
    return out
