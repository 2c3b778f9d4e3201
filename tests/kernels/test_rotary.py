"""Triton rotate_qk against the torch reference of RotaryEmbedding (rotate / norm_rotate), and its fused
KV cache write against rotate_qk followed by store_kvcache (Triton and torch)."""
import pytest
import torch

from nanovllm.kernels import store_kvcache, torch_store_kvcache
from nanovllm.kernels.rotary import rotate_qk
from nanovllm.layers.rotary_kv_store import RotaryEmbedding, norm_rotate, rotate

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(num_tokens, q_heads, kv_heads, head_dim, dtype):
    """q and k as strided views of one fused projection output, as the model passes them."""
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    q = qkv[:, :q_heads * head_dim].view(num_tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    return q, k


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 2, 64), (2, 1, 128), (3, 3, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_reference(norm, q_heads, kv_heads, head_dim, dtype):
    torch.manual_seed(0)
    num_tokens = 7
    rope = RotaryEmbedding(head_dim, 512, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 1, 5, 17, 100, 311, 511], device=DEVICE)
    q, k = _qkv(num_tokens, q_heads, kv_heads, head_dim, dtype)
    assert not q.is_contiguous() and not k.is_contiguous()
    if norm:
        q_w = (1 + 0.1 * torch.randn(head_dim, device=DEVICE)).to(dtype)
        k_w = (1 + 0.1 * torch.randn(head_dim, device=DEVICE)).to(dtype)
        expected = norm_rotate(positions, q, k, rope.cos_sin_cache, q_w, k_w, 1e-6)
        got = rotate_qk(positions, q, k, rope.cos_sin_cache, q_w, k_w, 1e-6)
    else:
        expected = rotate(positions, q, k, rope.cos_sin_cache)
        got = rotate_qk(positions, q, k, rope.cos_sin_cache)
    # float32: the same arithmetic; bfloat16: one rounding step apart at most (the interpreter truncates
    # where CUDA rounds, and fused multiply-adds differ)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    for e, g in zip(expected, got):
        assert g.shape == e.shape and g.dtype == dtype and g.is_contiguous()
        torch.testing.assert_close(g.float(), e.float(), atol=atol, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_position_zero_is_the_identity_and_rotation_keeps_norms():
    rope = RotaryEmbedding(64, 64, 10000.0).to(DEVICE)
    q, k = _qkv(3, 2, 1, 64, torch.float32)
    q_rot, k_rot = rotate_qk(torch.tensor([0, 9, 63], device=DEVICE), q, k, rope.cos_sin_cache)
    torch.testing.assert_close(q_rot[0], q[0])
    torch.testing.assert_close(k_rot[0], k[0])
    # each (i, i + 32) pair is rotated in its plane: pairwise lengths are kept
    pair_len = lambda x: x[..., :32] ** 2 + x[..., 32:] ** 2
    torch.testing.assert_close(pair_len(q_rot), pair_len(q), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(q_rot[1], q[1])


def _check_fused_store(positions, slots, q_heads, kv_heads, head_dim, num_blocks, block_size, cache_dtype, norm):
    """rotate_qk given the caches against rotate_qk followed by store_kvcache (Triton's, and torch's):
    the returned q and k, the value (rounded in place where fp8) and both caches, bitwise."""
    n, device = len(positions), positions.device
    rope = RotaryEmbedding(head_dim, 4096, 10000.0).to(device)
    qkv = 4 * torch.randn(n, (q_heads + 2 * kv_heads) * head_dim, device=device)
    qkv[0, -4:] = torch.tensor([1000.0, -1000.0, 0.0307, -0.0011])     # value: saturates; rounds up; subnormal
    qkv = qkv.bfloat16()
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    views = lambda t: (t[:, :q_size].view(n, q_heads, head_dim),
                       t[:, q_size:q_size + kv_size].view(n, kv_heads, head_dim),
                       t[:, q_size + kv_size:].view(n, kv_heads, head_dim))
    weights = (tuple((1 + 0.1 * torch.randn(head_dim, device=device)).bfloat16() for _ in range(2)) + (1e-6,)
               if norm else ())
    # each cache is blocks 1.. of a buffer: block 0 guards the memory before it (a write to slot -1 lands there)
    shape = (num_blocks + 1, block_size, kv_heads, head_dim)
    k_buffer, v_buffer = (torch.randn(shape, device=device).to(cache_dtype) for _ in range(2))
    untouched = [b.clone() for b in (k_buffer, v_buffer)]
    k_cache, v_cache = k_buffer[1:], v_buffer[1:]
    k_triton, v_triton, k_torch, v_torch = (b[1:].clone() for b in untouched * 2)
    fresh = qkv.clone()

    # unfused, as before: the kernel rotates, then store_kvcache (Triton; torch's on a copy)
    q_ref, k_ref, v_ref = views(qkv.clone())
    q_ref, k_ref = rotate_qk(positions, q_ref, k_ref, rope.cos_sin_cache, *weights)
    k_ref2, v_ref2 = k_ref.clone(), v_ref.clone()
    store_kvcache(k_ref, v_ref, k_triton, v_triton, slots)
    torch_store_kvcache(k_ref2, v_ref2, k_torch, v_torch, slots)

    q, k, v = views(qkv)
    assert not v.is_contiguous()
    q_out, k_out = rotate_qk(positions, q, k, rope.cos_sin_cache, *weights,
                             value=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref) and torch.equal(k_out, k_ref2)
    assert torch.equal(v, v_ref) and torch.equal(v, v_ref2)
    as_bytes = lambda c: c.view(torch.uint8) if c.dtype == torch.float8_e4m3fn else c
    for got, triton_ref, torch_ref, before in zip((k_buffer, v_buffer), (k_triton, v_triton), (k_torch, v_torch),
                                                   untouched):
        assert torch.equal(as_bytes(got[1:]), as_bytes(triton_ref))
        assert torch.equal(as_bytes(got[1:]), as_bytes(torch_ref))
        # every row no slot names keeps its bytes, the guard block's included
        written = torch.zeros((num_blocks + 1) * block_size, dtype=torch.bool, device=device)
        written[block_size + slots[slots >= 0].long()] = True
        rows, rows_before = as_bytes(got).flatten(0, 1), as_bytes(before).flatten(0, 1)
        assert torch.equal(rows[~written], rows_before[~written])
        assert not torch.equal(rows[written], rows_before[written])
    # q and everything but the value are read only; a padded token's value is not rounded
    assert torch.equal(qkv[:, :q_size + kv_size], fresh[:, :q_size + kv_size])
    assert torch.equal(qkv[slots < 0], fresh[slots < 0])
    if cache_dtype == torch.float8_e4m3fn:      # the fp8 rounding really happened where a slot was written
        assert not torch.equal(qkv[slots >= 0], fresh[slots >= 0])
    return k_out


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 2, 64), (3, 3, 80)])
def test_fused_cache_write_matches_rotate_then_store(cache_dtype, norm, q_heads, kv_heads, head_dim):
    """k/v strided views of one fused qkv output, tokens landing in blocks 4, 1, 3 and 0 (out of order,
    blocks 2 and 5 unused), one padded token (slot -1)."""
    torch.manual_seed(0)
    block_size = 16
    positions = torch.tensor([14, 15, 16, 17, 0, 40, 7], device=DEVICE)
    slots = torch.tensor([4 * 16 + 14, 4 * 16 + 15, 1 * 16 + 0, 1 * 16 + 1, -1, 3 * 16 + 8, 7], dtype=torch.int32,
                         device=DEVICE)
    k_out = _check_fused_store(positions, slots, q_heads, kv_heads, head_dim, 6, block_size, cache_dtype, norm)
    if cache_dtype == torch.float8_e4m3fn:     # a padded token's key is returned as rotated, not rounded
        assert not torch.equal(k_out[4], k_out[4].to(cache_dtype).to(k_out.dtype))


def test_cache_arguments_come_together():
    rope = RotaryEmbedding(64, 64, 10000.0).to(DEVICE)
    q, k = _qkv(2, 2, 1, 64, torch.float32)
    with pytest.raises(AssertionError, match="come together"):
        rotate_qk(torch.tensor([0, 1], device=DEVICE), q, k, rope.cos_sin_cache, value=k.clone())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("norm", [False, True])
def test_fused_cache_write_full_size(cache_dtype, norm):
    """A real layer's shape: 256 tokens, 16 q / 8 kv heads of 128, blocks of 256 tokens."""
    torch.manual_seed(0)
    n, num_blocks, block_size = 256, 8, 256
    positions = torch.randint(0, 4096, (n,), device="cuda")
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:n].to(torch.int32)
    slots[::9] = -1
    _check_fused_store(positions, slots, 16, 8, 128, num_blocks, block_size, cache_dtype, norm)
