"""The KV cache is uninitialized memory: whatever sits in slots past a sequence's length (NaN
included) must not reach the output, in the reference functions and the Triton kernels alike."""
import pytest
import torch

from functools import partial

from nanovllm.kernels import (flash_attn_varlen_func, flash_attn_with_kvcache, torch_flash_attn_varlen_func,
                              torch_flash_attn_with_kvcache)
from nanovllm.kernels.decode_attention import decode_attention
from nanovllm.kernels.prefill_attention import prefill_attention

# the Triton kernels with K/V tiles copied through TMA descriptors (Hopper's path; the interpreter on CPU)
tma_decode = partial(decode_attention, use_tma=True, block_n=16)


def tma_prefill(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, block_table):
    return prefill_attention(q, k, v, cu_q, cu_k, softmax_scale, causal, block_table, block_n=16, use_tma=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def poisoned_cache(lens, block_size=16, kv_heads=2, head_dim=64):
    num_blocks = sum((n + block_size - 1) // block_size for n in lens) + 1
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEVICE)
    v = torch.randn_like(k)
    table = torch.zeros(len(lens), max((n + block_size - 1) // block_size for n in lens) + 1,
                        dtype=torch.int32, device=DEVICE)
    next_block = 0
    for i, n in enumerate(lens):
        for j in range((n + block_size - 1) // block_size):
            table[i, j] = next_block
            next_block += 1
        last = table[i, (n - 1) // block_size]
        k[last, (n - 1) % block_size + 1:] = float("nan")     # the unwritten tail of the last page
        v[last, (n - 1) % block_size + 1:] = float("nan")
    table[:, -1] = num_blocks - 1                             # a padding entry pointing at a page of NaN
    k[-1], v[-1] = float("nan"), float("nan")
    return k, v, table


@pytest.mark.parametrize("decode", [torch_flash_attn_with_kvcache, flash_attn_with_kvcache, tma_decode],
                         ids=["torch", "triton", "triton-tma"])
def test_decode_never_reads_past_the_length(decode):
    lens = [5, 16, 21]
    k, v, table = poisoned_cache(lens)
    q = torch.randn(len(lens), 1, 4, 64, device=DEVICE)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    if decode is tma_decode:
        out = decode(q, k, v, seqlens, table, softmax_scale=0.125)
    else:
        out = decode(q, k, v, cache_seqlens=seqlens, block_table=table, softmax_scale=0.125, causal=True)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("prefill", [torch_flash_attn_varlen_func, flash_attn_varlen_func, tma_prefill],
                         ids=["torch", "triton", "triton-tma"])
def test_prefix_cached_prefill_never_reads_past_the_length(prefill):
    lens_k, lens_q = [5, 21], [2, 6]
    k, v, table = poisoned_cache(lens_k)
    q = torch.randn(sum(lens_q), 4, 64, device=DEVICE)
    cu_q = torch.tensor([0, 2, 8], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 5, 26], dtype=torch.int32, device=DEVICE)
    out = prefill(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), softmax_scale=0.125, causal=True,
                  block_table=table)
    assert torch.isfinite(out).all()
