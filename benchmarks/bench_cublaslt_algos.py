"""Decode GEMM benchmark: the engine's bf16 projection (nanovllm.layers.quantization.unquantized.dense_linear:
cuBLASLt's first heuristic choice at 17-384 rows, cuBLAS elsewhere) against every algorithm cuBLASLt's heuristic
lists for the same problem, each run through cuBLASLt directly (ctypes on torch's own libcublasLt) inside a CUDA
graph, at Qwen3-8B's projections and the LM head.

    PYTHONPATH=. python benchmarks/bench_cublaslt_algos.py [--rows 32,64,128,192,256] [--algos 32]
    PYTHONPATH=. python benchmarks/bench_cublaslt_algos.py --rows 16384 --shapes qkv,o,gate_up,down  # prefill
    PYTHONPATH=. python benchmarks/bench_cublaslt_algos.py --fp8   # e4m3 operands, scales left to the reader

With --fp8 the problem is the engine's deferred-scale FP8 product (fp8_gemm.unscaled_matmul: e4m3 activations and
weights, unit scales, fast accumulation, bf16 out; the row and column scales applied by the norm or SiLU after
it), and "engine us" is its whole routing for the rows (fp8_gemm.fp8_matmul, scales included).

Issue #38's bf16 standard row spends ~60% of a decode step in these GEMMs at ~83% of the weight-read floor, in
both engines (docs/benchmarks.md). Torch takes cuBLASLt's first heuristic answer; the heuristic ranks by a model,
not by a run, and lists others. If one of them is several percent faster at these rows, the engine could pin it
per (rows, N, K) from a table measured at warm-up, as its decode graphs would replay it. Each algorithm's output
is checked against torch's before it is timed; one that fails or errs is reported, not timed. The weights cycle
through copies larger than the L2 cache, as a decode step reads each once.

Status (thirty-sixth session, one H100; docs/benchmarks.md): the best listed algorithm, shape by shape, takes
0.5-3.6% less than the engine's GEMMs at 32-256 rows (a Qwen3-8B layer's four projections: 146.6-174.0 us
against 149.8-177.6), ~1-2% of a decode step; at prefill rows (--pin 16384 across 1,024-16,384 rows) no algorithm
wins at every row count, and two timings of the engine's own call differ by up to 15% at 12,000-16,000 rows (the
power-limited clock). Nothing pinned in the engine.
"""
import argparse
import ctypes
import glob
import os

import torch
import torch.nn.functional as F

from benchmarks.bench_moe import time_us   # CUDA events around rounds of the calls
from benchmarks.random_checkpoint import QWEN3_8B, projection_shapes
from nanovllm.kernels import fp8_gemm
from nanovllm.layers.quantization.unquantized import dense_linear

SHAPES = dict(projection_shapes(QWEN3_8B), lm_head=(QWEN3_8B["vocab_size"], QWEN3_8B["hidden_size"]))    # (N, K)
L2_BYTES = 50 << 20
WORKSPACE_BYTES = 32 << 20

# cublasLt.h / library_types.h values
CUDA_R_32F, CUDA_R_16BF, CUDA_R_8F_E4M3, CUBLAS_COMPUTE_32F = 0, 14, 28, 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_FAST_ACCUM, PREF_MAX_WORKSPACE_BYTES = 3, 4, 25, 1
ALGO_CONFIG = {"id": 0, "tile": 1, "splitk": 2, "swizzle": 4, "stages": 6, "cluster": 8}    # cublasLtMatmulAlgoConfigAttributes_t


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_cublaslt() -> ctypes.CDLL:
    """The libcublasLt torch loaded (after a GEMM of dense_linear's cuBLASLt rows), else the first one found beside
    torch's packages."""
    a = torch.ones(32, 64, device="cuda", dtype=torch.bfloat16)
    dense_linear(a, a[:16], None).sum().item()
    with open("/proc/self/maps") as maps:
        loaded = sorted({line.split()[-1] for line in maps if "libcublasLt.so" in line})
    candidates = loaded or sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "**",
                                                         "libcublasLt.so*"), recursive=True))
    assert candidates, "no libcublasLt found"
    return ctypes.CDLL(candidates[0])


class LtGemm:
    """y[M, N] = x[M, K] @ w[N, K]^T, bf16 out (float32 accumulation), as column-major D[N, M] = w^T' x: the
    layout torch's F.linear hands cuBLASLt (A = w transposed, B = x as it is). fp8: x and w e4m3, unit scales,
    fast accumulation (as torch._scaled_mm with use_fast_accum)."""

    def __init__(self, lib: ctypes.CDLL, handle: ctypes.c_void_p, rows: int, n: int, k: int, fp8: bool = False):
        self.lib, self.handle, self.rows, self.n, self.k = lib, handle, rows, n, k
        self.desc, self.a, self.b, self.d, self.pref = (ctypes.c_void_p() for _ in range(5))
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F))
        for attribute, op in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N)):
            value = ctypes.c_int(op)
            check(lib.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(value), ctypes.c_size_t(4)))
        if fp8:
            fast = ctypes.c_int8(int(fp8_gemm.SCALED_MM_FAST_ACCUM))
            check(lib.cublasLtMatmulDescSetAttribute(self.desc, DESC_FAST_ACCUM, ctypes.byref(fast),
                                                     ctypes.c_size_t(1)))
        operand_type = CUDA_R_8F_E4M3 if fp8 else CUDA_R_16BF
        for layout, (r, c), kind in ((self.a, (k, n), operand_type), (self.b, (k, rows), operand_type),
                                     (self.d, (n, rows), CUDA_R_16BF)):
            check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), kind, ctypes.c_uint64(r),
                                                 ctypes.c_uint64(c), ctypes.c_int64(r)))
        check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)))
        workspace = ctypes.c_uint64(WORKSPACE_BYTES)
        check(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(workspace),
                                                       ctypes.c_size_t(8)))
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")

    def algorithms(self, count: int) -> list[HeuristicResult]:
        results, returned = (HeuristicResult * count)(), ctypes.c_int(0)
        check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.d, self.d,
                                                      self.pref, count, results, ctypes.byref(returned)))
        return [results[i] for i in range(returned.value) if results[i].state == 0]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, algo: HeuristicResult) -> int:
        return self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), self.a,
            ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta), ctypes.c_void_p(out.data_ptr()), self.d,
            ctypes.c_void_p(out.data_ptr()), self.d, ctypes.byref(algo.algo),
            ctypes.c_void_p(self.workspace.data_ptr()), ctypes.c_size_t(WORKSPACE_BYTES),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))


def check(status: int) -> None:
    assert status == 0, f"cuBLASLt status {status}"


def describe(lib: ctypes.CDLL, result: HeuristicResult) -> str:
    """An algorithm's configuration as cuBLASLt reports it (its id, tile and stage enums, split-K, CTA swizzle,
    cluster shape enum)."""
    fields = []
    for name, attribute in ALGO_CONFIG.items():
        size, value = ctypes.c_size_t(0), ctypes.c_uint64(0)
        lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(result.algo), attribute, None, ctypes.c_size_t(0),
                                                 ctypes.byref(size))
        check(lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(result.algo), attribute, ctypes.byref(value),
                                                       size, ctypes.byref(size)))
        fields.append(f"{name}={value.value}")
    return " ".join(fields)


def weight_copies(n: int, k: int, width: int) -> list[torch.Tensor]:
    """Copies of a random [n, k] bf16 weight that together, at `width` bytes a value, are at least twice the L2
    cache: cycled through, each call reads its weight from memory as a decode step does."""
    copies = max(2, -(-2 * L2_BYTES // (n * k * width)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def time_algorithm(gemm: "LtGemm", x: torch.Tensor, weights: list[torch.Tensor], out: torch.Tensor,
                   want: torch.Tensor, algo: HeuristicResult, iters: int) -> float | str:
    """us a call of one algorithm over the weight copies in a CUDA graph, once its output is checked against
    `want`; "err" where cuBLASLt refuses it, "wrong" where its output differs."""
    out.zero_()
    if gemm(x, weights[0], out, algo) != 0:
        return "err"
    torch.cuda.synchronize()
    if not torch.allclose(out.float(), want, atol=2e-2, rtol=2e-2):
        return "wrong"
    return time_us([lambda w=w: gemm(x, w, out, algo) for w in weights], graph=True, iters=iters)


def measure_pinned(lib, handle, name: str, pin_rows: int, rows_list: list[int], num_algos: int) -> None:
    """The algorithms cuBLASLt's heuristic lists at pin_rows, each run at every row count in rows_list (as an
    engine that pins one algorithm per (N, K) for every large batch would run it), against the engine's own
    GEMM, bf16. Prints one line per row count: engine us twice (the noise), then each algorithm's us."""
    n, k = SHAPES[name]
    weights = weight_copies(n, k, width=2)
    algos = LtGemm(lib, handle, pin_rows, n, k).algorithms(num_algos)
    for index, algo in enumerate(algos):
        print(f"  {name} algo {index} (listed at {pin_rows} rows): {describe(lib, algo)}", flush=True)
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        want = F.linear(x, weights[0]).float()
        engine = [time_us([lambda w=w: dense_linear(x, w, None) for w in weights], graph=True, iters=10)
                  for _ in range(2)]
        gemm, out = LtGemm(lib, handle, rows, n, k), torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        timed = [time_algorithm(gemm, x, weights, out, want, algo, iters=10) for algo in algos]
        cells = [f"{index}:{us:.1f}" if isinstance(us, float) else f"{index}:{us}" for index, us in enumerate(timed)]
        print(f"{name:8s} {rows:6d} engine {engine[0]:8.1f} {engine[1]:8.1f} | " + " ".join(cells), flush=True)


def measure(lib, handle, name: str, rows: int, num_algos: int, fp8: bool = False) -> dict:
    n, k = SHAPES[name]
    width = 1 if fp8 else 2
    weights = weight_copies(n, k, width)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    if fp8:
        x, x_scale = fp8_gemm.quantize_activations(x)
        quantized = [fp8_gemm.quantize_activations(w) for w in weights]
        weights = [q for q, _ in quantized]
        want = fp8_gemm.unscaled_matmul(x, weights[0], torch.bfloat16).float()
        engine_us = time_us([lambda w=w, s=s: fp8_gemm.fp8_matmul(x, x_scale, w, s, False, torch.bfloat16)
                             for w, s in quantized], graph=True, iters=20)
    else:
        want = F.linear(x, weights[0]).float()
        engine_us = time_us([lambda w=w: dense_linear(x, w, None) for w in weights], graph=True, iters=20)
    gemm = LtGemm(lib, handle, rows, n, k, fp8)
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    timed, failed = [], 0
    for index, algo in enumerate(gemm.algorithms(num_algos)):
        us = time_algorithm(gemm, x, weights, out, want, algo, iters=20)
        if isinstance(us, float):
            timed.append((us, index, algo.waves_count))
        else:
            failed += 1
    best_us, best_index, waves = min(timed, default=(float("nan"), -1, float("nan")))
    first_us = timed[0][0] if timed and timed[0][1] == 0 else float("nan")     # the heuristic's own choice
    floor_us = n * k * width / 3.0e12 * 1e6       # the weights once at ~3.0 TB/s (the copy rate measured)
    return dict(shape=name, rows=rows, engine_us=engine_us, first_us=first_us, best_us=best_us,
                best_index=best_index, waves=waves, algos=len(timed), failed=failed, floor_us=floor_us)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="32,64,128,192,256")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--algos", type=int, default=32, help="how many of the heuristic's algorithms to time")
    parser.add_argument("--fp8", action="store_true", help="the deferred-scale FP8 product (e4m3 operands)")
    parser.add_argument("--pin", type=int, default=0, help="run the algorithms listed at this many rows at every "
                        "--rows count (bf16)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    torch.manual_seed(0)
    lib = load_cublaslt()
    for fn in ("cublasLtMatmul", "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmulAlgoConfigGetAttribute"):
        getattr(lib, fn).restype = ctypes.c_int
    handle = ctypes.c_void_p()
    check(lib.cublasLtCreate(ctypes.byref(handle)))
    if args.pin:
        for name in args.shapes.split(","):
            measure_pinned(lib, handle, name, args.pin, [int(r) for r in args.rows.split(",")], args.algos)
        return
    print(f"{'shape':8s} {'rows':>5s} {'engine us':>10s} {'lt first':>9s} {'lt best':>9s} {'best/engine':>11s} "
          f"{'index':>5s} {'waves':>6s} {'algos':>5s} {'failed':>6s} {'engine % floor':>14s} {'TFLOP/s':>8s}",
          flush=True)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        for rows in map(int, args.rows.split(",")):
            r = measure(lib, handle, name, rows, args.algos, args.fp8)
            print(f"{r['shape']:8s} {r['rows']:5d} {r['engine_us']:10.1f} {r['first_us']:9.1f} {r['best_us']:9.1f} "
                  f"{r['best_us'] / r['engine_us']:11.3f} {r['best_index']:5d} {r['waves']:6.2f} {r['algos']:5d} "
                  f"{r['failed']:6d} {100 * r['floor_us'] / r['engine_us']:13.0f}% "
                  f"{2 * rows * n * k / r['engine_us'] / 1e6:8.1f}", flush=True)


if __name__ == "__main__":
    main()
