"""Triton `flash_attn_varlen_func`: flash attention over a varlen batch (packed or paged K/V).

The grid is (query tiles of the longest sequence, kv heads, sequences): no constant depends on the
batch, so one compiled kernel serves every batch. Each program loads one [BLOCK_M, D] tile of query
rows and runs an online softmax over the keys in [BLOCK_N, D] tiles with fp32 statistics and
accumulator. With grouped-query attention a tile's rows are BLOCK_M // GROUP queries times the GROUP q
heads that share one kv head (row r: query r // GROUP, head r % GROUP), so each K/V tile is loaded once
for the whole group (H100, 16 x 1024 and 1 x 12,000 tokens: 3-7% faster than a program per q head).
Tiles that no mask touches run in a loop without masks; the tiles on the causal diagonal (bottom-right
aligned) and the ragged last tile run in a second, masked loop. With a block table, each key tile's
rows are found through the sequence's row of it, and an fp8 cache's tiles are widened to q's dtype (to
float16 for bf16 queries: kv_tile.wants_fp16_dots). On Hopper, 16-bit K/V tiles are copied by TMA
(kv_tile.kv_descriptors); tile sizes follow the batch's key range (mean_keys, SHORT_KEYS). Pages smaller
than a tile leave paged reads to pointers: given this step's K/V packed beside the pages (k_new, v_new), a
sequence with nothing cached then reads those instead, through TMA.
"""
import math

import torch
import triton
import triton.language as tl

from .kv_tile import dot_operand, kv_descriptors, kv_head_source, load_kv_tile, tile_page, wants_fp16_dots
from .launch import launch, shared_memory

_LOG2E = 1.4426950408889634


@triton.jit
def _attn_tiles(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, bt_row_ptr, k_start, seq_k,
                offs_m, offs_d, diag, lo, hi, qk_scale, kv_head,
                stride_kb, stride_kt, stride_vb, stride_vt,
                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                PAGED: tl.constexpr, PAGE: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    """Online-softmax update over key tiles [lo, hi) (lo a multiple of BLOCK_N). A tile's rows at or past hi
    read page 0 (tile_page): causal, no query of this tile sees them; else hi is seq_k, where they are masked."""
    next_page = tile_page(bt_row_ptr, lo, hi, PAGED, PAGE, BLOCK_N)
    for n_start in range(lo, hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        page = next_page           # loaded a tile ahead (H100: 4-8% faster than loading it here)
        next_page = tile_page(bt_row_ptr, n_start + BLOCK_N, hi, PAGED, PAGE, BLOCK_N)
        k, v = load_kv_tile(k_head_ptr, v_head_ptr, page, k_start, n_start, seq_k, offs_d,
                            stride_kb, stride_kt, stride_vb, stride_vt,
                            PAGED, PAGE, BLOCK_N, HEAD_DIM, D_PAD, MASKED, TMA, kv_head)
        k, v = k.to(q.dtype), v.to(q.dtype)     # an fp8 cache is dequantized here, in registers

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)      # unscaled: the scale rides in the exp's FMA
        if MASKED:
            ok = offs_n[None, :] < seq_k
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None] + diag)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)           # log2 domain
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_keys(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, bt_row_ptr, k_start, seq_k,
                 offs_m, offs_d, diag, full_end, hi, qk_scale, kv_head,
                 stride_kb, stride_kt, stride_vb, stride_vt,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGED: tl.constexpr, PAGE: tl.constexpr, CAUSAL: tl.constexpr,
                 DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    """A query tile's keys from one source: [0, full_end) without masks, then [full_end, hi) masked."""
    acc, m_i, l_i = _attn_tiles(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, bt_row_ptr, k_start, seq_k,
                                offs_m, offs_d, diag, 0, full_end, qk_scale, kv_head,
                                stride_kb, stride_kt, stride_vb, stride_vt,
                                HEAD_DIM, D_PAD, BLOCK_N, PAGED, PAGE, CAUSAL, False, DOT_PREC, TMA)
    return _attn_tiles(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, bt_row_ptr, k_start, seq_k,
                       offs_m, offs_d, diag, full_end, hi, qk_scale, kv_head,
                       stride_kb, stride_kt, stride_vb, stride_vt,
                       HEAD_DIM, D_PAD, BLOCK_N, PAGED, PAGE, CAUSAL, True, DOT_PREC, TMA)


# a step's block table is as wide as its longest sequence, and Triton would compile a variant of its own for
# a row stride of 1 and for each multiple of 16 inside requests: the likely cause of 16-token pages' slow
# prefill (H100, bench.py's standard workload, Qwen3-0.6B shape: 1.58 s against 0.30 with 256-token pages)
@triton.jit(do_not_specialize=["stride_btb"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, bt_ptr, kn_ptr, vn_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_btb, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, DOT_PREC: tl.constexpr,
    FP16_DOTS: tl.constexpr, TMA: tl.constexpr, NEW_KV: tl.constexpr, NEW_TMA: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    QUERIES: tl.constexpr = BLOCK_M // GROUP           # queries per tile; rows past QUERIES * GROUP idle

    q_start = tl.load(cu_q_ptr + seq)
    seq_q = tl.load(cu_q_ptr + seq + 1) - q_start
    seq_tiles = (seq_q + QUERIES - 1) // QUERIES
    if tile >= seq_tiles:
        return                                         # this sequence is shorter than the longest
    m_block = seq_tiles - 1 - tile                     # heaviest (last, for causal) tiles first
    k_start = tl.load(cu_k_ptr + seq)
    seq_k = tl.load(cu_k_ptr + seq + 1) - k_start
    diag = seq_k - seq_q                               # query j sees keys <= j + diag

    rows = tl.arange(0, BLOCK_M)
    offs_m = m_block * QUERIES + rows // GROUP         # each row's query position
    heads = kv_head * GROUP + rows % GROUP             # and its q head
    offs_d = tl.arange(0, D_PAD)
    m_ok = (offs_m < seq_q) & (rows < QUERIES * GROUP)
    q_rows = (q_start + offs_m).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    if D_PAD == HEAD_DIM:
        q = tl.load(q_ptrs, mask=m_ok[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=m_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    q = dot_operand(q, FP16_DOTS)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_btb

    # key range: [0, full_end) needs no mask; [full_end, hi) is masked
    if CAUSAL:
        m_first = m_block * QUERIES
        hi = tl.minimum(seq_k, m_first + QUERIES + diag)
        hi = tl.maximum(hi, 0)
        full_end = tl.maximum(m_first + diag + 1, 0)
        full_end = tl.minimum(full_end, hi)
    else:
        hi = seq_k
        full_end = seq_k
    full_end = (full_end // BLOCK_N) * BLOCK_N

    fresh = False                                      # nothing of this sequence cached: its keys are this
    if NEW_KV:                                         # step's, packed at q's rows in k_new/v_new
        fresh = diag == 0
    if fresh:
        kn_head_ptr, vn_head_ptr = kv_head_source(kn_ptr, vn_ptr, kv_head, stride_knh, stride_vnh, NEW_TMA)
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, kn_head_ptr, vn_head_ptr, bt_row_ptr, q_start, seq_k,
                                     offs_m, offs_d, diag, full_end, hi, qk_scale, kv_head,
                                     0, stride_knt, 0, stride_vnt,
                                     HEAD_DIM, D_PAD, BLOCK_N, False, PAGE, CAUSAL, DOT_PREC, NEW_TMA)
    else:
        k_head_ptr, v_head_ptr = kv_head_source(k_ptr, v_ptr, kv_head, stride_kh, stride_vh, TMA)
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, bt_row_ptr, k_start, seq_k,
                                     offs_m, offs_d, diag, full_end, hi, qk_scale, kv_head,
                                     stride_kb, stride_kt, stride_vb, stride_vt,
                                     HEAD_DIM, D_PAD, BLOCK_N, PAGED, PAGE, CAUSAL, DOT_PREC, TMA)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)            # a row that sees no key gives zeros
    out = acc / l_safe[:, None]
    o_ptrs = o_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    if D_PAD == HEAD_DIM:
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None])
    else:
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


# A causal batch whose longest query row sees on average fewer keys than this takes the small tiles
SHORT_KEYS = 1280


def mean_keys(max_seqlen_q: int, max_seqlen_k: int, causal: bool) -> int:
    """Keys an average query of the longest sequence attends to (what picks the tile size)."""
    return max_seqlen_k - max_seqlen_q // 2 if causal else max_seqlen_k


def _default_config(head_dim: int, dtype: torch.dtype, device: torch.device, keys: int | None = None) -> dict:
    if device.type != "cuda":          # Triton's interpreter: small tiles keep the tests quick
        return dict(block_m=32, block_n=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:         # no tensor-core path worth tuning; keep registers and smem small
        return dict(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if shared_memory(device) < 128 * 1024:
        # Ada and consumer Ampere (99 KiB): a 128 x 128 tile's q, K and V alone fill it; 64 x 64 tiles in two
        # stages take ~80 KiB at head_dim 128 (untuned there: tuned on Hopper)
        return dict(block_m=64, block_n=64, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return dict(block_m=128, block_n=64, num_warps=4, num_stages=3)
    if keys is not None and keys < SHORT_KEYS:
        # H100, TMA loads: a program's fixed cost (q tile, pipeline fill, store) weighs on short key
        # ranges; 64 x 64 tiles fit three programs on an SM, which hide it. 8 x 2,000 fresh tokens: 402
        # TFLOP/s against 376 with 128 x 128; at 1,536 keys (16 x 1,024 after 1,024) 441 against 446.
        return dict(block_m=64, block_n=64, num_warps=4, num_stages=3)
    # H100, Qwen3-0.6B shape: 128/128 beats 128/64 by 3% (8 x 2,000 tokens) to 8% (1 x 12,000)
    return dict(block_m=128, block_n=128, num_warps=8, num_stages=3)


def prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                      block_table=None, block_m=None, block_n=None, num_warps=None, num_stages=None,
                      max_seqlen_q=None, fp16_dots=None, use_tma=None, max_seqlen_k=None, k_new=None, v_new=None):
    """`flash_attn_varlen_func` with explicit tile sizes (None: the default for this head_dim, and with
    max_seqlen_k given, for the batch's key range: mean_keys).
    use_tma: None reads 16-bit K/V through TMA where it applies (kv_tile.kv_descriptors), False never.
    k_new, v_new: with a block table, this step's K/V packed like q (in the cache's dtype, already stored in
    it): where the pages cannot be read through TMA, sequences with nothing cached read these instead."""
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    assert k.shape[-1] == head_dim and v.shape[-1] == head_dim
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty_like(q)
    if total_q == 0 or num_seqs == 0:
        return out
    if max_seqlen_q is None:                          # flash-attn callers pass it; others pay a sync
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if use_tma is None and k.element_size() == 1:
        # an fp8 cache's tiles: widening them to float16 bounds the loop, and TMA measured no faster
        # (H100 engine runs with an fp8 cache: prefill 1-3% slower), so they keep pointer loads
        use_tma = False
    # the short-range tiles were measured with TMA loads only
    keys = mean_keys(max_seqlen_q, max_seqlen_k, causal) if max_seqlen_k is not None and use_tma is not False else None
    cfg = _default_config(head_dim, q.dtype, q.device, keys)
    block_m = block_m or cfg["block_m"]
    block_n = block_n or cfg["block_n"]
    num_warps = num_warps or cfg["num_warps"]
    num_stages = num_stages or cfg["num_stages"]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    paged = block_table is not None
    if paged:
        assert k.dim() == 4 and v.dim() == 4, "with block_table, k/v are [num_blocks, block_size, H, D]"
        page = k.shape[1]
        assert page & (page - 1) == 0, "block_size must be a power of two"
        stride_kb, stride_kt, stride_kh = k.stride(0), k.stride(1), k.stride(2)
        stride_vb, stride_vt, stride_vh = v.stride(0), v.stride(1), v.stride(2)
        bt, stride_btb = block_table, block_table.stride(0)
    else:
        page = 16
        stride_kb, stride_kt, stride_kh = 0, k.stride(0), k.stride(1)
        stride_vb, stride_vt, stride_vh = 0, v.stride(0), v.stride(1)
        bt, stride_btb = cu_seqlens_k, 0   # never read

    group = num_heads // num_kv_heads
    assert block_m >= group, f"block_m={block_m} holds no query of a group of {group} q heads"
    # one program per (query tile, kv head, sequence); tiles past a shorter sequence's end exit at once
    grid = (triton.cdiv(max_seqlen_q, block_m // group), num_kv_heads, num_seqs)
    descs = kv_descriptors(k, v, paged, block_n, use_tma)
    # only where the pages themselves cannot be read through TMA (pages smaller than a tile): with both
    # sources' TMA pipelines the kernel would need twice the shared memory (H100, 128 x 128 tiles: 360 KB)
    new_kv = paged and k_new is not None and descs is None
    if new_kv:
        assert v_new is not None and k_new.shape[0] == total_q and k_new.dtype == k.dtype, "k_new/v_new: packed like q"
        new_descs = kv_descriptors(k_new, v_new, False, block_n, use_tma)
    else:
        k_new, v_new, new_descs = k, v, None          # never read
    launch(_prefill_kernel, grid,
        q, *(descs or (k, v)), out, cu_seqlens_q, cu_seqlens_k, bt, *(new_descs or (k_new, v_new)),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        k_new.stride(-3), k_new.stride(-2), v_new.stride(-3), v_new.stride(-2),
        stride_btb, scale * _LOG2E,
        GROUP=group, HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal), PAGED=paged, PAGE=page,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        FP16_DOTS=wants_fp16_dots(q, k) if fp16_dots is None else fp16_dots, TMA=descs is not None,
        NEW_KV=new_kv, NEW_TMA=new_descs is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float | None = None,
                           causal: bool = False, block_table: torch.Tensor | None = None,
                           k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen attention. Without block_table k/v are packed [Nk, Hkv, D]; with it they are paged caches, and
    k_new/v_new (optional, beyond flash-attn's signature) this step's K/V packed like q, which sequences with
    nothing cached read instead where the pages cannot be read through TMA (prefill_attention)."""
    return prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, block_table,
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, k_new=k_new, v_new=v_new)
