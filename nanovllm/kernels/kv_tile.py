"""Loading one tile of keys and values, packed or through a sequence's row of the block table, and the
dtype the attention dots run in when the cache is fp8.

On Hopper, prefill's 16-bit tiles come through TMA: K and V are described as 2-D [rows, kv_heads *
head_dim] tensors (a paged cache's pages are consecutive rows), and one instruction copies a [BLOCK_N,
head_dim] tile into shared memory, with no per-element address arithmetic in the loop (H100: prefill
attention 15-18% faster). Decode and fp8 tiles measured no faster through TMA (their loops are bound by
the bytes read, or by widening fp8), so their callers keep pointer loads unless asked.
"""
import functools

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:                      # an older Triton: pointer loads only
    TensorDescriptor = None


def wants_fp16_dots(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """An fp8 cache read by bf16 queries: the dots run in float16, because Hopper widens fp8 to float16
    in one instruction and to bf16 only through float32. float16 holds bf16's values in its range (and
    p in [0, 1] more exactly), so accuracy does not suffer."""
    return k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16


def _tma_view(x: torch.Tensor, paged: bool, block_n: int):
    """x as a 2-D TMA descriptor [rows, kv_heads * head_dim] with [block_n, head_dim] tiles, or None
    where TMA cannot read it: rows must be evenly strided (a paged cache's pages back to back), strides
    and base 16-byte aligned, head_dim a power of two (no padded columns read from a neighbour head)."""
    head_dim, num_heads = x.shape[-1], x.shape[-2]
    row_stride = x.stride(-3)
    if x.stride(-1) != 1 or x.stride(-2) != head_dim or head_dim & (head_dim - 1) or head_dim < 16:
        return None
    if paged:
        if x.stride(0) != x.shape[1] * row_stride or block_n > x.shape[1]:
            return None
        rows = x.shape[0] * x.shape[1]
    else:
        rows = x.shape[0]
    if (row_stride * x.element_size()) % 16 or x.data_ptr() % 16 or rows == 0:
        return None
    return TensorDescriptor(x, [rows, num_heads * head_dim], [row_stride, 1], [block_n, head_dim])


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Hopper or later (the interpreter on CPU runs descriptors too)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, paged: bool, block_n: int, use_tma: bool | None = None):
    """(k_desc, v_desc) for TMA loads on a Hopper-class GPU, or None (pointer loads).
    use_tma: None picks TMA wherever it applies; False never; True insists (ValueError if it can't)."""
    if use_tma is False or (use_tma is None and k.device.type != "cuda"):
        return None                       # the interpreter runs TMA only when a test asks for it
    usable = TensorDescriptor is not None and _has_tma(k.device)
    descs = (_tma_view(k, paged, block_n), _tma_view(v, paged, block_n)) if usable else (None, None)
    if None in descs:
        if use_tma:
            raise ValueError("these K/V tensors cannot be read through TMA descriptors")
        return None
    return descs


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
    """Where the key tile that starts at n_start lies (BLOCK_N and PAGE powers of two, n_start a multiple of
    BLOCK_N): the page holding it where one page holds whole tiles; where the tile spans several pages,
    each of its rows' pages ([BLOCK_N]); 0 at or past `limit`, and 0 for packed K/V. Loops load it a tile
    ahead, so that its latency hides behind a tile of math (the tile's K/V addresses wait on it)."""
    if PAGED and BLOCK_N <= PAGE:
        return tl.load(bt_row_ptr + n_start // PAGE, mask=n_start < limit, other=0)
    elif PAGED:
        offs_n = n_start + tl.arange(0, BLOCK_N)
        return tl.load(bt_row_ptr + offs_n // PAGE, mask=offs_n < limit, other=0)
    else:
        return 0


@triton.jit
def _kv_row_offsets(page, k_start, offs_n, stride_b, stride_t, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """Element offsets of key rows `offs_n` (positions within the sequence) in a K or V tensor; `page`:
    tile_page's (one page, or each row's)."""
    if PAGED:
        return page.to(tl.int64) * stride_b + (offs_n % PAGE).to(tl.int64) * stride_t
    else:
        return (k_start + offs_n).to(tl.int64) * stride_t


@triton.jit
def kv_head_source(k_ptr, v_ptr, kv_head, stride_kh, stride_vh, TMA: tl.constexpr):
    """What load_kv_tile reads one kv head from: the descriptors themselves, or the head's pointers."""
    if TMA:
        return k_ptr, v_ptr
    else:
        return k_ptr + kv_head.to(tl.int64) * stride_kh, v_ptr + kv_head.to(tl.int64) * stride_vh


@triton.jit
def load_kv_tile(k_head_ptr, v_head_ptr, page, k_start, n_start, limit, offs_d,
                 stride_kb, stride_kt, stride_vb, stride_vt,
                 PAGED: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr,
                 TMA: tl.constexpr = False, kv_head=0):
    """[BLOCK_N, D_PAD] tiles of K and V for key positions n_start.. of one sequence; with MASKED,
    rows at or past `limit` (and padded head dims) read as zero. `page`: tile_page's for this tile.
    With TMA, k_head_ptr/v_head_ptr are kv_descriptors' and kv_head picks the columns."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    if TMA:
        if PAGED:
            row = page * PAGE + n_start % PAGE
        else:
            row = k_start + n_start
        k = k_head_ptr.load([row, kv_head * HEAD_DIM])
        v = v_head_ptr.load([row, kv_head * HEAD_DIM])
        if MASKED:                        # rows past the sequence: another's keys, or unwritten (NaN) cache
            row_ok = (offs_n < limit)[:, None]
            k = tl.where(row_ok, k, tl.zeros_like(k))
            v = tl.where(row_ok, v, tl.zeros_like(v))
    else:                                 # (Triton 3.6 traces past a return inside a constexpr branch)
        k, v = _load_kv_pointers(k_head_ptr, v_head_ptr, page, k_start, offs_n, limit, offs_d,
                                 stride_kb, stride_kt, stride_vb, stride_vt, PAGED, PAGE, HEAD_DIM, D_PAD, MASKED)
    return k, v


@triton.jit
def _load_kv_pointers(k_head_ptr, v_head_ptr, page, k_start, offs_n, limit, offs_d,
                      stride_kb, stride_kt, stride_vb, stride_vt, PAGED: tl.constexpr, PAGE: tl.constexpr,
                      HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr):
    """load_kv_tile through per-element pointers (any GPU, any layout)."""
    k_rows = _kv_row_offsets(page, k_start, offs_n, stride_kb, stride_kt, PAGED, PAGE)
    v_rows = _kv_row_offsets(page, k_start, offs_n, stride_vb, stride_vt, PAGED, PAGE)
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
