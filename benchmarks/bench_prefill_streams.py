"""Prefill benchmark: a chunk's layers as one batch on one CUDA stream, against its sequences split into two
halves run side by side on two streams (each half's memory-bound passes, norms, SiLU-and-mul and its attention,
free to run beside the other half's GEMMs), at Qwen3-8B's layer shapes in bf16 with random weights, through
the engine's own kernels (RMSNorm with the residual, the prefill attention kernel, SiLU-and-mul) and cuBLAS.

    PYTHONPATH=. python benchmarks/bench_prefill_streams.py [--layers 12]

A prefill chunk of the bf16 prefill-heavy workload is ~84% cuBLAS GEMMs near their peak, ~7% attention and
~9% memory-bound passes (docs/benchmarks.md, issue #38): if the GPU runs one half's passes while the other
half's GEMMs hold the tensor cores, the chunk is shorter than its kernels' sum; if the GEMMs take every SM
(one CTA an SM, all its registers) the two halves only take turns. The halves are independent (different
sequences), so the engine could launch them so without changing any result. Times in ms per chunk, two runs.

Measured (one H100, 2026-12-07, docs/benchmarks.md's thirty-fifth session): the GEMMs leave no room. Two streams
ran no faster than the halves one after the other (8 x 2000: 125-127 ms either way against 120.5-121.4 for the
whole chunk; 16 x 1024 and 29 x 560 within 1% of the whole chunk in every variant), so the engine keeps one.
"""
import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_moe import time_us   # CUDA events around rounds of the calls
from nanovllm.kernels import pointwise
from nanovllm.kernels.prefill_attention import prefill_attention

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 12288, 32, 8, 128      # Qwen3-8B
BATCHES = ((8, 2000), (16, 1024), (29, 560))    # prefill-heavy's chunk, longer and shorter prompts


def make_layers(num_layers: int, device: str = "cuda", dtype=torch.bfloat16) -> list[dict]:
    def weight(n, k):
        return torch.randn(n, k, device=device, dtype=dtype) * 0.02
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    ones = torch.ones(HIDDEN, device=device, dtype=dtype)
    return [dict(norm1=ones, norm2=ones,
                 qkv=weight(qkv, HIDDEN), o=weight(HIDDEN, HEADS * HEAD_DIM), gate_up=weight(2 * INTERMEDIATE, HIDDEN),
                 down=weight(HIDDEN, INTERMEDIATE)) for _ in range(num_layers)]


def run_layers(layers: list[dict], x, residual, cu_seqlens, seq_len: int):
    """The decoder layers' prefill pass (no KV cache: K/V packed as the batch's fresh keys)."""
    for w in layers:
        h, residual = pointwise.rms_norm(x, w["norm1"], 1e-6, residual)
        q, k, v = F.linear(h, w["qkv"]).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        o = prefill_attention(q.reshape(-1, HEADS, HEAD_DIM), k.reshape(-1, KV_HEADS, HEAD_DIM).contiguous(),
                              v.reshape(-1, KV_HEADS, HEAD_DIM).contiguous(), cu_seqlens, cu_seqlens, causal=True,
                              max_seqlen_q=seq_len, max_seqlen_k=seq_len)
        x = F.linear(o.reshape(-1, HEADS * HEAD_DIM), w["o"])
        h, residual = pointwise.rms_norm(x, w["norm2"], 1e-6, residual)
        x = F.linear(pointwise.silu_and_mul(F.linear(h, w["gate_up"])), w["down"])
    return x, residual


def measure(layers: list[dict], num_seqs: int, seq_len: int) -> dict[str, list[float]]:
    tokens, half = num_seqs * seq_len, (num_seqs // 2) * seq_len
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)

    def cu(n):
        return torch.arange(0, n + 1, seq_len, device="cuda", dtype=torch.int32)
    halves = [(x[:half], residual[:half], cu(half)), (x[half:], residual[half:], cu(tokens - half))]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def on_two_streams(by_layer: bool):
        main = torch.cuda.current_stream()
        for stream in streams:
            stream.wait_stream(main)
        states = [(hx, hr) for hx, hr, _ in halves]
        for chunk in ([[w] for w in layers] if by_layer else [layers]):
            for i, (stream, (_, _, cu_half)) in enumerate(zip(streams, halves)):
                with torch.cuda.stream(stream):
                    states[i] = run_layers(chunk, *states[i], cu_half, seq_len)
        for stream in streams:
            main.wait_stream(stream)

    variants = {"one stream, the whole chunk": lambda: run_layers(layers, x, residual, cu(tokens), seq_len),
                "halves one after the other": lambda: [run_layers(layers, *h, seq_len) for h in halves],
                "halves on two streams": lambda: on_two_streams(False),
                "halves on two streams, launched layer by layer": lambda: on_two_streams(True)}
    return {name: [time_us([fn], graph=False, iters=5) / 1e3 for _ in range(2)] for name, fn in variants.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    torch.manual_seed(0)
    layers = make_layers(args.layers)
    for num_seqs, seq_len in BATCHES:
        print(f"{num_seqs} x {seq_len}, {args.layers} layers:", flush=True)
        for name, times in measure(layers, num_seqs, seq_len).items():
            print(f"  {name}: {times[0]:.2f} / {times[1]:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
