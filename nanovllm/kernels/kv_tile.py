"""Loading one tile of keys and values, packed or through a sequence's row of the block table, and the
dtype the attention dots run in when the cache is fp8."""
import torch
import triton
import triton.language as tl


def wants_fp16_dots(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """An fp8 cache read by bf16 queries: the dots run in float16, because Hopper widens fp8 to float16
    in one instruction and to bf16 only through float32. float16 holds bf16's values in its range (and
    p in [0, 1] more exactly), so accuracy does not suffer."""
    return k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16


@triton.jit
def dot_operand(q, FP16_DOTS: tl.constexpr):
    """q as the dots take it: with FP16_DOTS, float16 saturated at its largest value (K/V tiles are
    widened to q's dtype as they are loaded)."""
    if FP16_DOTS:
        return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    else:
        return q


@triton.jit
def tile_page(bt_row_ptr, n_start, limit, PAGED: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The page holding the key tile that starts at n_start, where one page holds whole tiles (BLOCK_N
    and PAGE are powers of two, n_start a multiple of BLOCK_N); 0 otherwise, or at or past `limit`.
    Loops load it a tile ahead, so that its latency hides behind a tile of math."""
    if PAGED and BLOCK_N <= PAGE:
        return tl.load(bt_row_ptr + n_start // PAGE, mask=n_start < limit, other=0)
    else:
        return 0


@triton.jit
def _kv_row_offsets(bt_row_ptr, page, k_start, offs_n, n_limit,
                    stride_b, stride_t, PAGED: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Element offsets of key rows `offs_n` (positions within the sequence) in a K or V tensor."""
    if PAGED:
        if BLOCK_N <= PAGE:               # the whole tile lies inside `page` (tile_page)
            rows = page.to(tl.int64) * stride_b + (offs_n % PAGE).to(tl.int64) * stride_t
        else:
            if MASKED:
                page = tl.load(bt_row_ptr + offs_n // PAGE, mask=offs_n < n_limit, other=0).to(tl.int64)
            else:
                page = tl.load(bt_row_ptr + offs_n // PAGE).to(tl.int64)
            rows = page * stride_b + (offs_n % PAGE).to(tl.int64) * stride_t
    else:
        rows = (k_start + offs_n).to(tl.int64) * stride_t
    return rows


@triton.jit
def load_kv_tile(k_head_ptr, v_head_ptr, bt_row_ptr, page, k_start, n_start, limit, offs_d,
                 stride_kb, stride_kt, stride_vb, stride_vt,
                 PAGED: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr):
    """[BLOCK_N, D_PAD] tiles of K and V for key positions n_start.. of one sequence; with MASKED,
    rows at or past `limit` (and padded head dims) read as zero. `page`: tile_page's for this tile."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    k_rows = _kv_row_offsets(bt_row_ptr, page, k_start, offs_n, limit, stride_kb, stride_kt,
                             PAGED, PAGE, BLOCK_N, MASKED)
    v_rows = _kv_row_offsets(bt_row_ptr, page, k_start, offs_n, limit, stride_vb, stride_vt,
                             PAGED, PAGE, BLOCK_N, MASKED)
    k_ptrs = k_head_ptr + k_rows[:, None] + offs_d[None, :]
    v_ptrs = v_head_ptr + v_rows[:, None] + offs_d[None, :]
    if MASKED:
        row_ok = offs_n < limit
        if D_PAD == HEAD_DIM:
            ld_mask = row_ok[:, None]
        else:
            ld_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptrs, mask=ld_mask, other=0.0)
        v = tl.load(v_ptrs, mask=ld_mask, other=0.0)
    else:
        if D_PAD == HEAD_DIM:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            d_ok = offs_d[None, :] < HEAD_DIM
            k = tl.load(k_ptrs, mask=d_ok, other=0.0)
            v = tl.load(v_ptrs, mask=d_ok, other=0.0)
    return k, v
