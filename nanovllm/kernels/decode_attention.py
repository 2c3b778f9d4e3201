"""Triton `flash_attn_with_kvcache`: paged decode attention with split-KV (flash-decoding).

Grid (batch x kv heads, splits). A program takes one sequence, one kv head and one contiguous
chunk of that sequence's context (the context length, read on the device, is cut into
`num_splits` chunks of whole key tiles, or of whole pages once a chunk spans one). It computes all
q heads that share the kv head at once: the group of q heads, padded to 16 rows, is one
[GROUP_PAD, D] operand of tl.dot, so each K/V tile is read once for the whole group. An fp8
cache's tiles are widened as they are loaded (its scale is 1.0: nothing to multiply), to float16
for bf16 queries (kv_tile.wants_fp16_dots). With one split the program writes the output
directly; otherwise it writes its partial (max, sum, unnormalized acc) and a reduce kernel
combines them.

Everything is fixed by tensor shapes (grid, split count, scratch sizes): no host sync, so a call
can be captured in a CUDA graph.
"""
import math

import torch
import triton
import triton.language as tl

from .dependent_launch import enter, pdl_options
from .kv_tile import dot_operand, kv_descriptors, kv_head_source, load_kv_tile, tile_page, wants_fp16_dots
from .launch import launch

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_tile(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, page, n_start, end, offs_d, qk_scale, kv_head,
                 stride_kb, stride_kt, stride_vb, stride_vt,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                 MASKED: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    """One key tile; `page`: tile_page's for it, loaded a tile ahead by the caller."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    k, v = load_kv_tile(k_head_ptr, v_head_ptr, page, 0, n_start, end, offs_d,
                        stride_kb, stride_kt, stride_vb, stride_vt, True, PAGE, BLOCK_N, HEAD_DIM, D_PAD, MASKED,
                        TMA, kv_head)
    k, v = k.to(q.dtype), v.to(q.dtype)     # an fp8 cache is dequantized here, in registers

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale          # [GROUP_PAD, BLOCK_N]
    if MASKED:
        s = tl.where((offs_n < end)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _attend_keys(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, bt_row_ptr, start, end, offs_d, qk_scale, kv_head,
                 stride_kb, stride_kt, stride_vb, stride_vt,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                 DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    """Keys [start, end) of the sequence whose block table row bt_row_ptr is, tile by tile (start on a tile
    edge of the chunking: every tile but the last full)."""
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    # each tile's page (or, in pages smaller than a tile, each row's) is loaded a tile ahead: a tile's K/V
    # loads wait on it (H100, Qwen3-0.6B shape, one stream in 16-token pages: 1.147 -> 1.065 ms/token)
    page = tile_page(bt_row_ptr, start, end, True, PAGE, BLOCK_N)
    for n_start in range(start, full_end, BLOCK_N):
        next_page = tile_page(bt_row_ptr, n_start + BLOCK_N, end, True, PAGE, BLOCK_N)
        acc, m_i, l_i = _decode_tile(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, page, n_start, end,
                                     offs_d, qk_scale, kv_head, stride_kb, stride_kt, stride_vb, stride_vt,
                                     HEAD_DIM, D_PAD, BLOCK_N, PAGE, False, DOT_PREC, TMA)
        page = next_page
    if full_end < end:                  # `page` is full_end's tile's now
        acc, m_i, l_i = _decode_tile(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, page, full_end, end,
                                     offs_d, qk_scale, kv_head, stride_kb, stride_kt, stride_vb, stride_vt,
                                     HEAD_DIM, D_PAD, BLOCK_N, PAGE, True, DOT_PREC, TMA)
    return acc, m_i, l_i


# an eager step's table may be any width, and its metadata columns sit at any offset of the step's one copy
# (per-program scalar loads: their alignment buys nothing, and would be one more variant to warm)
@triton.jit(do_not_specialize=["num_splits", "stride_btb", "batch", "part_stride"],
            do_not_specialize_on_alignment=["seqlens_ptr", "bt_ptr", "order_ptr", "shared_ptr"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, seqlens_ptr, bt_ptr, order_ptr, shared_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_btb,
    batch, num_kv_heads, num_heads, qk_scale, num_splits, part_stride,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
    FP16_DOTS: tl.constexpr, TMA: tl.constexpr, ORDERED: tl.constexpr, SHARED: tl.constexpr = False,
    PDL: tl.constexpr = False):
    enter(PDL)
    pid = tl.program_id(0)
    if ORDERED:
        # the sequences' kv heads in `order` (longest first): the SMs start on the longest, so the short ones
        # fill the tail instead of a long one running alone at the end
        b = tl.load(order_ptr + pid // num_kv_heads)
        kv_head = pid % num_kv_heads
    else:
        b = pid % batch
        kv_head = pid // batch
    split = tl.program_id(1)

    seq_len = tl.load(seqlens_ptr + b)
    # SHARED: the row's first shared_ptr[b] keys (whole pages) are its group's, read by _shared_prefix_kernel
    if SHARED:
        first_key = tl.load(shared_ptr + b)
    else:
        first_key = 0
    # chunk: whole tiles, so every tile but the sequence's last needs no mask; whole pages once it spans
    # one (H100, fp8, 16 x 12,256 in 9 chunks: 192 us at 5.4 pages a chunk, 146 at 6)
    chunk = tl.cdiv(seq_len - first_key, num_splits)
    if PAGE % BLOCK_N == 0:
        chunk = tl.where(chunk >= PAGE, tl.cdiv(chunk, PAGE) * PAGE, tl.cdiv(chunk, BLOCK_N) * BLOCK_N)
    else:
        chunk = tl.cdiv(chunk, BLOCK_N) * BLOCK_N
    start = first_key + split * chunk
    end = tl.minimum(seq_len, start + chunk)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_ok = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    if D_PAD == HEAD_DIM:
        io_mask = g_ok[:, None]
    else:
        io_mask = g_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = dot_operand(tl.load(q_ptrs, mask=io_mask, other=0.0), FP16_DOTS)

    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    k_head_ptr, v_head_ptr = kv_head_source(k_ptr, v_ptr, kv_head, stride_kh, stride_vh, TMA)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, bt_ptr + b.to(tl.int64) * stride_btb,
                                 start, end, offs_d, qk_scale, kv_head, stride_kb, stride_kt, stride_vb, stride_vt,
                                 HEAD_DIM, D_PAD, BLOCK_N, PAGE, DOT_PREC, TMA)

    if not SPLIT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        o_ptrs = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=io_mask)
    else:
        # partials laid out [B, num_heads, part_stride] and [B, num_heads, part_stride, D_PAD]: this kernel's
        # splits first, then (SHARED) the shared prefix's
        row = (b.to(tl.int64) * num_heads + heads) * part_stride + split
        tl.store(part_m_ptr + row, m_i, mask=g_ok)
        tl.store(part_l_ptr + row, l_i, mask=g_ok)
        tl.store(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=g_ok[:, None])


# a shared prefix's program reads its pages for this many rows (sequences) of the batch at most
SHARED_PREFIX_ROWS = 16
# and the prefix is cut into this many chunks of whole pages, a program each (fixed: a graph's grid is)
SHARED_PREFIX_SPLITS = 8


@triton.jit(do_not_specialize=["num_heads", "part_stride", "first_slot", "stride_btb"],
            do_not_specialize_on_alignment=["shared_ptr", "items_ptr", "members_ptr", "bt_ptr"])
def _shared_prefix_kernel(
    q_ptr, k_ptr, v_ptr, shared_ptr, items_ptr, members_ptr, bt_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_btb,
    num_heads, qk_scale, part_stride, first_slot,
    GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, SPLITS: tl.constexpr, DOT_PREC: tl.constexpr, FP16_DOTS: tl.constexpr,
    PDL: tl.constexpr = False):
    """Grid (items, kv heads, SPLITS). An item is up to SHARED_PREFIX_ROWS rows of the batch whose contexts
    begin with the same pages (items_ptr: the row whose block table to read them through, the item's first
    index in members_ptr, its row count; 0 rows: nothing to do). A program reads one chunk of those pages
    once for all of them: its [ROWS, D] query operand stacks every row's q heads of the kv head (row r of
    the operand: member r // GROUP, head r % GROUP), as _decode_kernel stacks one sequence's. It writes each
    row's partial at slot first_slot + split; the reduce kernel merges it with the row's own keys'."""
    enter(PDL)
    item, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(items_ptr + item * 3 + 2)
    if count > 0:
        leader = tl.load(items_ptr + item * 3)
        first = tl.load(items_ptr + item * 3 + 1)
        prefix_len = tl.load(shared_ptr + leader)           # whole pages
        chunk = tl.cdiv(tl.cdiv(prefix_len, SPLITS), PAGE) * PAGE
        start = split * chunk
        end = tl.minimum(prefix_len, start + chunk)

        offs_r = tl.arange(0, ROWS)
        offs_d = tl.arange(0, D_PAD)
        r_ok = offs_r < count * GROUP
        b = tl.load(members_ptr + first + offs_r // GROUP, mask=r_ok, other=0).to(tl.int64)
        heads = kv_head * GROUP + offs_r % GROUP
        if D_PAD == HEAD_DIM:
            io_mask = r_ok[:, None]
        else:
            io_mask = r_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        q_ptrs = q_ptr + b[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = dot_operand(tl.load(q_ptrs, mask=io_mask, other=0.0), FP16_DOTS)

        m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, D_PAD], dtype=tl.float32)
        k_head_ptr, v_head_ptr = kv_head_source(k_ptr, v_ptr, kv_head, stride_kh, stride_vh, False)
        # pages smaller than a tile: a chunk's last tile may be part of one (masked)
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, k_head_ptr, v_head_ptr,
                                     bt_ptr + leader.to(tl.int64) * stride_btb, start, end, offs_d, qk_scale,
                                     kv_head, stride_kb, stride_kt, stride_vb, stride_vt,
                                     HEAD_DIM, D_PAD, BLOCK_N, PAGE, DOT_PREC, False)
        row = (b * num_heads + heads) * part_stride + first_slot + split
        tl.store(part_m_ptr + row, m_i, mask=r_ok)
        tl.store(part_l_ptr + row, l_i, mask=r_ok)
        tl.store(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=r_ok[:, None])


# one variant for every split count (an eager step may take any)
@triton.jit(do_not_specialize=["num_splits", "part_stride"], do_not_specialize_on_alignment=["shared_ptr"])
def _reduce_kernel(o_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, shared_ptr, stride_ob, stride_oh, num_heads,
                   num_splits, part_stride, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                   SPLITS_BLOCK: tl.constexpr, SHARED: tl.constexpr = False, PDL: tl.constexpr = False):
    enter(PDL)
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_BLOCK)
    offs_d = tl.arange(0, D_PAD)
    first = (b.to(tl.int64) * num_heads + head) * part_stride
    if SHARED:      # a row in a shared prefix's group has that prefix's partials after its own splits'
        num_splits = tl.where(tl.load(shared_ptr + b) > 0, part_stride, num_splits)
    # one pass over the splits, SPLITS_BLOCK at a time, rescaling the running sums to the largest max so far
    # (choose_num_splits' counts fit one block: every partial is loaded at once)
    m_run = tl.max(tl.full([SPLITS_BLOCK], -1.0e30, dtype=tl.float32), 0)
    l_sum = tl.sum(tl.zeros([SPLITS_BLOCK], dtype=tl.float32), 0)
    acc_sum = tl.zeros([D_PAD], dtype=tl.float32)
    for s0 in range(0, num_splits, SPLITS_BLOCK):
        s_ok = s0 + offs_s < num_splits
        row = first + s0 + offs_s
        m = tl.load(part_m_ptr + row, mask=s_ok, other=-1.0e30)   # empty split: m = -1e30, l = 0
        l = tl.load(part_l_ptr + row, mask=s_ok, other=0.0)
        acc = tl.load(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], mask=s_ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(w * l, 0)
        acc_sum = acc_sum * alpha + tl.sum(w[:, None] * acc, 0)
        m_run = m_new
    out = acc_sum / tl.where(l_sum > 0.0, l_sum, 1.0)
    o_ptrs = o_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


# Splits the reduce combines in one block: one variant for every split count (an eager step may take any), and
# one pass over choose_num_splits' counts. (16 at a time cost one stream of Qwen3-8B 0.1 ms a step: its 64
# splits took four dependent rounds, 7.9 us a reduce against 4.4, H100.)
REDUCE_SPLITS = 64


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int, min_tokens_per_split: int = 256,
                      max_splits: int = REDUCE_SPLITS, programs_per_sm: int = 4,
                      unsplit_per_sm: float | None = None) -> int:
    """Enough (sequence, kv head, split) programs for ~programs_per_sm per SM, each with >=
    min_tokens_per_split keys; none split from unsplit_per_sm (sequence, kv head) programs an SM on."""
    programs = batch * num_kv_heads
    if unsplit_per_sm is not None and programs >= unsplit_per_sm * num_sms:
        return 1
    want = triton.cdiv(programs_per_sm * num_sms, programs)
    useful = max(1, max_context // min_tokens_per_split)
    return max(1, min(want, useful, max_splits))


# A bf16 cache's small-batch tiles read unsplit from this many (sequence, kv head) programs an SM: the partials
# and their reduce cost more than the SMs left idle by one 128-key program an SM in the last wave (H100,
# bench.py's late contexts, 8 kv heads: 46 sequences 118.8 -> 111.1 us, 62 sequences 148.3 -> 134.4 us
# unsplit against 2 splits; 36 sequences 2% faster; docs/benchmarks.md, sixteenth session).
UNSPLIT_PROGRAMS_PER_SM = 2


def _large_programs(device: torch.device, cache_dtype: torch.dtype) -> int:
    """The (sequence, kv head) programs from which a step takes a large batch's tiles: an fp8 cache's beyond
    two an SM (below them, one-warp programs ~16 an SM), a bf16 cache's from four an SM (unsplit already
    from UNSPLIT_PROGRAMS_PER_SM)."""
    sms = _sm_count(device)
    return 2 * sms + 1 if cache_dtype == torch.float8_e4m3fn else 4 * sms


def large_batch(num_kv_heads: int, device: torch.device, cache_dtype: torch.dtype) -> int:
    """The fewest sequences whose decode step takes a large batch's tiles (warm-up compiles both kinds)."""
    return -(-_large_programs(device, cache_dtype) // num_kv_heads)


def unsplit_batch(num_kv_heads: int, device: torch.device, cache_dtype: torch.dtype) -> int | None:
    """The fewest sequences whose decode step reads a small batch's tiles unsplit on a GPU (another compiled
    kernel: warm-up runs it too), or None where small batches are split whatever their size (an fp8 cache;
    the CPU's stand-in tiles): as _default_config's small-batch tiles say."""
    per_sm = _default_config(128, 0, device, cache_dtype).get("unsplit_per_sm")
    return None if per_sm is None else -(-per_sm * _sm_count(device) // num_kv_heads)


def _default_config(head_dim: int, page: int, device: torch.device, cache_dtype: torch.dtype,
                    programs: int = 0) -> dict:
    """Tiles and split target for a batch of `programs` (sequence, kv head) pairs."""
    if device.type != "cuda":
        return dict(block_n=16, num_warps=4, num_stages=1, programs_per_sm=4)
    if head_dim > 128:
        return dict(block_n=64, num_warps=4, num_stages=2, programs_per_sm=4)
    large = programs >= _large_programs(device, cache_dtype)
    if cache_dtype == torch.float8_e4m3fn:
        if not large:
            # a small batch, split into many chunks: one-warp programs on 32-key tiles, ~16 an SM, hide
            # the widening best (H100: 16 x 12,256 168 -> 146 us; 8 x 8,192 57.8 -> 56.6 us)
            return dict(block_n=32, num_warps=1, num_stages=3, programs_per_sm=16)
        # H100: 3 stages 2-3% faster than 2; 256-key tiles 5-10% slower. One-warp tiles also read a large
        # batch of equal lengths faster, but with bench.py's spread of lengths a long sequence's program
        # runs as long as the whole kernel: 13-17% slower (docs/benchmarks.md). Unsplit as a bf16 cache's
        # small tiles: 36-64 sequences of 8 kv heads 2-13% faster than 2 splits (H100, seventeenth session)
        return dict(block_n=128, num_warps=4, num_stages=3, programs_per_sm=4,
                    unsplit_per_sm=UNSPLIT_PROGRAMS_PER_SM)
    if large:
        # H100, bench.py's standard contexts, longest first: 64-key tiles (64 KB of K/V in flight where
        # 128-key tiles hold 128 KB) leave room for three programs an SM: 256 rows 1-2.5% faster on the
        # 8B shape, 11% on the 0.6B shape, 97 rows the same; split batches read slower
        return dict(block_n=64, num_warps=4, num_stages=2, programs_per_sm=4)
    # H100, Qwen3-0.6B shape: 128/2 read ~3% (B=256 x 1024) to ~6% (B=8 x 8192) faster than 64/3
    return dict(block_n=128, num_warps=4, num_stages=2, programs_per_sm=4, unsplit_per_sm=UNSPLIT_PROGRAMS_PER_SM)


def decode_attention(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None,
                     num_splits=None, block_n=None, num_warps=None, num_stages=None, fp16_dots=None,
                     use_tma=False, programs_per_sm=None, order=None, shared_prefix=None):
    """`flash_attn_with_kvcache` with explicit split count and tile sizes (None: heuristics).
    order: int32 [B], a permutation of the batch, the sequences taken in that order (longest first: see
    _decode_kernel); None: as they come.
    shared_prefix: (shared_lens, items, members), int32 tensors (engine/shared_prefixes.py): rows whose
    contexts begin with the same pages read those pages once for the group (_shared_prefix_kernel) and
    their own keys after them as usual; the reduce merges the two. None, or a group of more than 8 q heads
    a kv head: every row reads all its keys.
    use_tma: True or None read K/V through TMA descriptors (kv_tile.kv_descriptors). Off by default:
    on an H100 decode gains nothing from it (bf16 3,012 vs 3,003 GB/s at 256 x 1,024; an fp8 cache 2%
    slower), because the loop is bound by the loads' bytes (bf16) or by widening the tiles (fp8)."""
    batch, q_len, num_heads, head_dim = q.shape
    assert q_len == 1, "decode takes one new token per sequence"
    assert block_table is not None, "decode reads the paged cache through block_table"
    _, page, num_kv_heads, _ = k_cache.shape
    assert page & (page - 1) == 0, "block_size must be a power of two"
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = num_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    cfg = _default_config(head_dim, page, q.device, k_cache.dtype, batch * num_kv_heads)
    block_n = block_n or cfg["block_n"]
    num_warps = num_warps or cfg["num_warps"]
    num_stages = num_stages or cfg["num_stages"]
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_table.shape[1] * page, _sm_count(q.device),
                                       programs_per_sm=programs_per_sm or cfg["programs_per_sm"],
                                       unsplit_per_sm=cfg.get("unsplit_per_sm"))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    out = torch.empty_like(q)
    if batch == 0:
        return out
    shared = shared_prefix is not None and group <= MAX_SHARED_PREFIX_GROUP
    split = num_splits > 1 or shared
    part_stride = num_splits + (SHARED_PREFIX_SPLITS if shared else 0)
    if split:
        part_m = torch.empty(batch, num_heads, part_stride, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(batch, num_heads, part_stride, d_pad, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out      # never touched
    shared_lens = shared_prefix[0] if shared else cache_seqlens     # (unread unless shared)
    fp16_dots = wants_fp16_dots(q, k_cache) if fp16_dots is None else fp16_dots
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    descs = kv_descriptors(k_cache, v_cache, True, block_n, use_tma)
    launch(_decode_kernel, (batch * num_kv_heads, num_splits),
        q, *(descs or (k_cache, v_cache)), out, cache_seqlens, block_table,
        order if order is not None else cache_seqlens, shared_lens, part_m, part_l, part_acc,
        q.stride(0), q.stride(2), out.stride(0), out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        batch, num_kv_heads, num_heads, scale * _LOG2E, num_splits, part_stride,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_N=block_n, PAGE=page, SPLIT=split, DOT_PREC=dot_prec, FP16_DOTS=fp16_dots, TMA=descs is not None,
        ORDERED=order is not None, SHARED=shared, num_warps=num_warps, num_stages=num_stages,
        **pdl_options(q.device))
    if shared:
        _, items, members = shared_prefix
        rows = max(16, triton.next_power_of_2(SHARED_PREFIX_ROWS * group))
        prefix_cfg = _shared_prefix_config(q.device, rows)
        launch(_shared_prefix_kernel, (items.shape[0], num_kv_heads, SHARED_PREFIX_SPLITS),
            q, k_cache, v_cache, shared_lens, items, members, block_table, part_m, part_l, part_acc,
            q.stride(0), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
            num_heads, scale * _LOG2E, part_stride, num_splits,
            GROUP=group, ROWS=rows, HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=page, SPLITS=SHARED_PREFIX_SPLITS,
            DOT_PREC=dot_prec, FP16_DOTS=fp16_dots, **prefix_cfg, **pdl_options(q.device))
    if split:
        _reduce_kernel[(batch, num_heads)](
            out, part_m, part_l, part_acc, shared_lens, out.stride(0), out.stride(2), num_heads, num_splits,
            part_stride, HEAD_DIM=head_dim, D_PAD=d_pad, SPLITS_BLOCK=REDUCE_SPLITS, SHARED=shared, num_warps=4,
            **pdl_options(q.device))
    return out


# a shared prefix's programs stack SHARED_PREFIX_ROWS rows' q heads of a kv head: up to 128 operand rows
MAX_SHARED_PREFIX_GROUP = 8


def _shared_prefix_config(device: torch.device, rows: int) -> dict:
    """_shared_prefix_kernel's key tiles and warps for an operand of `rows` query rows."""
    if device.type != "cuda":
        return dict(BLOCK_N=16, num_warps=4, num_stages=1)
    return dict(BLOCK_N=64, num_warps=4 if rows <= 64 else 8, num_stages=2)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                            softmax_scale: float | None = None, causal: bool = False,
                            order: torch.Tensor | None = None, shared_prefix=None) -> torch.Tensor:
    """Paged decode: q [B, 1, Hq, D] against each sequence's first cache_seqlens[b] cached tokens.

    `causal` changes nothing: the single new query sits at the end and sees every cached key. `order` and
    `shared_prefix` (ours, not flash-attn's): decode_attention's.
    """
    return decode_attention(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, order=order,
                            shared_prefix=shared_prefix)
