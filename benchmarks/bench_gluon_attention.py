"""Prefill attention warp-specialized in Gluon (Triton 3.6's `triton.experimental.gluon`), against the engine's
kernel (nanovllm.kernels.prefill_attention): a prototype, not yet used by the engine.

    PYTHONPATH=. python benchmarks/bench_gluon_attention.py                 # one Hopper GPU: TFLOP/s side by side
    PYTHONPATH=. python benchmarks/bench_gluon_attention.py --compile-only  # no GPU: compiles every config for sm_90

Written against Triton 3.6 (the GPU image's): Gluon's API moves between releases (3.9 has no gl.thread_barrier),
so on a CPU machine with a newer Triton, compile with 3.6's wheel beside it: `pip download --no-deps triton==3.6.0`,
unzip it into DIR, then PYTHONPATH=DIR:. (its ptxas may need `chmod +x`).

Causal attention of a prefill chunk, bf16, head_dim 128, Qwen3-8B's heads (32 q, 8 kv), K/V in the engine's
256-token pages (a page's unwritten rows may hold NaN: V's rows past a sequence are zeroed in shared memory before
P V), with or without a cached prefix. The kernel does on Hopper what FlashAttention-3 does and Triton's compiler
did not for our kernel: one loader warp streams K and V tiles by TMA into a ring of shared-memory stages
(mbarriers: ready per tile, released when both consumers are done with it); two consumer warpgroups each own 64
rows of a program's 128 and run S = Q K^T and O += P V as asynchronous wgmma, P from registers, S of the next key
tile issued before the softmax of this one so the tensor cores work while the softmax does; the two groups
interleave on the SM's schedulers, or (PINGPONG) take turns issuing their MMAs through two mbarriers, so that one
group's softmax runs while the other's MMAs do. A program's 128 rows are PACK q heads x 128 // PACK queries sharing
one kv head (PACK 1: a program a q head; PACK 4: K/V read once for the group, as the engine's kernel does).

Measured on one H100 (docs/benchmarks.md): with PACK 1 and K/V packed (thirty-third session) 1.04-1.07x the
engine's kernel on 8 x 2,000 tokens, 0.83x on 29 x 560; with PACK 4, the paged reads, cached prefixes and the
ping-pong (2026-12-07, thirty-fourth session, every config correct) 1.06x on 8 x 2,000, 1.01x on 16 x 1,024,
0.98x on 29 x 560, 1.10x on 1 x 12,000, 1.09-1.20x after cached prefixes. Not taken into the engine: ~0.4% of
the bf16 prefill-heavy row, for a second prefill kernel on an experimental API.
"""
import argparse
import math
import sys
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOG2E = 1.4426950408889634
HQ, HKV, D = 32, 8, 128
# (sequences, new tokens each, cached tokens each): prefill-heavy's chunk first, standard's, a long prompt, then
# chunks after cached prefixes (a prompt's later chunk; a shared prefix's hit)
CASES = [(8, 2000, 0), (16, 1024, 0), (29, 560, 0), (1, 12000, 0), (1, 4096, 8192), (16, 64, 2000)]
CONFIGS = [  # (PACK, BLOCK_N, STAGES, PINGPONG)
    (1, 128, 3, False), (1, 128, 3, True), (4, 128, 2, False), (4, 128, 3, False), (4, 128, 3, True),
    (4, 64, 3, False), (4, 64, 4, True),
]
CONSUMER_REGS, LOADER_REGS = 232, 24


@gluon.jit
def _kv_loader(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, bt_row_ptr, kv_col, n_tiles,
               PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    for i in range(n_tiles):
        s = i % STAGES
        page = gl.load(bt_row_ptr + (i * BLOCK_N) // PAGE)         # a tile lies inside one page (PAGE % BLOCK_N == 0)
        row = page * PAGE + (i * BLOCK_N) % PAGE
        mbarrier.wait(kv_empty.index(s), ((i // STAGES) & 1) ^ 1)     # a fresh barrier passes parity 1 at once
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(s), k_bufs.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(s), v_bufs.index(s))


@gluon.jit
def _softmax_rows(s, m_i, l_i, qpos, tile, first_query, qk_scale, BLOCK_N: gl.constexpr, col_layout: gl.constexpr):
    """Online softmax over one key tile (log2 domain). qpos: the last key each row sees; only tiles reaching past
    the first of them are masked."""
    if (tile + 1) * BLOCK_N - 1 > first_query:
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        s = gl.where(offs_n[None, :] <= qpos[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _zero_rows_past(v_tile, tile, seq_k, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Rows of a V tile past the sequence's last key set to zero in shared memory (both groups write the same)."""
    if (tile + 1) * BLOCK_N > seq_k:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        keys = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        values = v_tile.load(layout)
        v_tile.store(gl.where((keys < seq_k)[:, None], values, gl.zeros_like(values)))
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _take_turn(turns, point, GROUP_ROW: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong (FlashAttention-3): a group issues its MMAs only in its turn, so that its softmax runs while the
    other group's MMAs do. Turns alternate per issue point; group 0's first is given at the start."""
    if PINGPONG:
        mbarrier.wait(turns.index(GROUP_ROW // 64), point & 1)


@gluon.jit
def _pass_turn(turns, GROUP_ROW: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - GROUP_ROW // 64))


@gluon.jit
def _consumer(q_ptr, stride_qt, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turns, o_ptr, stride_ot,
              q_start, seq_q, seq_k, q_first, first_head, n_tiles, qk_scale, PACK: gl.constexpr,
              GROUP_ROW: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              PINGPONG: gl.constexpr):
    """64 of the program's rows (row r: query q_first + r // PACK, q head first_head + r % PACK); query j sees the
    keys up to j + seq_k - seq_q (a cached prefix's keys first)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    # the group's q rows through registers into its shared tile, once a program
    r = GROUP_ROW + gl.arange(0, 64, layout=gl.SliceLayout(1, q_layout))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    q_rows = (q_start + q_first + r // PACK).to(gl.int64)
    q_vals = gl.load(q_ptr + q_rows[:, None] * stride_qt + (first_head + r % PACK)[:, None] * HEAD_DIM + d[None, :],
                     mask=(q_first + r // PACK < seq_q)[:, None], other=0.0)
    q = q_smem.index(GROUP_ROW // 64)
    q.store(q_vals)
    fence_async_shared()
    gl.thread_barrier()

    diag = seq_k - seq_q
    qpos = q_first + diag + (GROUP_ROW + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))) // PACK
    first_query = q_first + diag + GROUP_ROW // PACK
    m_i = gl.full([64], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.full([64], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    o = gl.zeros((64, HEAD_DIM), dtype=gl.float32, layout=o_layout)
    s_zero = gl.zeros((64, BLOCK_N), dtype=gl.float32, layout=s_layout)
    mbarrier.wait(k_ready.index(0), 0)
    _take_turn(turns, 0, GROUP_ROW, PINGPONG)
    s = warpgroup_mma(q, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    _pass_turn(turns, GROUP_ROW, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    p, alpha, m_i, l_i = _softmax_rows(s, m_i, l_i, qpos, 0, first_query, qk_scale, BLOCK_N, col_layout)
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    for i in range(n_tiles - 1):
        st = i % STAGES
        nxt = (i + 1) % STAGES
        mbarrier.wait(k_ready.index(nxt), ((i + 1) // STAGES) & 1)
        _take_turn(turns, i + 1, GROUP_ROW, PINGPONG)
        s_tok = warpgroup_mma(q, k_bufs.index(nxt).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(st), (i // STAGES) & 1)
        _zero_rows_past(v_bufs.index(st), i, seq_k, BLOCK_N, HEAD_DIM)
        o_tok = warpgroup_mma(p_op, v_bufs.index(st), o, is_async=True)
        _pass_turn(turns, GROUP_ROW, PINGPONG)
        # S of the next tile done (P V of this one may still run: p_op stays alive until it has)
        s, p_op = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, p_op))
        p, alpha, m_i, l_i = _softmax_rows(s, m_i, l_i, qpos, i + 1, first_query, qk_scale, BLOCK_N, col_layout)
        o, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
        mbarrier.arrive(kv_empty.index(st))
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    last = n_tiles - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    _zero_rows_past(v_bufs.index(last % STAGES), last, seq_k, BLOCK_N, HEAD_DIM)
    _take_turn(turns, n_tiles, GROUP_ROW, PINGPONG)
    o = warpgroup_mma(p_op, v_bufs.index(last % STAGES), o, is_async=True)
    _pass_turn(turns, GROUP_ROW, PINGPONG)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
    mbarrier.arrive(kv_empty.index(last % STAGES))

    out = o / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    rows = GROUP_ROW + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_rows = (q_start + q_first + rows // PACK).to(gl.int64)
    ptrs = o_ptr + o_rows[:, None] * stride_ot + (first_head + rows % PACK)[:, None] * HEAD_DIM + cols[None, :]
    gl.store(ptrs, out.to(gl.bfloat16), mask=(q_first + rows // PACK < seq_q)[:, None])


@gluon.jit
def attention_kernel(q_ptr, k_desc, v_desc, o_ptr, cu_q_ptr, cu_k_ptr, bt_ptr, stride_qt, stride_ot, stride_btb,
                     qk_scale, PACK: gl.constexpr, KV_GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                     PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    """One program a (tile of 128 // PACK queries, PACK q heads, sequence), heaviest tiles first. K/V in the paged
    cache viewed [pages * PAGE, kv heads * HEAD_DIM] (k_desc, v_desc), a sequence's pages in its block table row."""
    QUERIES: gl.constexpr = 128 // PACK
    tile = gl.program_id(0)
    first_head = gl.program_id(1) * PACK
    seq = gl.program_id(2)
    q_start = gl.load(cu_q_ptr + seq)
    seq_q = gl.load(cu_q_ptr + seq + 1) - q_start
    seq_k = gl.load(cu_k_ptr + seq + 1) - gl.load(cu_k_ptr + seq)
    seq_tiles = gl.cdiv(seq_q, QUERIES)
    if tile >= seq_tiles:
        return
    q_first = (seq_tiles - 1 - tile) * QUERIES
    n_tiles = gl.cdiv(gl.minimum(seq_q, q_first + QUERIES) + seq_k - seq_q, BLOCK_N)
    kv_head = first_head // KV_GROUP

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, HEAD_DIM], q_layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=2)       # both consumer groups release a stage
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)
    fence_async_shared()
    mbarrier.arrive(turns.index(0))                     # group 0 issues first

    gl.warp_specialize([
        (_consumer, (q_ptr, stride_qt, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turns, o_ptr, stride_ot,
                     q_start, seq_q, seq_k, q_first, first_head, n_tiles, qk_scale, PACK, 0, HEAD_DIM, BLOCK_N,
                     STAGES, PINGPONG)),
        (_consumer, (q_ptr, stride_qt, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turns, o_ptr, stride_ot,
                     q_start, seq_q, seq_k, q_first, first_head, n_tiles, qk_scale, PACK, 64, HEAD_DIM, BLOCK_N,
                     STAGES, PINGPONG)),
        (_kv_loader, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty,
                      bt_ptr + seq.to(gl.int64) * stride_btb, kv_head * HEAD_DIM, n_tiles, PAGE, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


PAGE = 256          # the engine's default KV page


def kv_layout(block_n: int):
    return gl.NVMMASharedLayout.get_default_for([block_n, D], gl.bfloat16)


def compile_only() -> None:
    """Every config through Triton's compiler for sm_90 (no GPU needed): the kernel's syntax and resources."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    print("triton", triton.__version__)
    for pack, block_n, stages, pingpong in CONFIGS:
        layout = kv_layout(block_n)
        signature = {"q_ptr": "*bf16", "k_desc": f"tensordesc<bf16[{block_n}, {D}],{layout!r}>",
                     "v_desc": f"tensordesc<bf16[{block_n}, {D}],{layout!r}>", "o_ptr": "*bf16",
                     "cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "bt_ptr": "*i32", "stride_qt": "i32",
                     "stride_ot": "i32", "stride_btb": "i32", "qk_scale": "fp32"}
        constants = dict(PACK=pack, KV_GROUP=HQ // HKV, HEAD_DIM=D, PAGE=PAGE, BLOCK_N=block_n, STAGES=stages,
                         PINGPONG=pingpong, CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS)
        signature.update({name: "constexpr" for name in constants})
        kernel = triton.compile(GluonASTSource(attention_kernel, signature, constants),
                                target=GPUTarget("cuda", 90, 128), options=dict(num_warps=4))
        print(f"PACK {pack}, BLOCK_N {block_n}, {stages} stages, ping-pong {pingpong}: compiled, "
              f"{kernel.metadata.shared:,} B of shared memory")


def gluon_attention(q, k_cache, v_cache, cu_q, cu_k, block_table, max_seqlen_q, pack, block_n, stages, pingpong):
    """(launch, output): causal attention of q [T, HQ, D] over paged K/V [pages, PAGE, HKV, D] (bf16)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    assert PAGE % block_n == 0 and k_cache.shape[1] == PAGE
    layout = kv_layout(block_n)
    k2, v2 = k_cache.view(-1, HKV * D), v_cache.view(-1, HKV * D)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, D], layout)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [block_n, D], layout)
    out = torch.empty_like(q)
    grid = (triton.cdiv(max_seqlen_q, 128 // pack), HQ // pack, cu_q.numel() - 1)
    scale = LOG2E / math.sqrt(D)

    def launch():
        attention_kernel[grid](q, k_desc, v_desc, out, cu_q, cu_k, block_table, q.stride(0), out.stride(0),
                               block_table.stride(0), scale, PACK=pack, KV_GROUP=HQ // HKV, HEAD_DIM=D, PAGE=PAGE,
                               BLOCK_N=block_n, STAGES=stages, PINGPONG=pingpong, CONSUMER_REGS=CONSUMER_REGS,
                               LOADER_REGS=LOADER_REGS, num_warps=4)
    return launch, out


def main() -> None:
    import torch
    from triton.testing import do_bench_cudagraph

    from benchmarks.bench_kernels import BLOCK_SIZE, causal_pairs, paged_prefill_batch
    from nanovllm.kernels.prefill_attention import prefill_attention
    assert BLOCK_SIZE == PAGE
    torch.manual_seed(0)
    print(torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    table = []
    for num_seqs, new, cached in CASES:
        # K/V in the engine's pages, shuffled, the last page's unwritten rows NaN: what a prefill chunk reads
        q, k_cache, v_cache, cu_q, cu_k, block_table = paged_prefill_batch(num_seqs, new, cached, heads=HQ,
                                                                           kv_heads=HKV, nan_tails=True)
        flops = 4 * HQ * D * num_seqs * causal_pairs(new, cached)         # QK^T and P V over the causal keys

        def ours():
            return prefill_attention(q, k_cache, v_cache, cu_q, cu_k, causal=True, block_table=block_table,
                                     max_seqlen_q=new, max_seqlen_k=new + cached)
        reference = ours()
        assert not reference.isnan().any(), "the engine's kernel read a NaN row"
        t_ours = do_bench_cudagraph(ours)
        print(f"{num_seqs} x {new} new after {cached} cached: the engine's kernel {t_ours * 1e3:.1f} us, "
              f"{flops / t_ours / 1e9:.0f} TFLOP/s", flush=True)
        best = (math.inf, None)
        for config in CONFIGS:
            name = "PACK {}, BLOCK_N {}, {} stages, ping-pong {}".format(*config)
            try:
                launch, out = gluon_attention(q, k_cache, v_cache, cu_q, cu_k, block_table, new, *config)
                launch()
                torch.cuda.synchronize()
                diff = (out.float() - reference.float()).abs().max().item()
                if not diff < 3e-2:         # NaN fails too
                    print(f"  {name}: WRONG, max difference {diff:.3g}")
                    continue
                t = do_bench_cudagraph(launch)
                print(f"  {name}: {t * 1e3:.1f} us, {flops / t / 1e9:.0f} TFLOP/s (max difference {diff:.3g})",
                      flush=True)
                best = min(best, (t, config), key=lambda pair: pair[0])
            except Exception as error:     # noqa: BLE001 - a sweep: report the config and go on
                print(f"  {name}: FAILED {type(error).__name__}: {str(error)[:300]}", flush=True)
        table.append((f"{num_seqs} x {new}" + (f" after {cached}" if cached else ""), flops, t_ours, best))
    print("\n| batch | engine TFLOP/s | Gluon TFLOP/s (best) | Gluon / engine | config: PACK, BLOCK_N, stages, "
          "ping-pong |")
    print("| --- | --- | --- | --- | --- |")
    for name, flops, t_ours, (t, config) in table:
        gluon_tflops = flops / t / 1e9 if t < math.inf else float("nan")
        print(f"| {name} | {flops / t_ours / 1e9:.0f} | {gluon_tflops:.0f} | {t_ours / t:.3f} | {config} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile-only", action="store_true", help="compile every config for sm_90; no GPU")
    if parser.parse_args().compile_only:
        compile_only()
    else:
        main()
