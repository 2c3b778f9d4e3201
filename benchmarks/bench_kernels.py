"""Kernel benchmark: Triton decode and prefill attention on one CUDA GPU.

Decode: achieved KV-read bandwidth (bytes of K and V read / time) at batch 256 x context 1024 and
batch 8 x context 8192, with a bf16 and with an fp8 cache (fp8 bytes counted), against this device's
device-to-device copy bandwidth (bytes read + written), measured in the same run. Prefill: TFLOP/s on a 16k-token causal varlen batch against
torch's bundled flash attention (torch.nn.attention.varlen.varlen_attn), and through a paged cache in
bf16 and fp8. Attention shape of
Qwen3-0.6B: 16 q heads, 8 kv heads, head_dim 128, bf16, block_size 256.

    PYTHONPATH=. python benchmarks/bench_kernels.py [--sweep]

Sampling: one decode step's draw at batch 256 x vocab 151936 (bf16 logits, temperature 0.6): the
Triton kernel against the same Gumbel-max in torch, eager and under torch.compile.

--sweep also times a few tile configurations and split counts (printed before the table); --only
decode-bf16|decode-fp8|prefill runs that part alone.

--goals times issue #27's prefill shapes instead: paged 16 x 1,024 new tokens continuing 1,024 cached ones
and 8 x 2,000 fresh, packed 1 x 12,000; the packed one also through torch's SDPA with the cuDNN and the
flash backends (causal FLOPs counted once: 4 * D * heads * (query, key) pairs).
"""
import argparse
import inspect
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.kernels import flash_attn_varlen_func, flash_attn_with_kvcache
from nanovllm.kernels.decode_attention import decode_attention, choose_num_splits, _default_config, _sm_count
from nanovllm.kernels.prefill_attention import prefill_attention
from nanovllm.kernels.sampling import sample as triton_sample
from bench import measure_bandwidth    # the copy bandwidth bench.py's floor uses

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 16, 8, 128, 256, torch.bfloat16


def ms(fn, graph=False):
    """Median milliseconds of fn (CUDA events; optionally replaying a CUDA graph)."""
    if graph:
        return do_bench_cudagraph(fn, rep=200, return_mode="median")
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def decode_shapes(sweep: bool):
    """(name, context lengths, block-table width in pages, pages scattered at random): the goal shapes,
    and with --sweep two more drawn like bench.py's workloads (max_model_len 16,384: 64 pages a row; pages
    handed out in order, as a fresh engine does). Every shape runs as the engine runs a decode step: the
    kernel takes the sequences longest first (its `order`)."""
    shapes = [("batch 256 x ctx 1024", [1024] * 256, 4, True), ("batch 8 x ctx 8192", [8192] * 8, 32, True)]
    if sweep:
        g = torch.Generator().manual_seed(0)
        standard = torch.randint(100, 2049, (256,), generator=g).tolist()
        shapes += [("standard-like 256 x U[100, 2048]", standard, 64, False),
                   ("long-context-like 16 x 12,256", [12256] * 16, 64, False)]
    return shapes


def decode_inputs(lens, width, scatter, cache_dtype=DTYPE):
    """A paged cache holding each sequence's pages, in order or scattered at random."""
    batch = len(lens)
    pages = [triton.cdiv(n, BLOCK_SIZE) for n in lens]
    num_blocks = sum(pages)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE).to(cache_dtype)
    v_cache = torch.randn(k_cache.shape, device="cuda", dtype=DTYPE).to(cache_dtype)
    order = torch.randperm(num_blocks) if scatter else torch.arange(num_blocks)
    table = torch.zeros(batch, width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[start:start + n]
        start += n
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, seqlens, table.cuda()


def bench_decode(lens, width, scatter, sweep, cache_dtype=DTYPE):
    q, k, v, seqlens, table = decode_inputs(lens, width, scatter, cache_dtype)
    order = torch.argsort(seqlens, descending=True, stable=True).to(torch.int32)    # the engine's decode_order
    batch, ctx = len(lens), max(lens)
    kv_bytes = 2 * sum(lens) * KV_HEADS * HEAD_DIM * k.element_size()
    default = _default_config(HEAD_DIM, BLOCK_SIZE, q.device, cache_dtype, batch * KV_HEADS)
    splits = choose_num_splits(batch, KV_HEADS, table.shape[1] * BLOCK_SIZE, _sm_count(q.device),
                               programs_per_sm=default["programs_per_sm"], unsplit_per_sm=default.get("unsplit_per_sm"))
    if sweep:
        # decode_attention's keyword arguments; {}: the defaults (order=None: the sequences as they come)
        tiles = [dict(block_n=128, num_warps=4, num_stages=2), dict(block_n=128, num_warps=4, num_stages=3),
                 dict(block_n=64, num_warps=4, num_stages=2), dict(block_n=64, num_warps=4, num_stages=3),
                 dict(block_n=64, num_warps=2, num_stages=4), dict(block_n=64, num_warps=1, num_stages=3),
                 dict(block_n=32, num_warps=1, num_stages=3)]
        configs = [{}, dict(order=None), dict(use_tma=True)] + [dict(tile, programs_per_sm=per_sm) for tile in tiles for per_sm in (4, 8, 16)]
        configs += [dict(num_splits=s) for s in (1, 2, 4, 5, 8, 9, 16, 17, 32) if s * 128 <= ctx and (s <= 2 or batch < 64)]
        expected = decode_attention(q, k, v, seqlens, table, order=order).float()
        for config in configs:
            fn = lambda: decode_attention(q, k, v, seqlens, table, **{"order": order, **config})
            used = config.get("num_splits") or choose_num_splits(
                batch, KV_HEADS, table.shape[1] * BLOCK_SIZE, _sm_count(q.device),
                programs_per_sm=config.get("programs_per_sm", default["programs_per_sm"]),
                unsplit_per_sm=default.get("unsplit_per_sm"))
            try:
                diff = (fn().float() - expected).abs().max().item()
                t = ms(fn, graph=True)
                print(f"  sweep decode {str(cache_dtype)[6:]} B={batch} ctx<={ctx} splits={used} {config or 'default'}: "
                      f"{t * 1e3:8.1f} us  {kv_bytes / (t * 1e-3) / 1e9:7.0f} GB/s  max|diff| {diff:.1e}", flush=True)
            except Exception as e:                       # noqa: BLE001 - report and go on
                print(f"  sweep decode {config} failed: {type(e).__name__}: {str(e)[:120]}")
    fn = lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table, order=order)
    t_graph = ms(fn, graph=True)
    t_eager = ms(fn)
    del k, v
    return kv_bytes, splits, t_graph, t_eager


def varlen_torch_fn(q, k, v, cu, max_len):
    """torch's bundled flash attention on the same varlen inputs; returns (fn, description)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    if varlen_attn is not None:
        params = inspect.signature(varlen_attn).parameters
        print(f"  torch.nn.attention.varlen.varlen_attn{inspect.signature(varlen_attn)}")
        kwargs = {}
        if "is_causal" in params:
            kwargs["is_causal"] = True
        elif "window_size" in params:
            kwargs["window_size"] = (-1, 0)               # causal as a sliding window of (left=all, right=0)
        else:
            varlen_attn = None
        if varlen_attn is not None:
            if "enable_gqa" in params:
                kwargs["enable_gqa"] = True
            for kk, vv, note in [(k, v, "GQA kv heads"), (None, None, "kv heads repeated to 16")]:
                if kk is None:
                    kk = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
                    vv = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
                try:
                    fn = lambda kk=kk, vv=vv: varlen_attn(q, kk, vv, cu, cu, max_len, max_len, **kwargs)
                    fn()
                    torch.cuda.synchronize()
                    return fn, f"varlen_attn ({note}, {kwargs})"
                except Exception as e:                   # noqa: BLE001
                    print(f"  varlen_attn with {note} failed: {type(e).__name__}: {str(e)[:160]}")
    print("  FALLBACK: varlen_attn missing or failing; using F.scaled_dot_product_attention per sequence")
    kr = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    vr = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    bounds = cu.tolist()

    def sdpa():
        out = torch.empty_like(q)
        for s, e in zip(bounds[:-1], bounds[1:]):
            out[s:e] = torch.nn.functional.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), kr[s:e].transpose(0, 1), vr[s:e].transpose(0, 1), is_causal=True
            ).transpose(0, 1)
        return out
    return sdpa, "F.scaled_dot_product_attention per sequence"


def bench_prefill(sweep):
    num_seqs, seq_len = 16, 1024
    total = num_seqs * seq_len
    q = torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    cu = torch.arange(0, total + 1, seq_len, device="cuda", dtype=torch.int32)
    pairs = num_seqs * seq_len * (seq_len + 1) // 2           # causal (query, key) pairs
    flops = 4 * HEAD_DIM * HEADS * pairs
    tflops = lambda t: flops / (t * 1e-3) / 1e12

    ours = lambda: flash_attn_varlen_func(q, k, v, cu, cu, seq_len, seq_len, causal=True)
    torch_fn, torch_desc = varlen_torch_fn(q, k, v, cu, seq_len)
    diff = (ours().float() - torch_fn().float()).abs().max().item()
    print(f"  max |ours - torch| = {diff:.3e}")
    if sweep:
        for bm, bn, w, st in [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2),
                              (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3)]:
            try:
                t = ms(lambda: prefill_attention(q, k, v, cu, cu, causal=True, block_m=bm, block_n=bn,
                                                 num_warps=w, num_stages=st))
                print(f"  sweep prefill block_m={bm} block_n={bn} warps={w} stages={st}: "
                      f"{t * 1e3:8.1f} us  {tflops(t):6.1f} TFLOP/s", flush=True)
            except Exception as e:                       # noqa: BLE001
                print(f"  sweep prefill {bm, bn, w, st} failed: {type(e).__name__}: {str(e)[:120]}")
    t_ours = ms(ours)
    t_torch = ms(torch_fn)

    # the same prompts read through a paged cache (block_size 256), prefix-free
    pages = total // BLOCK_SIZE
    k_cache = k.view(pages, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    v_cache = v.view(pages, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    table = torch.arange(pages, device="cuda", dtype=torch.int32).view(num_seqs, -1)
    paged = lambda: flash_attn_varlen_func(q, k_cache, v_cache, cu, cu, seq_len, seq_len, causal=True,
                                           block_table=table)
    print(f"  max |paged - packed| = {(paged().float() - ours().float()).abs().max().item():.3e}")
    t_paged = ms(paged)
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    paged_fp8 = lambda: flash_attn_varlen_func(q, k8, v8, cu, cu, seq_len, seq_len, causal=True, block_table=table)
    print(f"  max |paged fp8 - packed| = {(paged_fp8().float() - ours().float()).abs().max().item():.3e}")
    t_paged_fp8 = ms(paged_fp8)
    if sweep:
        for tma in (False, True):
            for tk, tv in ((k_cache, v_cache), (k8, v8)):
                t = ms(lambda: prefill_attention(q, tk, tv, cu, cu, causal=True, block_table=table, use_tma=tma))
                print(f"  sweep prefill paged {str(tk.dtype)[6:]} use_tma={tma}: {t * 1e3:8.1f} us  "
                      f"{tflops(t):6.1f} TFLOP/s", flush=True)
    return tflops(t_ours), tflops(t_paged), tflops(t_paged_fp8), tflops(t_torch), torch_desc, t_ours, t_torch


def causal_pairs(num_new: int, num_cached: int) -> int:
    """(query, key) pairs of one sequence's num_new queries after num_cached keys, causal."""
    return num_new * num_cached + num_new * (num_new + 1) // 2


def paged_prefill_batch(num_seqs: int, num_new: int, num_cached: int, heads: int = HEADS, kv_heads: int = KV_HEADS,
                        nan_tails: bool = False, device: str = "cuda"):
    """(q, k_cache, v_cache, cu_q, cu_k, block_table) of a prefill chunk: num_new tokens a sequence after
    num_cached ones, K/V in BLOCK_SIZE-token pages in shuffled order (a table that is not the identity);
    nan_tails: the rows a sequence's last page leaves unwritten hold NaN, as unwritten memory may."""
    seq_k = num_cached + num_new
    pages_per_seq = triton.cdiv(seq_k, BLOCK_SIZE)
    q = torch.randn(num_seqs * num_new, heads, HEAD_DIM, device=device, dtype=DTYPE)
    k_cache = torch.randn(num_seqs * pages_per_seq, BLOCK_SIZE, kv_heads, HEAD_DIM, device=device, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_seqs * pages_per_seq, device=device).to(torch.int32).view(num_seqs, -1)
    if nan_tails:
        last_pages = table[:, -1].long()
        k_cache[last_pages, seq_k - (pages_per_seq - 1) * BLOCK_SIZE:] = float("nan")
        v_cache[last_pages, seq_k - (pages_per_seq - 1) * BLOCK_SIZE:] = float("nan")
    cu_q = torch.arange(0, num_seqs * num_new + 1, num_new, device=device, dtype=torch.int32)
    cu_k = torch.arange(0, num_seqs * seq_k + 1, seq_k, device=device, dtype=torch.int32)
    return q, k_cache, v_cache, cu_q, cu_k, table


def paged_prefill(num_seqs: int, num_new: int, num_cached: int, **tiles):
    """(fn, pairs): our paged prefill of num_new tokens per sequence over num_cached cached ones
    (tiles: prefill_attention's block_m, block_n, num_warps, num_stages, use_tma)."""
    q, k_cache, v_cache, cu_q, cu_k, table = paged_prefill_batch(num_seqs, num_new, num_cached)
    fn = lambda: prefill_attention(q, k_cache, v_cache, cu_q, cu_k, causal=True, block_table=table,
                                   max_seqlen_q=num_new, max_seqlen_k=num_cached + num_new, **tiles)
    return fn, num_seqs * causal_pairs(num_new, num_cached)


# (block_m, block_n, num_warps, num_stages, use_tma) tried by --goals --sweep
PREFILL_SWEEP = [(128, 128, 8, 3, False), (128, 128, 8, 3, True), (128, 64, 8, 2, True), (128, 64, 8, 3, True),
                 (64, 64, 4, 2, True), (64, 64, 4, 3, True), (64, 32, 4, 3, True), (64, 32, 4, 4, True),
                 (128, 32, 8, 4, True)]


def sdpa_fn(q, k, v, backend):
    """torch's SDPA on one packed sequence ([T, H, D] -> [1, H, T, D]), GQA, through one backend."""
    from torch.nn.attention import sdpa_kernel
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))

    def fn():
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    return fn


def bench_prefill_goals(sweep: bool = False) -> list[tuple[str, float]]:
    """(what, TFLOP/s) for issue #27's prefill shapes (sweep: also PREFILL_SWEEP's tiles, printed)."""
    from torch.nn.attention import SDPBackend
    rows = []
    total = 12000
    q = torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    cu = torch.tensor([0, total], device="cuda", dtype=torch.int32)
    flops = 4 * HEAD_DIM * HEADS * causal_pairs(total, 0)

    def packed(**tiles):
        return lambda: prefill_attention(q, k, v, cu, cu, causal=True, max_seqlen_q=total, max_seqlen_k=total, **tiles)

    shapes = [("paged 16 x 1,024 after 1,024 cached", lambda **t: paged_prefill(16, 1024, 1024, **t)),
              ("paged 8 x 2,000", lambda **t: paged_prefill(8, 2000, 0, **t)),
              ("packed 1 x 12,000", lambda **t: (packed(**t), causal_pairs(total, 0)))]
    for what, make in shapes:
        for tiles in [{}, {"use_tma": False}] + ([dict(zip(("block_m", "block_n", "num_warps", "num_stages",
                                                                "use_tma"), c)) for c in PREFILL_SWEEP] if sweep else []):
            try:
                fn, pairs = make(**tiles)
                tflops = 4 * HEAD_DIM * HEADS * pairs / (ms(fn) * 1e-3) / 1e12
            except Exception as e:                      # noqa: BLE001 - report and go on
                print(f"  {what} {tiles} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            if tiles and (sweep or "use_tma" not in tiles):
                print(f"  sweep prefill {what} {tiles}: {tflops:.1f} TFLOP/s", flush=True)
            if len(tiles) <= 1:
                rows.append((f"Triton, {what}{' (pointer loads)' if tiles else ''}", tflops))
    ours = packed()
    for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash (torch's FA2)", SDPBackend.FLASH_ATTENTION)):
        try:
            fn = sdpa_fn(q, k, v, backend)
            diff = (fn()[0].transpose(0, 1).float() - ours().float()).abs().max().item()
            rows.append((f"SDPA {name}, packed 1 x 12,000 (max |diff| vs ours {diff:.1e})",
                         flops / (ms(fn) * 1e-3) / 1e12))
        except Exception as e:                          # noqa: BLE001 - report and go on
            rows.append((f"SDPA {name}: {type(e).__name__}: {str(e)[:100]}", float("nan")))
    return rows


def torch_sample(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """The same Gumbel-max draw in torch ops, one batch at a time."""
    u = torch.rand(logits.shape, device=logits.device).clamp_min(1e-20)
    return (logits.float() / temperatures.unsqueeze(1) - torch.log(-torch.log(u))).argmax(dim=-1)


def bench_sampling() -> list[tuple[str, float]]:
    rows, vocab = 256, 151936
    logits = torch.randn(rows, vocab, device="cuda", dtype=DTYPE)
    temperatures = torch.full((rows,), 0.6, device="cuda")
    compiled = torch.compile(torch_sample, dynamic=True)
    return [(name, ms(lambda fn=fn: fn(logits, temperatures))) for name, fn in
            [("Triton kernel", triton_sample), ("torch, compiled", compiled), ("torch, eager", torch_sample)]]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--goals", action="store_true", help="issue #27's prefill shapes, with cuDNN's SDPA")
    parser.add_argument("--only", choices=["decode-bf16", "decode-fp8", "prefill"],
                        help="only this part of the table (and of --sweep)")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}")
    torch.manual_seed(0)
    if args.goals:
        print("| prefill, 16q/8kv heads, D=128, bf16, causal | TFLOP/s |")
        print("|---|---|")
        for what, tflops in bench_prefill_goals(args.sweep):
            print(f"| {what} | {tflops:.1f} |")
        return
    copy_bw = measure_bandwidth(torch.device("cuda"))
    cache_dtypes = {"decode-bf16": [DTYPE], "decode-fp8": [torch.float8_e4m3fn], "prefill": [],
                    None: [DTYPE, torch.float8_e4m3fn]}
    decode = [(dt, name, *bench_decode(lens, width, scatter, args.sweep, dt)) for dt in cache_dtypes[args.only]
              for name, lens, width, scatter in decode_shapes(args.sweep)]
    prefill = bench_prefill(args.sweep) if args.only in (None, "prefill") else None
    sampling = bench_sampling() if args.only is None else []

    print()
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (bytes read + written)")
    print("| decode (16q/8kv heads, D=128, bf16 q, block 256) | cache | splits | KV bytes | time (graph) | GB/s | "
          "% of copy | time (eager) |")
    print("|---|---|---|---|---|---|---|---|")
    for dt, name, nbytes, splits, tg, te in decode:
        bw = nbytes / (tg * 1e-3)
        print(f"| {name} | {str(dt).removeprefix('torch.')} | {splits} | {nbytes / 1e6:.0f} MB | {tg * 1e3:.1f} us | {bw / 1e9:.0f} | "
              f"{100 * bw / copy_bw:.0f}% | {te * 1e3:.1f} us |")
    if prefill is None:
        return
    ours, paged, paged_fp8, ref, desc, t_ours, t_ref = prefill
    print()
    print("| prefill 16 x 1024 causal, 16q/8kv heads, D=128, bf16 | time | TFLOP/s | % of torch |")
    print("|---|---|---|---|")
    print(f"| Triton, packed K/V | {t_ours * 1e3:.0f} us | {ours:.1f} | {100 * ours / ref:.0f}% |")
    print(f"| Triton, paged K/V (block 256) | | {paged:.1f} | {100 * paged / ref:.0f}% |")
    print(f"| Triton, paged fp8 K/V (block 256) | | {paged_fp8:.1f} | {100 * paged_fp8 / ref:.0f}% |")
    print(f"| torch: {desc} | {t_ref * 1e3:.0f} us | {ref:.1f} | 100% |")
    if not sampling:
        return
    print()
    print("| sampling 256 x 151936 bf16 logits, T=0.6 | time | GB/s of logits read |")
    print("|---|---|---|")
    for name, t in sampling:
        print(f"| {name} | {t * 1e3:.0f} us | {256 * 151936 * 2 / (t * 1e-3) / 1e9:.0f} |")


if __name__ == "__main__":
    main()
