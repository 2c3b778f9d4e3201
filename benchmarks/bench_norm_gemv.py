"""One-stream decode prototype: RMSNorm (with the residual add) computed in the prologue of the one-row GEMV that
reads its output, against the engine's two kernels (pointwise.rms_norm, then skinny_gemm.gemv), for weights in
bf16 and in FP8 with per-row scales (a lone row reaches the GEMV unquantized either way: fp8_gemm.reads_unquantized).

    PYTHONPATH=. python benchmarks/bench_norm_gemv.py            # GPU: chains of Qwen3-8B's MLP, CUDA graphs
    PYTHONPATH=. python benchmarks/bench_norm_gemv.py --dry      # CPU (the interpreter): the values only

A one-stream decode step of Qwen3-8B runs two RMSNorms a layer (72 a token), each one program over a 4,096-wide
row between two weight-streaming kernels: a few microseconds of latency each that dependent launches hide only
in part (the GEMV after a norm may prefetch its first weight tile, no more, before the norm's output exists).
Here every program of the GEMV reads the two rows (16 KB, from L2), reduces the row's sum of squares itself, and
normalizes each K step's slice of it as it loads it, the rounding as rms_norm_row's; program (0, 0) also writes
the residual sum. The chain timed is what a layer's MLP half is: norm -> gate_up (24,576 x 4,096) -> SiLU-and-mul
-> down (4,096 x 12,288) -> the next norm, so each norm waits on the GEMV before it as in the engine. Times in
us per layer, two runs; the fused output checked against the two kernels' first.

Status: measured and dropped (thirty-sixth session, one H100): the layer's MLP half in bf16 106.70 / 106.77 us
with the two kernels, 107.37 / 107.46 fused (0.6% slower: every program's sum of squares costs more than the
launch it saves); FP8 weights 66.85 / 66.83 against 65.98 / 65.97 (1.3% faster, ~0.8% of a token at best). The
fused output equal to the two kernels' on the GPU as well (difference 0 of its scale). The engine keeps its two
kernels; the one-stream rows meet their goal without it (docs/benchmarks.md).
"""
import argparse
import os

import torch
import triton
import triton.language as tl

from nanovllm.kernels import pointwise, skinny_gemm
from nanovllm.kernels.dependent_launch import dependent_launches, pdl_options, start_dependents, wait_for_producers

HIDDEN, INTERMEDIATE = 4096, 12288          # Qwen3-8B
EPS = 1e-6


@triton.jit
def _normed_slice(x_ptr, residual_ptr, norm_w_ptr, k, offs_k, K, r, EVEN_K: tl.constexpr):
    """Columns k + offs_k of rms_norm(x + residual) * norm_w, given the row's 1 / rms r, rounded as
    pointwise.rms_norm_row rounds them (float32, zero past K)."""
    inside = offs_k < K - k
    if EVEN_K:
        x = tl.load(x_ptr + k + offs_k)
        s = x.to(tl.float32) + tl.load(residual_ptr + k + offs_k).to(tl.float32)
        w = tl.load(norm_w_ptr + k + offs_k).to(tl.float32)
    else:
        x = tl.load(x_ptr + k + offs_k, mask=inside, other=0.0)
        s = x.to(tl.float32) + tl.load(residual_ptr + k + offs_k, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(norm_w_ptr + k + offs_k, mask=inside, other=0.0).to(tl.float32)
    return ((s * r).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)


@triton.jit
def _norm_gemv_kernel(x_ptr, residual_ptr, norm_w_ptr, residual_out_ptr, b_ptr, b_scale_ptr, c_ptr, partial_ptr,
                      counter_ptr, N, K, k_per_split, stride_b, eps, B_SCALED: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """c [1, N] = (rms_norm(x + residual) * norm_w) @ b [N, K]^T, K split over programs as in skinny_gemm's
    _gemv_kernel, its parts met by the same gemv_store; residual_out = x + residual, written by program (0, 0)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_splits = tl.num_programs(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    cols = (offs_n % N).to(tl.int64)
    b_ptrs = b_ptr + cols[:, None] * stride_b + offs_k[None, :]
    k_first = pid_k * k_per_split
    first = offs_k < K - k_first
    b = tl.load(b_ptrs + k_first, mask=first[None, :], other=0.0)     # no earlier kernel writes the weights
    start_dependents(PDL)
    wait_for_producers(PDL)
    # the whole row's sum of squares, in every program (two rows of 8 KB, from L2 after the first reads)
    hidden = tl.arange(0, BLOCK_H)
    inside = hidden < K
    x_row = tl.load(x_ptr + hidden, mask=inside, other=0.0)
    h = x_row.to(tl.float32) + tl.load(residual_ptr + hidden, mask=inside, other=0.0).to(tl.float32)
    if (pid_n == 0) & (pid_k == 0):
        tl.store(residual_out_ptr + hidden, h.to(x_row.dtype), mask=inside)
    r = tl.rsqrt(tl.sum(h * h, 0) / K + eps)
    a = _normed_slice(x_ptr, residual_ptr, norm_w_ptr, k_first, offs_k, K, r, False)
    acc = b.to(tl.float32) * a[None, :]
    for k in range(k_first + BLOCK_K, tl.minimum(k_first + k_per_split, K), BLOCK_K):
        if EVEN_K:
            b = tl.load(b_ptrs + k)
        else:
            b = tl.load(b_ptrs + k, mask=(offs_k < K - k)[None, :], other=0.0)
        a = _normed_slice(x_ptr, residual_ptr, norm_w_ptr, k, offs_k, K, r, EVEN_K)
        acc += b.to(tl.float32) * a[None, :]
    y = tl.sum(acc, axis=1)
    if B_SCALED:
        y = y * tl.load(b_scale_ptr + cols)
    skinny_gemm.gemv_store(y, offs_n, cols, N, pid_n, pid_k, num_splits, c_ptr, partial_ptr, counter_ptr, c_ptr,
                           False, BLOCK_N)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, b: torch.Tensor,
              b_scale: torch.Tensor | None = None,
              config: skinny_gemm.GemvConfig = skinny_gemm.GEMV_CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * norm_weight @ b^T [1, N], x + residual [1, K]) for one row x [1, K]."""
    width, num_cols = x.shape[1], b.shape[0]
    out = torch.empty(1, num_cols, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x)
    col_tiles = triton.cdiv(num_cols, config.block_n)
    splits = skinny_gemm.split_k(col_tiles, width, config, x.device)
    steps = triton.cdiv(triton.cdiv(width, config.block_k), splits)
    partial = torch.empty(splits, num_cols, dtype=torch.float32, device=x.device) if splits > 1 else out
    counters = skinny_gemm._tile_counters(x.device)
    _norm_gemv_kernel[(col_tiles, splits)](
        x, residual, norm_weight, residual_out, b, b if b_scale is None else b_scale, out, partial, counters,
        num_cols, width, steps * config.block_k, b.stride(0), EPS, B_SCALED=b_scale is not None,
        EVEN_K=width % config.block_k == 0, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        BLOCK_H=triton.next_power_of_2(width), num_warps=config.num_warps, **pdl_options(x.device))
    return out, residual_out


def two_kernels(x, residual, norm_weight, b, b_scale=None):
    """The engine's way: rms_norm with the residual, then the GEMV of its output."""
    h, residual_out = pointwise.rms_norm(x, norm_weight, EPS, residual)
    return skinny_gemm.gemv(h, b, b_scale=b_scale, out_dtype=x.dtype), residual_out


def weights(n: int, k: int, fp8: bool, device: str):
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    if not fp8:
        return w, None
    scale = w.abs().amax(1).float() / 448.0
    return (w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def check(device: str, hidden: int, inter: int, fp8: bool) -> float:
    """The fused kernel's output and residual against the two kernels': the largest difference relative to the
    output's scale (the sum of squares may be reduced in another order: a unit in the last place of r)."""
    torch.manual_seed(0)
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
    residual = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
    norm_weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(torch.bfloat16)
    b, b_scale = weights(inter, hidden, fp8, device)
    want, want_residual = two_kernels(x, residual, norm_weight, b, b_scale)
    got, got_residual = norm_gemv(x, residual, norm_weight, b, b_scale)
    assert torch.equal(got_residual, want_residual)
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def time_chain(fused: bool, fp8: bool, layers: int) -> list[float]:
    """us per layer of `layers` MLP halves (norm, gate_up, down) in one CUDA graph, two runs."""
    up = [weights(2 * INTERMEDIATE, HIDDEN, fp8, "cuda") for _ in range(layers)]
    down = [weights(HIDDEN, INTERMEDIATE, fp8, "cuda") for _ in range(layers)]
    norm_weight = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)

    def chain():
        h, r = x, residual
        for (w_up, s_up), (w_down, s_down) in zip(up, down):
            y, r = (norm_gemv if fused else two_kernels)(h, r, norm_weight, w_up, s_up)
            h = skinny_gemm.gemv(pointwise.silu_and_mul(y), w_down, b_scale=s_down, out_dtype=torch.bfloat16)
        return h
    with dependent_launches(True):
        chain()                     # compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
    times = []
    for _ in range(2):
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (20 * layers))
    return times


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry", action="store_true", help="the values only, at small widths (any device)")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args(argv)
    results = []
    if args.dry or not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available(), "TRITON_INTERPRET=1 on a CPU"
        device = "cuda" if torch.cuda.is_available() else "cpu"
        for fp8 in (False, True):
            # 4,352 columns: K split in two over uneven steps (the interpreter's 4 "SMs"); 96 weight rows
            results.append(dict(fp8=fp8, relative_difference=check(device, 4352, 96, fp8)))
            print(f"{'fp8' if fp8 else 'bf16'}: fused against two kernels, largest difference "
                  f"{results[-1]['relative_difference']:.2e} of the output's scale", flush=True)
        return results
    for fp8 in (False, True):
        difference = check("cuda", HIDDEN, 2 * INTERMEDIATE, fp8)
        plain, fused = time_chain(False, fp8, args.layers), time_chain(True, fp8, args.layers)
        results.append(dict(fp8=fp8, relative_difference=difference, plain_us=plain, fused_us=fused))
        print(f"{'fp8' if fp8 else 'bf16'}: a layer's MLP half {plain[0]:.2f} / {plain[1]:.2f} us with two kernels, "
              f"{fused[0]:.2f} / {fused[1]:.2f} fused (output difference {difference:.2e} of its scale)", flush=True)
    return results


if __name__ == "__main__":
    main()
