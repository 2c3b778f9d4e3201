"""Triton `rotate_qk`: rotary embedding of q and k, each head RMS-normalized first when weights are given
(Qwen3's q_norm / k_norm), in one kernel; optionally also the paged KV cache write of the step's K/V.

One program per token. q and k (strided views of the fused qkv projection are fine) are read once as
[heads, head_dim / 2] halves, normalized per head, rotated with the cos / sin row of the token's
position, and written to new contiguous tensors. The intermediate roundings follow the torch reference
(normalized value and weight product in the input dtype, rotation in float32), so results agree with it.

Given `value` and the caches, the same program also writes the rotated key and the value to the token's
slot of the paged caches, with store_kvcache's meaning (slot -1 writes nothing; an fp8 cache gets
`e4m3_bits`, and key / value then hold what the cache holds). A decoder layer then launches one kernel
fewer: a decode step is latency-bound, and each small launch costs more than its work.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.dependent_launch import enter, pdl_options
from nanovllm.kernels.store_kvcache import e4m3_bits


@triton.jit
def _norm_rope_heads(ptrs, mask, w_ptr, dims, cos, sin, eps, HALF: tl.constexpr, NORM: tl.constexpr):
    """One token's heads, `ptrs` pointing at their first halves ([heads, HALF_PAD]): normalized when NORM,
    then rotated; returned as the two halves in the input dtype."""
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        mean_square = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
        r = tl.rsqrt(mean_square + eps)[:, None]
        w1 = tl.load(w_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        x1 = ((x1 * r).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * r).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    return y1.to(dtype), y2.to(dtype)


@triton.jit
def _write_cache(x, dst, mask, FP8: tl.constexpr):
    """Store the tile x at dst (a uint8 view where FP8); return what the cache now holds, in x's dtype."""
    held = x
    if FP8:
        bits = e4m3_bits(x.to(tl.float32))
        tl.store(dst, bits, mask=mask)
        held = bits.to(tl.float8e4nv, bitcast=True).to(x.dtype)
    else:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)
    return held


# positions and slot_mapping are read one scalar a program: their alignment gains nothing, and it varies
# with where a step's inputs lie (an eager decode's differ from the warm-up's), so it must not pick a variant
@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slot_ptr"])
def _rotate_qk_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr,
                      v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_cs, eps,
                      NUM_Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                      NUM_K_HEADS: tl.constexpr, K_HEADS_PAD: tl.constexpr,
                      HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NORM: tl.constexpr,
                      CACHE: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_sin_ptr + position * stride_cs + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + position * stride_cs + HALF + dims, mask=dims < HALF, other=0.0)

    q_heads = tl.arange(0, Q_HEADS_PAD)[:, None]
    q_mask = (q_heads < NUM_Q_HEADS) & (dims < HALF)
    q1, q2 = _norm_rope_heads(q_ptr + token * stride_qt + q_heads * stride_qh + dims, q_mask, q_w_ptr, dims,
                              cos, sin, eps, HALF, NORM)
    q_out = q_out_ptr + token * (NUM_Q_HEADS * 2 * HALF) + q_heads * (2 * HALF) + dims
    tl.store(q_out, q1, mask=q_mask)
    tl.store(q_out + HALF, q2, mask=q_mask)

    k_heads = tl.arange(0, K_HEADS_PAD)[:, None]
    k_mask = (k_heads < NUM_K_HEADS) & (dims < HALF)
    k1, k2 = _norm_rope_heads(k_ptr + token * stride_kt + k_heads * stride_kh + dims, k_mask, k_w_ptr, dims,
                              cos, sin, eps, HALF, NORM)
    if CACHE:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:                  # slot -1: a padded token, nothing written (nor rounded)
            page, within = slot // PAGE, slot % PAGE
            k_dst = k_cache_ptr + page * stride_kcb + within * stride_kct + k_heads * stride_kch + dims
            k1 = _write_cache(k1, k_dst, k_mask, FP8)
            k2 = _write_cache(k2, k_dst + HALF, k_mask, FP8)
            cols = tl.arange(0, HEAD_DIM_PAD)[None, :]
            v_mask = (k_heads < NUM_K_HEADS) & (cols < 2 * HALF)
            v_src = v_ptr + token * stride_vt + k_heads * stride_vh + cols
            v = tl.load(v_src, mask=v_mask)
            v_dst = v_cache_ptr + page * stride_vcb + within * stride_vct + k_heads * stride_vch + cols
            v_held = _write_cache(v, v_dst, v_mask, FP8)
            if FP8:                    # attention over the fresh value sees what the cache holds
                tl.store(v_src, v_held, mask=v_mask)
    k_out = k_out_ptr + token * (NUM_K_HEADS * 2 * HALF) + k_heads * (2 * HALF) + dims
    tl.store(k_out, k1, mask=k_mask)
    tl.store(k_out + HALF, k2, mask=k_mask)


def rotate_qk(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
              q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
              eps: float = 0.0, *, value: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
              v_cache: torch.Tensor | None = None,
              slot_mapping: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) [tokens, heads, head_dim] rotated by their positions' angles; normalized first when the
    weights are given. cos_sin_cache is [max_position, head_dim] float32: cos in the first half, sin in
    the second, pairing dimension i with i + head_dim / 2.

    With value, k_cache, v_cache ([num_blocks, block_size, kv_heads, head_dim]) and slot_mapping, the
    rotated key and the value are also written to the caches as store_kvcache writes them: slot -1 is
    skipped; with an fp8 cache the returned key holds the stored values and value is rounded in place."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    assert head_dim % 2 == 0 and query.stride(2) == 1 and key.stride(2) == 1
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(1) == 1
    norm = q_weight is not None
    assert norm == (k_weight is not None)
    cache = value is not None
    assert all((t is not None) == cache for t in (k_cache, v_cache, slot_mapping)), \
        "value, k_cache, v_cache and slot_mapping come together"
    fp8 = False
    if cache:
        assert value.shape == key.shape and value.stride(2) == 1, (value.shape, key.shape)
        assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == key.shape[1:], k_cache.shape
        assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
        assert slot_mapping.numel() == num_tokens
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        if fp8:                        # the kernel writes e4m3 bits
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:                              # unused pointers and strides
        value, k_cache, v_cache, slot_mapping = key, key, key, positions
    q_out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=query.dtype, device=query.device)
    k_out = torch.empty(num_tokens, num_k_heads, head_dim, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotate_qk_kernel[(num_tokens,)](
        query, key, q_out, k_out, positions, cos_sin_cache,
        q_weight if norm else query, k_weight if norm else key,
        value, k_cache, v_cache, slot_mapping,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], cos_sin_cache.stride(0), eps,
        NUM_Q_HEADS=num_q_heads, Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        NUM_K_HEADS=num_k_heads, K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        NORM=norm, CACHE=cache, PAGE=k_cache.shape[1] if cache else 1, FP8=fp8, num_warps=4,
        **pdl_options(query.device))
    return q_out, k_out
