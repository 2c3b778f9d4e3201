"""FP8 GEMM benchmark: nanovllm.kernels.fp8_gemm.fp8_linear (activation quantization + GEMM) against bf16
cuBLAS (F.linear) on one CUDA GPU, at Qwen3-8B's projection shapes, random weights.

    PYTHONPATH=. python benchmarks/bench_fp8_gemm.py [--tokens 1,16,256,4096,16384] [--json] [--sweep]

Paths: `bf16` F.linear; `triton-channel` / `scaled-mm` per-channel weights through our kernel or
torch._scaled_mm (row-wise scales); `unscaled` the same quantization, then fp8_gemm.unscaled_matmul (per-tensor
unit scales: what o_proj and down_proj run at 65-512 rows, their scales left to the norm after them);
`triton-block` 128x128 block weights through our kernel; `chosen` what fp8_linear picks for per-channel weights
at that M. Each time is one call (quantization included) in a CUDA
graph for M <= 256, eager above, over a few weight sets in turn (so that no call finds the last one's
weights in L2).

The floor of a call is the larger of its bytes over this device's device-to-device copy bandwidth
(measured here, as bench.py's floor) and its FLOPs over the peak (--peak-tflops for bf16, twice that for
FP8). Goals of issue 26: FP8 at or below 0.65x bf16's time at M = 1 (weight-bound), and about half at
M >= 4096 (compute-bound).

--sweep also times other tile configurations of our kernel at each M (printed before the table): the
numbers CONFIGS in nanovllm/kernels/fp8_gemm.py and SCALED_MM_MIN_TOKENS come from.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import measure_bandwidth  # noqa: E402  (the copy bandwidth bench.py's floor uses)
from benchmarks.bench_moe import time_us  # noqa: E402  (the same CUDA-event timing, eager or one graph)
from benchmarks.random_checkpoint import QWEN3_8B, projection_shapes  # noqa: E402
from nanovllm.kernels import fp8_gemm  # noqa: E402
from nanovllm.kernels.fp8_gemm import GemmConfig, SkinnyConfig  # noqa: E402
from nanovllm.layers.quantization.fp8 import quantize_weight  # noqa: E402

SHAPES = projection_shapes(QWEN3_8B)   # (N, K)
TOKENS = (1, 16, 256, 4096, 16384)
PATHS = ("bf16", "triton-channel", "scaled-mm", "unscaled", "triton-block", "chosen")
SWEEP = [GemmConfig(16, 32, 128, 4, 4), GemmConfig(16, 32, 128, 4, 6), GemmConfig(16, 64, 128, 4, 4),
         GemmConfig(16, 64, 64, 4, 6), GemmConfig(16, 128, 128, 4, 3), GemmConfig(32, 64, 128, 4, 5),
         GemmConfig(64, 64, 128, 4, 4), GemmConfig(64, 128, 128, 4, 4), GemmConfig(64, 128, 128, 8, 3),
         GemmConfig(128, 128, 128, 8, 3), GemmConfig(128, 128, 128, 8, 4), GemmConfig(128, 256, 128, 8, 3),
         GemmConfig(128, 128, 64, 4, 4)]
# the decode GEMM (M <= 16): (block_n, warps, stages, programs per SM before K stops being split)
SKINNY_SWEEP = [SkinnyConfig(*c) for c in ((64, 4, 4, 4), (32, 4, 4, 4), (64, 8, 3, 4), (32, 4, 6, 4), (16, 4, 4, 4),
                                           (32, 4, 4, 8), (64, 4, 4, 2), (128, 8, 3, 4), (64, 4, 4, 1))]


def weight_sets(n, k, sets):
    out = []
    for _ in range(sets):
        w = (0.02 * torch.randn(n, k, device="cuda")).bfloat16()
        out.append(dict(bf16=w, channel=quantize_weight(w, "channel"), block=quantize_weight(w, "block")))
    return out


def call_for(path, x, weights, config=None):
    """One call of `path` on x; with `config` ("channel" or "block" path), our kernel with those tiles."""
    if path == "bf16":
        return lambda: F.linear(x, weights["bf16"])
    block = path in ("triton-block", "block")
    q, s = weights["block" if block else "channel"]
    group = 128 if block else None
    if isinstance(config, SkinnyConfig):
        return lambda: fp8_gemm.fp8_skinny_gemm(*fp8_gemm.quantize_activations(x, group), q, s, x.dtype, block, config)
    if config is not None:
        return lambda: fp8_gemm.fp8_gemm(*fp8_gemm.quantize_activations(x, group), q, s, x.dtype, block, config)
    if block:
        return lambda: fp8_gemm.fp8_linear(x, q, s, block_scaled=True)
    if path == "unscaled":
        return lambda: fp8_gemm.unscaled_matmul(fp8_gemm.quantize_activations(x, None)[0], q, x.dtype)
    use = {"triton-channel": False, "scaled-mm": True, "chosen": None}[path]
    return lambda: fp8_gemm.fp8_linear(x, q, s, block_scaled=False, use_scaled_mm=use)


def measure(path, n, k, m, sets, config=None):
    x = torch.randn(m, k, device="cuda").bfloat16()
    calls = [call_for(path, x, w, config) for w in sets]
    iters = max(3, min(200, 20_000_000 // (m * n)))
    return time_us(calls, m <= 256, iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated M")
    parser.add_argument("--layers", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--peak-tflops", type=float, default=800.0, help="bf16 peak; FP8 counts twice that")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--schemes", default="channel,block", help="the weight scales --sweep times: channel, block")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    torch.manual_seed(0)
    copy_bw = measure_bandwidth(torch.device("cuda"))
    counts = [int(t) for t in args.tokens.split(",")]
    scaled_mm = torch.cuda.get_device_capability() >= (9, 0)
    rows = []
    for layer in args.layers.split(","):
        n, k = SHAPES[layer]
        sets = weight_sets(n, k, 4)
        for m in counts:
            if args.sweep:
                for scheme in args.schemes.split(","):
                    for config in (SWEEP if m > 16 else SWEEP[1:2] + SKINNY_SWEEP):
                        if isinstance(config, SkinnyConfig) and m > config.block_m:
                            continue
                        try:
                            us = measure(scheme, n, k, m, sets, config)
                            print(f"  sweep {layer} M={m} {scheme} {config}: {us:9.1f} us", flush=True)
                        except Exception as e:              # noqa: BLE001 - report and go on
                            print(f"  sweep {layer} M={m} {scheme} {config} failed: {type(e).__name__}: {str(e)[:100]}")
            for path in PATHS:
                if path in ("scaled-mm", "unscaled") and not scaled_mm:
                    continue
                us = measure(path, n, k, m, sets)
                fp8 = path != "bf16"
                moved = n * k * (1 if fp8 else 2) + m * k * 2 + m * n * 2
                flops = 2 * m * n * k
                floor_us = max(moved / copy_bw, flops / (args.peak_tflops * 1e12 * (2 if fp8 else 1))) * 1e6
                rows.append(dict(layer=layer, n=n, k=k, tokens=m, path=path, us=us, floor_us=floor_us,
                                 pct_floor=100 * floor_us / us, tflops=flops / us / 1e6))
    if args.json:
        for row in rows:
            print(json.dumps(dict(row, copy_gb_s=copy_bw / 1e9)))
        return
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s, bf16 peak {args.peak_tflops:.0f} TFLOP/s "
          f"({torch.cuda.get_device_name()}); fp8_linear picks _scaled_mm from M = {fp8_gemm.SCALED_MM_MIN_TOKENS}")
    print(f"{'layer':>8} {'M':>6} {'path':>15} {'us':>9} {'vs bf16':>8} {'floor us':>9} {'% floor':>8} {'TFLOP/s':>8}")
    for r in rows:
        bf16 = next(b["us"] for b in rows if b["layer"] == r["layer"] and b["tokens"] == r["tokens"] and b["path"] == "bf16")
        print(f"{r['layer']:>8} {r['tokens']:>6} {r['path']:>15} {r['us']:9.1f} {r['us'] / bf16:7.2f}x "
              f"{r['floor_us']:9.1f} {r['pct_floor']:7.1f}% {r['tflops']:8.1f}")


if __name__ == "__main__":
    main()
