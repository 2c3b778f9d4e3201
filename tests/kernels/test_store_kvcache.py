"""Triton store_kvcache against the PyTorch reference (interpreter on CPU, full size on CUDA)."""
import pytest
import torch

from nanovllm.kernels import store_kvcache, torch_store_kvcache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run_both(key, value, num_blocks, block_size, slots, cache_dtype):
    num_heads, head_dim = key.shape[1:]
    k_cache = torch.randn(num_blocks, block_size, num_heads, head_dim, device=key.device).to(cache_dtype)
    v_cache = torch.randn(k_cache.shape, device=key.device).to(cache_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    key_ref, value_ref = key.clone(), value.clone()
    store_kvcache(key, value, k_cache, v_cache, slots)
    torch_store_kvcache(key_ref, value_ref, k_ref, v_ref, slots)
    # fp8: both round key/value in place to the stored values (the rest of the engine reads those)
    assert torch.equal(key, key_ref) and torch.equal(value, value_ref)
    if cache_dtype == torch.float8_e4m3fn:      # compare the bytes (float8 has no torch.equal everywhere)
        k_cache, v_cache, k_ref, v_ref = (t.view(torch.uint8) for t in (k_cache, v_cache, k_ref, v_ref))
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
    return k_cache, v_cache


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,head_dim", [(2, 64), (1, 128), (3, 80)])
def test_store_from_fused_qkv(block_size, num_heads, head_dim):
    """key/value are strided views of a fused qkv output; some slots are -1."""
    n, q_heads, num_blocks = 9, 2 * num_heads, 5
    qkv = torch.randn(n, (q_heads + 2 * num_heads) * head_dim, device=DEVICE)
    key = qkv[:, q_heads * head_dim:(q_heads + num_heads) * head_dim].view(n, num_heads, head_dim)
    value = qkv[:, (q_heads + num_heads) * head_dim:].view(n, num_heads, head_dim)
    assert not key.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:n].to(torch.int32)
    slots[[1, 5]] = -1
    _run_both(key, value, num_blocks, block_size, slots, torch.float32)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)])
def test_store_dtypes(dtype, cache_dtype):
    """bf16 as the engine uses it, and a float32 -> float16 conversion on the way in.

    (float32 -> bf16 is left out: Triton 3.9's interpreter truncates where torch rounds.)
    """
    key = torch.randn(6, 2, 64, device=DEVICE).to(dtype)
    value = torch.randn(6, 2, 64, device=DEVICE).to(dtype)
    slots = torch.tensor([0, 17, -1, 31, 5, 16], dtype=torch.int32, device=DEVICE)
    _run_both(key, value, 2, 16, slots, cache_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_fp8_rounds_as_torch_and_saturates(dtype):
    """Every byte as torch's float8_e4m3fn cast of the value clamped to +-448: values over a wide range
    of magnitudes (subnormals, rounding across a power of two), out-of-range ones and infinities. No
    byte is one of e4m3fn's NaN codes."""
    n, num_heads, head_dim = 32, 2, 64
    scales = torch.logspace(-4, 3.5, n * num_heads * head_dim, device=DEVICE).view(n, num_heads, head_dim)
    key = (torch.randn(n, num_heads, head_dim, device=DEVICE) * scales).to(dtype)
    value = (torch.randn(n, num_heads, head_dim, device=DEVICE) * scales.flip(0)).to(dtype)
    key[0, 0, :4] = torch.tensor([1e6, -1e6, float("inf"), float("-inf")])
    value[0, 0, :4] = torch.tensor([448.0, 464.0, 0.0307, -0.0011])    # top, over, rounds up a binade, subnormal
    slots = torch.randperm(4 * 16, device=DEVICE)[:n].to(torch.int32)
    k_bytes, v_bytes = _run_both(key, value, 4, 16, slots, torch.float8_e4m3fn)
    for cache in (k_bytes, v_bytes):
        assert not ((cache & 0x7F) == 0x7F).any()
    stored = k_bytes.view(torch.float8_e4m3fn).view(-1, num_heads, head_dim)[slots.long()]
    assert stored[0, 0, :4].float().tolist() == [448.0, -448.0, 448.0, -448.0]
    assert torch.equal(key, stored.to(dtype))            # key now holds what its slots hold


def test_all_slots_skipped():
    key = torch.randn(4, 2, 64, device=DEVICE)
    slots = torch.full((4,), -1, dtype=torch.int32, device=DEVICE)
    _run_both(key, key.clone(), 2, 16, slots, torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_store_full_size_bf16():
    n, q_heads, kv_heads, head_dim, block_size, num_blocks = 16384, 16, 8, 128, 256, 128
    qkv = torch.randn(n, (q_heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16)
    key = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    value = qkv[:, (q_heads + kv_heads) * head_dim:].view(n, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:n].to(torch.int32)
    slots[::7] = -1
    _run_both(key, value, num_blocks, block_size, slots, torch.bfloat16)
    _run_both(key * 100, value, num_blocks, block_size, slots, torch.float8_e4m3fn)
