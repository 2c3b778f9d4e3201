"""Triton `store_kvcache`: scatter one step's keys and values into the paged KV cache.

One program per token. The token's [kv_heads, head_dim] row of `key` and of `value` (which may be
strided views of a fused qkv projection) is written to its flat slot `block_id * block_size + offset`
of `k_cache` / `v_cache` ([num_blocks, block_size, kv_heads, head_dim]). Slot -1 (a padded token)
writes nothing.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch, stride_kcd,
    stride_vcb, stride_vct, stride_vch, stride_vcd,
    PAGE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:                      # slot -1: a padded token, nothing to write
        offs = tl.arange(0, BLOCK)
        head = offs // HEAD_DIM
        dim = offs % HEAD_DIM
        mask = offs < NUM_HEADS * HEAD_DIM
        page = slot // PAGE
        within = slot % PAGE
        k = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim * stride_kd, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim * stride_vd, mask=mask)
        k_dst = k_cache_ptr + page * stride_kcb + within * stride_kct + head * stride_kch + dim * stride_kcd
        v_dst = v_cache_ptr + page * stride_vcb + within * stride_vct + head * stride_vch + dim * stride_vcd
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write key/value [N, kv_heads, head_dim] into the paged caches at flat slots; slot -1 is skipped."""
    num_tokens, num_heads, head_dim = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_heads, head_dim), k_cache.shape
    assert slot_mapping.numel() == num_tokens
    if num_tokens == 0:
        return
    block = triton.next_power_of_2(num_heads * head_dim)
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        PAGE=k_cache.shape[1], NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK=block,
        num_warps=4 if block >= 1024 else (2 if block >= 256 else 1),
    )
