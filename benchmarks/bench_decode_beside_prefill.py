"""Decode beside prefill: does a decode step (memory-bound: the weights and every sequence's K/V read once)
run alongside a prefill chunk (compute-bound: cuBLAS GEMMs on the tensor cores) on two CUDA streams in less
time than the two one after the other? At Qwen3-8B's layer shapes in bf16, random weights, through the
engine's kernels (RMSNorm with the residual, decode attention over 256-token pages, prefill attention,
SiLU-and-mul) and cuBLAS; each side captured in a CUDA graph of its own.

    PYTHONPATH=. python benchmarks/bench_decode_beside_prefill.py [--layers 8] [--batch 256]

Why: bench.py's standard workload on Qwen3-8B spends ~3.5 s of ~16 s prefilling (tensor cores busy, HBM
idle) and ~12.6 s decoding (HBM busy, tensor cores mostly idle); both engines run the two one after the
other, and both are within 5% of each other (issue #38). Overlapped perfectly, the decode work would hide the
prefill's; a step-level engine change is only worth making if two streams overlap them at all. cuBLAS's prefill
GEMMs take every SM (one CTA an SM), so each variant also carves SMs out of the prefill's GEMMs
(torch._C._set_sm_carveout_experimental: cuBLAS's SM count target) to leave room for the decode kernels, and
optionally gives the decode stream the higher priority.

Printed per variant: each side alone, the two one after the other (`serial`), on two streams (`beside`),
in ms for K decode steps and one prefill chunk (K chosen so the two sides take about as long), and the
overlap gain serial / beside (1.00: none; 2.00: one side wholly hidden).

Measured (one H100, 2026-12-08, docs/benchmarks.md's forty-first session, 8 layers): beside gains 0.99-1.04x
(best 1.03-1.04x with 64 decode rows on a high-priority stream): the two take turns on the SMs. But the
carve-out was not applied: the check GEMM took 4.13 ms on all 132 SMs and 4.14 told to leave 66 free (torch's
default F.linear path, cuBLAS not cuBLASLt, ignored the SM count target), so the carved rows measured nothing
more. --cublaslt routes the GEMMs through cuBLASLt, which the carve-out reaches; not yet run.
"""
import argparse
import math

import torch
import torch.nn.functional as F

from benchmarks.bench_prefill_streams import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, make_layers, run_layers
from nanovllm.kernels import pointwise
from nanovllm.kernels.decode_attention import flash_attn_with_kvcache

PAGE = 256


def decode_inputs(batch: int, mean_context: int, device: str = "cuda"):
    """A decode batch over a paged cache: contexts uniform in [mean/6, 11 mean/6] (the standard workload's
    spread), pages shuffled."""
    gen = torch.Generator().manual_seed(0)
    lo = max(1, mean_context // 6)
    contexts = torch.randint(lo, 2 * mean_context - lo + 1, (batch,), generator=gen)
    pages = [math.ceil(int(c) / PAGE) for c in contexts]
    width = max(pages)
    order = torch.randperm(sum(pages), generator=gen)
    block_table = torch.zeros(batch, width, dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        block_table[b, :n] = order[start:start + n]
        start += n
    k_cache = torch.randn(sum(pages), PAGE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    return dict(x=torch.randn(batch, HIDDEN, device=device, dtype=torch.bfloat16) * 0.1,
                residual=torch.randn(batch, HIDDEN, device=device, dtype=torch.bfloat16),
                k_cache=k_cache, v_cache=v_cache, cache_seqlens=contexts.to(device=device, dtype=torch.int32),
                block_table=block_table.to(device))


def decode_layers(layers: list[dict], inputs: dict):
    """A decode step's layers (RoPE and the K/V store left out: a few us a layer)."""
    x, residual, batch = inputs["x"], inputs["residual"], inputs["x"].shape[0]
    for w in layers:
        h, residual = pointwise.rms_norm(x, w["norm1"], 1e-6, residual)
        q = F.linear(h, w["qkv"])[:, :HEADS * HEAD_DIM].reshape(batch, 1, HEADS, HEAD_DIM)
        o = flash_attn_with_kvcache(q, inputs["k_cache"], inputs["v_cache"], inputs["cache_seqlens"],
                                    inputs["block_table"], HEAD_DIM ** -0.5)
        x = F.linear(o.reshape(batch, HEADS * HEAD_DIM), w["o"])
        h, residual = pointwise.rms_norm(x, w["norm2"], 1e-6, residual)
        x = F.linear(pointwise.silu_and_mul(F.linear(h, w["gate_up"])), w["down"])
    return x, residual


def capture(fn, stream: torch.cuda.Stream, carveout: int | None) -> torch.cuda.CUDAGraph:
    """fn captured on `stream`, cuBLAS told to leave `carveout` SMs free (None: all SMs)."""
    torch._C._set_sm_carveout_experimental(carveout)
    try:
        with torch.cuda.stream(stream):
            fn()                                  # compile, choose algorithms
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    finally:
        torch._C._set_sm_carveout_experimental(None)
    torch.cuda.synchronize()
    return graph


def elapsed_ms(work, rounds: int = 3) -> float:
    """Best of `rounds` wall times of work() (which may use any streams; it joins them back)."""
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def measure(decode: torch.cuda.CUDAGraph, prefill: torch.cuda.CUDAGraph, steps: int,
            decode_stream: torch.cuda.Stream, prefill_stream: torch.cuda.Stream) -> dict[str, float]:
    main = torch.cuda.current_stream()

    def on(stream, fn):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            fn()
        main.wait_stream(stream)

    def decode_steps():
        for _ in range(steps):
            decode.replay()

    def beside():
        decode_stream.wait_stream(main)
        prefill_stream.wait_stream(main)
        with torch.cuda.stream(prefill_stream):
            prefill.replay()
        with torch.cuda.stream(decode_stream):
            decode_steps()
        main.wait_stream(decode_stream)
        main.wait_stream(prefill_stream)

    d = elapsed_ms(lambda: on(decode_stream, decode_steps))
    p = elapsed_ms(lambda: on(prefill_stream, prefill.replay))
    serial = elapsed_ms(lambda: (on(decode_stream, decode_steps), on(prefill_stream, prefill.replay)))
    both = elapsed_ms(beside)
    return dict(decode=d, prefill=p, serial=serial, beside=both, gain=serial / both)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--context", type=int, default=600, help="mean decode context in tokens")
    parser.add_argument("--chunk", nargs="+", default=["8x1024", "16x1024"], help="prefill chunks, SEQSxLEN")
    parser.add_argument("--carveout", type=int, nargs="+", default=[0, 16, 32, 48, 66])
    parser.add_argument("--cublaslt", action="store_true", help="GEMMs through cuBLASLt (the carve-out reaches it)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    if args.cublaslt:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    torch.manual_seed(0)
    layers = make_layers(args.layers)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    # does cuBLAS take the carve-out at all? a large GEMM with half the SMs should take about twice as long
    a = torch.randn(16384, HIDDEN, device="cuda", dtype=torch.bfloat16)
    gemm = lambda: F.linear(a, layers[0]["gate_up"])
    stream = torch.cuda.Stream()
    full, half = (elapsed_ms(capture(gemm, stream, c).replay) for c in (None, num_sms // 2))
    print(f"check: a 16384 x {HIDDEN} x {layers[0]['gate_up'].shape[0]} GEMM {full:.2f} ms on {num_sms} SMs, "
          f"{half:.2f} ms told to leave {num_sms // 2} free", flush=True)
    del a

    rows = []
    for chunk in args.chunk:
        num_seqs, seq_len = (int(v) for v in chunk.split("x"))
        tokens = num_seqs * seq_len
        px = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.1
        pr = torch.randn_like(px)
        cu = torch.arange(0, tokens + 1, seq_len, device="cuda", dtype=torch.int32)
        for batch in args.batch:
            inputs = decode_inputs(batch, args.context)
            for priority in (0, -1):
                decode_stream = torch.cuda.Stream(priority=priority)
                prefill_stream = torch.cuda.Stream()
                decode = capture(lambda: decode_layers(layers, inputs), decode_stream, None)
                one_step = elapsed_ms(decode.replay)
                for carveout in args.carveout:
                    prefill = capture(lambda: run_layers(layers, px, pr, cu, seq_len), prefill_stream, carveout or None)
                    steps = max(1, round(elapsed_ms(prefill.replay) / one_step))
                    r = measure(decode, prefill, steps, decode_stream, prefill_stream)
                    rows.append((chunk, batch, steps, "high" if priority else "same", carveout, r))
                    print(f"{chunk} prefill, {steps} decode steps of {batch} rows, decode priority "
                          f"{rows[-1][3]}, carve-out {carveout}: decode {r['decode']:.2f}, prefill "
                          f"{r['prefill']:.2f}, serial {r['serial']:.2f}, beside {r['beside']:.2f} ms, "
                          f"gain {r['gain']:.3f}", flush=True)
                    del prefill
                del decode
            del inputs
            torch.cuda.empty_cache()
    print(f"\n{args.layers} layers of Qwen3-8B, bf16; ms; gain = serial / beside")
    print("| prefill chunk | decode rows x steps | decode priority | SMs carved out of the prefill's GEMMs | "
          "decode alone | prefill alone | serial | beside | gain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for chunk, batch, steps, priority, carveout, r in rows:
        print(f"| {chunk} | {batch} x {steps} | {priority} | {carveout} | {r['decode']:.2f} | {r['prefill']:.2f} | "
              f"{r['serial']:.2f} | {r['beside']:.2f} | **{r['gain']:.3f}** |")


if __name__ == "__main__":
    main()
