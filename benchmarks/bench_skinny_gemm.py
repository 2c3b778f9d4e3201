"""Decode GEMM benchmark: nanovllm.kernels.skinny_gemm against cuBLAS (F.linear) in bf16 on one CUDA GPU, at
Qwen3-0.6B's and Qwen3-8B's projection shapes and a decode step's row counts, random weights.

    PYTHONPATH=. python benchmarks/bench_skinny_gemm.py [--tokens 1,4,16,64,256] [--shapes 0.6b,8b] [--sweep]
    PYTHONPATH=. python benchmarks/bench_skinny_gemm.py --shapes 8b --tokens 192,256 --sweep   # a decode step's
        largest batches: the whole batch in one 256-row tile against cuBLAS and cuBLASLt

Each time is one call in a CUDA graph (as a decode step replays it), cycling through enough weight copies
that no call finds its weights in L2 (a decode step streams every layer's weights from memory). The floor
is the bytes moved (weights, activations, output) over this device's copy bandwidth, measured here as
bench.py's floor is. `cuBLAS` is F.linear as torch runs it by default, `skinny` the kernel with the tiles
chosen for M (CONFIGS), `linear` what the model's linear layers run (unquantized.dense_linear: the GEMV, the
skinny GEMM, cuBLASLt for LT_ROWS, or cuBLAS); --sweep also times other tiles (printed
before the table): the numbers CONFIGS comes from.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import measure_bandwidth  # noqa: E402  (the copy bandwidth bench.py's floor uses)
from benchmarks.bench_moe import time_us  # noqa: E402  (CUDA events around rounds of one CUDA graph)
from nanovllm.kernels import skinny_gemm  # noqa: E402
from nanovllm.kernels.skinny_gemm import SkinnyConfig  # noqa: E402
from nanovllm.layers.quantization.unquantized import dense_linear  # noqa: E402

SHAPES = {   # (N, K) of each projection
    "0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
             "lm_head": (151936, 1024)},
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
           "lm_head": (151936, 4096)},
}
TOKENS = (1, 4, 16, 32, 64, 128, 192, 256)
L2_BYTES = 50 << 20


def sweep_configs(m: int) -> list[SkinnyConfig]:
    """Tiles worth trying at M rows: (block_n, warps, stages, programs per SM, block_m, block_k)."""
    block_m = max(16, 1 << (m - 1).bit_length())
    if block_m > 128:
        block_m = 128
    grid = [(64, 4, 4, 1), (64, 4, 4, 2), (64, 4, 4, 4), (32, 4, 4, 2), (32, 4, 6, 2), (128, 4, 3, 2),
            (128, 8, 3, 1), (128, 8, 4, 2), (64, 8, 4, 2)]
    configs = [SkinnyConfig(n, w, s, p, block_m, 128) for n, w, s, p in grid]
    configs += [SkinnyConfig(64, 4, 3, 2, block_m, 256), SkinnyConfig(32, 4, 4, 2, block_m, 256),
                SkinnyConfig(64, 4, 6, 2, block_m, 64)]
    if block_m == 128:
        configs += [SkinnyConfig(64, 4, 4, 2, 64, 128), SkinnyConfig(128, 4, 3, 2, 64, 128)]
    if 128 < m <= 256:
        # the whole batch in one row tile, so that each weight tile is read once (row tiles are the grid's
        # slowest axis): 64-deep K steps keep 3-4 stages of a 256-row A tile within shared memory
        configs += [SkinnyConfig(n, w, s, p, 256, 64) for n, w, s, p in
                    [(64, 8, 3, 1), (64, 8, 4, 1), (64, 8, 4, 2), (64, 4, 4, 1), (128, 8, 3, 1), (128, 8, 4, 1),
                     (128, 8, 3, 2), (32, 4, 4, 1), (32, 8, 4, 2)]]
    return configs


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Enough copies of an [n, k] weight to fill L2 twice over."""
    sets = max(2, -(-2 * L2_BYTES // (n * k * 2)))
    return [(0.02 * torch.randn(n, k, device="cuda")).bfloat16() for _ in range(sets)]


def measure(weights: list[torch.Tensor], m: int, call) -> float:
    x = torch.randn(m, weights[0].shape[1], device="cuda").bfloat16()
    calls = [lambda w=w: call(x, w) for w in weights]
    iters = max(5, min(100, 200_000_000 // (len(weights) * weights[0].numel() * 2)))
    return time_us(calls, True, iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated M")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    torch.manual_seed(0)
    copy_bw = measure_bandwidth(torch.device("cuda"))
    counts = [int(t) for t in args.tokens.split(",")]
    rows = []
    for model in args.shapes.split(","):
        for layer, (n, k) in SHAPES[model].items():
            weights = weight_copies(n, k)
            for m in counts:
                floor_us = (n * k + m * k + m * n) * 2 / copy_bw * 1e6
                if args.sweep:
                    for config in sweep_configs(m):
                        try:
                            us = measure(weights, m, lambda x, w, c=config: skinny_gemm.skinny_gemm(x, w, config=c))
                            print(f"  sweep {model} {layer} M={m} {config}: {us:8.1f} us ({floor_us / us:.0%})",
                                  flush=True)
                        except Exception as e:              # noqa: BLE001 - report and go on
                            print(f"  sweep {model} {layer} M={m} {config} failed: {type(e).__name__}: {str(e)[:90]}")
                cublas = measure(weights, m, lambda x, w: F.linear(x, w))
                ours = (measure(weights, m, lambda x, w: skinny_gemm.skinny_gemm(x, w))
                        if skinny_gemm.choose_config(m) else None)
                tiles = skinny_gemm.CONFIGS if layer == "lm_head" else None     # what the layers pass
                chosen = measure(weights, m, lambda x, w: dense_linear(x, w, None, tiles))
                rows.append((model, layer, n, k, m, floor_us, cublas, ours, chosen))
            del weights
            torch.cuda.empty_cache()
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s ({torch.cuda.get_device_name()}); us per call, % of floor")
    print(f"{'model':>5} {'layer':>8} {'M':>4} {'floor':>7} {'cuBLAS':>15} {'skinny':>15} {'linear':>15} {'gain':>6}")
    for model, layer, n, k, m, floor_us, cublas, ours, chosen in rows:
        cell = lambda us: f"{us:7.1f} ({floor_us / us:4.0%})" if us else f"{'-':>15}"
        print(f"{model:>5} {layer:>8} {m:>4} {floor_us:7.1f} {cell(cublas)} {cell(ours)} {cell(chosen)} "
              f"{cublas / chosen:5.2f}x")


if __name__ == "__main__":
    main()
