"""MoE kernel benchmark: route + fused_moe (nanovllm.kernels.moe_routing, .fused_moe) on one CUDA GPU, random
weights, bf16 or FP8 experts (--fp8 channel|block: e4m3 weights with per-row or 128x128-block scales).

    PYTHONPATH=. python benchmarks/bench_moe.py [--shape qwen3-30b-a3b|mixtral] [--fp8 channel|block] [--json] [--sweep]

Shapes: Qwen3-30B-A3B (H 2048, I 768, 128 experts, top-8) and Mixtral-8x7B (H 4096, I 14336, 8 experts,
top-2). Token counts 1, 16, 64, 256 (decode) and 4096, 16384 (prefill). Each call routes its own random
logits (a few sets in turn, so that no call finds the last one's experts in L2).

Columns: `graph us` is a call replayed in a CUDA graph (decode only: the GPU's time without launch
overhead), `eager us` the same calls launched from Python. `bytes` is the floor's traffic: the distinct
experts the call's tokens hit (counted from its topk_ids) x 3*H*I x 2 bytes (1 for FP8 experts, scales
aside), plus the hidden states read and the output written. GB/s and `% copy` use the faster of the two times against this device's device-to-device
copy bandwidth (bytes read + written, measured here); TFLOP/s counts 2*T*k*3*H*I against --peak-tflops.
Goals (H100): decode at 256 tokens >= 70% of the copy bandwidth, prefill at 16k tokens >= 50% of peak.

--sweep also times other tile configurations at each token count (printed before the table).
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import measure_bandwidth  # noqa: E402  (the copy bandwidth bench.py's floor uses)
from nanovllm.kernels.fused_moe import MoeConfig, Tile, choose_config, fused_moe  # noqa: E402
from nanovllm.kernels.moe_routing import route  # noqa: E402
from nanovllm.layers.quantization.fp8 import quantize_experts  # noqa: E402

SHAPES = {"qwen3-30b-a3b": dict(hidden=2048, inter=768, experts=128, top_k=8),
          "mixtral": dict(hidden=4096, inter=14336, experts=8, top_k=2)}
DECODE, PREFILL = (1, 16, 64, 256), (4096, 16384)
SWEEP = [MoeConfig(16, Tile(32, 128, 4, 4), Tile(64, 128, 4, 4)),
         MoeConfig(16, Tile(64, 256, 4, 2), Tile(64, 256, 4, 3)),
         MoeConfig(16, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4)),
         MoeConfig(32, Tile(64, 128, 4, 4), Tile(128, 128, 4, 3)),
         MoeConfig(64, Tile(64, 64, 4, 4), Tile(128, 64, 4, 4), splits=4),
         MoeConfig(64, Tile(128, 64, 8, 3), Tile(128, 64, 4, 4), splits=4),
         MoeConfig(128, Tile(64, 64, 4, 4), Tile(128, 64, 8, 4), splits=16),
         MoeConfig(128, Tile(128, 64, 8, 3), Tile(128, 64, 8, 4), splits=16),
         MoeConfig(128, Tile(128, 64, 8, 4), Tile(256, 64, 8, 3), splits=16)]

# FP8 experts: K steps of 128 (one scale block), two float32 accumulators (gate, up) plus a block-scaled
# step's product in registers
SWEEP_FP8 = [MoeConfig(16, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4)),
             MoeConfig(16, Tile(32, 128, 4, 4), Tile(64, 128, 4, 4)),
             MoeConfig(32, Tile(64, 128, 4, 4), Tile(128, 128, 4, 3)),
             MoeConfig(64, Tile(128, 128, 8, 3), Tile(128, 128, 4, 4), splits=4),
             MoeConfig(64, Tile(64, 128, 4, 4), Tile(128, 128, 4, 4), splits=4),
             MoeConfig(128, Tile(128, 128, 8, 4), Tile(256, 128, 8, 3), splits=16),
             MoeConfig(128, Tile(128, 128, 8, 3), Tile(128, 128, 8, 3), splits=16),
             MoeConfig(128, Tile(64, 128, 8, 4), Tile(128, 128, 8, 4), splits=16),
             MoeConfig(128, Tile(64, 128, 4, 4), Tile(128, 128, 4, 4), splits=16),
             MoeConfig(128, Tile(64, 128, 4, 3), Tile(256, 128, 8, 3), splits=16),
             MoeConfig(128, Tile(128, 64, 8, 4), Tile(256, 64, 8, 3), splits=16)]


def make_calls(shape, num_tokens, sets, config=None):
    """`sets` calls of route + fused_moe, each on its own hidden states and router logits; and the
    distinct experts each one hits."""
    w13, w2, scales = shape["w13"], shape["w2"], shape["scales"]
    calls, hit = [], []
    for _ in range(sets):
        x = torch.randn(num_tokens, shape["hidden"], device="cuda").bfloat16()
        logits = torch.randn(num_tokens, shape["experts"], device="cuda")
        hit.append(route(logits, shape["top_k"], True)[1].unique().numel())
        calls.append(lambda x=x, logits=logits: fused_moe(x, w13, w2, *route(logits, shape["top_k"], True),
                                                           config=config, **scales))
    return calls, hit


def time_us(calls, graph: bool, iters: int) -> float:
    """Microseconds per call: CUDA events around `iters` rounds of the calls, eager or one CUDA graph."""
    for call in calls:
        call()                                              # compile, allocate
    torch.cuda.synchronize()
    run = lambda: [call() for call in calls]
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        run = g.replay
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * len(calls))


def measure(shape, num_tokens, config=None, graph=None):
    decode = num_tokens <= 256
    calls, hit = make_calls(shape, num_tokens, 8 if decode else 2, config)
    iters = max(3, min(200, 2_000_000 // (num_tokens * shape["top_k"] * 64)))
    graph_us = time_us(calls, True, iters) if (decode if graph is None else graph) else None
    eager_us = time_us(calls, False, iters)
    return graph_us, eager_us, sum(hit) / len(hit)


def sweep(shape, counts):
    for num_tokens in counts:
        for config in SWEEP_FP8 if shape["scales"] else SWEEP:
            try:
                graph_us, eager_us, _ = measure(shape, num_tokens, config)
                print(f"  sweep T={num_tokens} {config}: {graph_us or eager_us:9.1f} us", flush=True)
            except Exception as e:                          # noqa: BLE001 - report and go on
                print(f"  sweep T={num_tokens} {config} failed: {type(e).__name__}: {str(e)[:120]}")
        chosen = choose_config(num_tokens, torch.bfloat16, shape["top_k"], shape["experts"], fp8=bool(shape["scales"]))
        print(f"  chosen for T={num_tokens}: {chosen}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", default=",".join(map(str, DECODE + PREFILL)), help="comma-separated T")
    parser.add_argument("--peak-tflops", type=float, default=800.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--fp8", choices=["channel", "block"], help="FP8 experts with this weight-scale scheme")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    torch.manual_seed(0)
    copy_bw = measure_bandwidth(torch.device("cuda"))
    shape = dict(SHAPES[args.shape])
    hidden, inter, experts, top_k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    shape["w13"] = (0.02 * torch.randn(experts, 2 * inter, hidden, device="cuda")).bfloat16()
    shape["w2"] = (0.02 * torch.randn(experts, hidden, inter, device="cuda")).bfloat16()
    shape["scales"], weight_bytes = {}, 2
    if args.fp8:
        w13 = shape["w13"]
        (gate, gate_scale), (up, up_scale), (shape["w2"], w2_scale) = (
            quantize_experts(w, args.fp8) for w in (w13[:, :inter], w13[:, inter:], shape["w2"]))
        shape["w13"] = torch.cat([gate, up], 1)
        shape["scales"], weight_bytes = dict(w13_scale=torch.cat([gate_scale, up_scale], 1), w2_scale=w2_scale), 1
        del w13, gate, up
    counts = [int(t) for t in args.tokens.split(",")]
    if args.sweep:
        sweep(shape, counts)

    rows = []
    for num_tokens in counts:
        graph_us, eager_us, hit = measure(shape, num_tokens)
        best = min(t for t in (graph_us, eager_us) if t is not None)
        moved = hit * 3 * hidden * inter * weight_bytes + 2 * num_tokens * hidden * 2
        flops = 2 * num_tokens * top_k * 3 * hidden * inter
        rows.append(dict(shape=args.shape, tokens=num_tokens, graph_us=graph_us, eager_us=eager_us,
                         experts_hit=hit, bytes=moved, gb_s=moved / best / 1e3,
                         pct_copy=100 * moved / (best * 1e-6) / copy_bw, tflops=flops / best / 1e6,
                         pct_peak=100 * flops / best / 1e6 / args.peak_tflops))
    if args.json:
        for row in rows:
            print(json.dumps(dict(row, experts=args.fp8 or "bf16", copy_gb_s=copy_bw / 1e9)))
        return
    print(f"{args.shape}: H={hidden} I={inter} E={experts} k={top_k}, {args.fp8 + ' FP8' if args.fp8 else 'bf16'} experts; copy bandwidth {copy_bw / 1e9:.0f} GB/s, "
          f"peak {args.peak_tflops:.0f} TFLOP/s ({torch.cuda.get_device_name()})")
    print(f"{'T':>6} {'graph us':>9} {'eager us':>9} {'experts':>7} {'MB':>8} {'GB/s':>7} {'% copy':>7} "
          f"{'TFLOP/s':>8} {'% peak':>7}")
    for r in rows:
        graph = f"{r['graph_us']:9.1f}" if r["graph_us"] is not None else f"{'-':>9}"
        print(f"{r['tokens']:>6} {graph} {r['eager_us']:9.1f} {r['experts_hit']:7.1f} {r['bytes'] / 1e6:8.1f} "
              f"{r['gb_s']:7.0f} {r['pct_copy']:6.1f}% {r['tflops']:8.1f} {r['pct_peak']:6.1f}%")


if __name__ == "__main__":
    main()
