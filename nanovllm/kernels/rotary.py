"""Triton `rotate_qk`: rotary embedding of q and k, each head RMS-normalized first when weights are given
(Qwen3's q_norm / k_norm), in one kernel.

One program per token. q and k (strided views of the fused qkv projection are fine) are read once as
[heads, head_dim / 2] halves, normalized per head, rotated with the cos / sin row of the token's
position, and written to new contiguous tensors. The intermediate roundings follow the torch reference
(normalized value and weight product in the input dtype, rotation in float32), so results agree with it.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_heads(x_ptr, out_ptr, w_ptr, token, stride_t, stride_h, out_stride_t, cos, sin, eps,
                     NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                     NORM: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HALF)[None, :]
    ptrs = x_ptr + token * stride_t + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        mean_square = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
        r = tl.rsqrt(mean_square + eps)[:, None]
        w1 = tl.load(w_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * r).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * r).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    out_ptrs = out_ptr + token * out_stride_t + heads[:, None] * (2 * HALF) + dims[None, :]
    tl.store(out_ptrs, y1.to(dtype), mask=mask)
    tl.store(out_ptrs + HALF, y2.to(dtype), mask=mask)


@triton.jit
def _rotate_qk_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, eps,
                      NUM_Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                      NUM_K_HEADS: tl.constexpr, K_HEADS_PAD: tl.constexpr,
                      HALF: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_sin_ptr + position * stride_cs + dims, mask=dims < HALF, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + position * stride_cs + HALF + dims, mask=dims < HALF, other=0.0)[None, :]
    _norm_rope_heads(q_ptr, q_out_ptr, q_w_ptr, token, stride_qt, stride_qh, NUM_Q_HEADS * 2 * HALF, cos, sin, eps,
                     NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD, NORM)
    _norm_rope_heads(k_ptr, k_out_ptr, k_w_ptr, token, stride_kt, stride_kh, NUM_K_HEADS * 2 * HALF, cos, sin, eps,
                     NUM_K_HEADS, K_HEADS_PAD, HALF, HALF_PAD, NORM)


def rotate_qk(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
              q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
              eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) [tokens, heads, head_dim] rotated by their positions' angles; normalized first when the
    weights are given. cos_sin_cache is [max_position, head_dim] float32: cos in the first half, sin in
    the second, pairing dimension i with i + head_dim / 2."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    assert head_dim % 2 == 0 and query.stride(2) == 1 and key.stride(2) == 1
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(1) == 1
    norm = q_weight is not None
    assert norm == (k_weight is not None)
    q_out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=query.dtype, device=query.device)
    k_out = torch.empty(num_tokens, num_k_heads, head_dim, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotate_qk_kernel[(num_tokens,)](
        query, key, q_out, k_out, positions, cos_sin_cache,
        q_weight if norm else query, k_weight if norm else key,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0), eps,
        NUM_Q_HEADS=num_q_heads, Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        NUM_K_HEADS=num_k_heads, K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), NORM=norm, num_warps=4,
    )
    return q_out, k_out
