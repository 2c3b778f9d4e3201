"""Triton `store_kvcache`: scatter one step's keys and values into the paged KV cache.

One program per token. The token's [kv_heads, head_dim] row of `key` and of `value` (which may be
strided views of a fused qkv projection) is written to its flat slot `block_id * block_size + offset`
of `k_cache` / `v_cache` ([num_blocks, block_size, kv_heads, head_dim]). Slot -1 (a padded token)
writes nothing. An fp8 (float8_e4m3fn) cache gets each value saturated at +-448 and rounded to nearest
even, exactly as torch's cast of the clamped value, and key/value are overwritten with what the cache now
holds: a prefill attending them directly sees the K/V that every later step reads, so an fp8 engine's
outputs do not depend on whether a prompt was prefix-cached, chunked or recomputed after preemption.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.dependent_launch import enter, pdl_options


@triton.jit
def e4m3_bits(x):
    """float32 -> the bits of float8_e4m3fn: saturated at +-448 (its largest finite value), rounded to
    nearest even. In integer arithmetic, because Triton's interpreter rounds some casts wrongly
    (0.0307 -> 0.0156)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    # |x| >= 2^-6 (normal): keep 3 of 23 mantissa bits (carry into the exponent), rebias 127 -> 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # |x| < 2^-6 (subnormal): round(|x| * 2^9) with |x| = mant * 2^(exp - 150); 8 rounds up to 2^-6's code
    mant = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - exp, 21), 31)
    subnormal = (mant + (1 << (shift - 1)) - 1 + ((mant >> shift) & 1)) >> shift
    return (sign | tl.where(exp >= 121, normal, subnormal)).to(tl.uint8)


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch, stride_kcd,
    stride_vcb, stride_vct, stride_vch, stride_vcd,
    PAGE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    FP8: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:                      # slot -1: a padded token, nothing to write
        offs = tl.arange(0, BLOCK)
        head = offs // HEAD_DIM
        dim = offs % HEAD_DIM
        mask = offs < NUM_HEADS * HEAD_DIM
        page = slot // PAGE
        within = slot % PAGE
        k_src = key_ptr + token * stride_kt + head * stride_kh + dim * stride_kd
        v_src = value_ptr + token * stride_vt + head * stride_vh + dim * stride_vd
        k = tl.load(k_src, mask=mask)
        v = tl.load(v_src, mask=mask)
        k_dst = k_cache_ptr + page * stride_kcb + within * stride_kct + head * stride_kch + dim * stride_kcd
        v_dst = v_cache_ptr + page * stride_vcb + within * stride_vct + head * stride_vch + dim * stride_vcd
        if FP8:                        # the caches come as uint8 views
            k_bits, v_bits = e4m3_bits(k.to(tl.float32)), e4m3_bits(v.to(tl.float32))
            tl.store(k_dst, k_bits, mask=mask)
            tl.store(v_dst, v_bits, mask=mask)
            tl.store(k_src, k_bits.to(tl.float8e4nv, bitcast=True).to(k.dtype), mask=mask)
            tl.store(v_src, v_bits.to(tl.float8e4nv, bitcast=True).to(v.dtype), mask=mask)
        else:
            tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write key/value [N, kv_heads, head_dim] into the paged caches at flat slots; slot -1 is skipped.
    With an fp8 cache, key and value are rounded in place to the values stored."""
    num_tokens, num_heads, head_dim = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_heads, head_dim), k_cache.shape
    assert slot_mapping.numel() == num_tokens
    if num_tokens == 0:
        return
    block = triton.next_power_of_2(num_heads * head_dim)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        PAGE=k_cache.shape[1], NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK=block, FP8=fp8,
        num_warps=4 if block >= 1024 else (2 if block >= 256 else 1), **pdl_options(key.device))
