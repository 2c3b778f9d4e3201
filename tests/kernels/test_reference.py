"""The PyTorch reference attention (the CPU's "torch" backend and the Triton kernels' oracle): its batched
paged decode equals attention written out one sequence and one head at a time, for grouped-query heads,
several causal queries per sequence, ragged lengths (0 and page edges included), a batch whose block
table is wider than any sequence needs, and unwritten slots that hold NaN."""
import pytest
import torch

from nanovllm.kernels.reference import flash_attn_varlen_func, flash_attn_with_kvcache

pytestmark = pytest.mark.cpu_only     # the torch reference on CPU tensors


def naive_decode(q, k_cache, v_cache, lens, table, scale, causal):
    """out[b, i, h] = softmax(scale * q[b, i, h] . k_j) v_j over sequence b's keys j, read slot by slot through
    its block table (query i of Lq sits at position len - Lq + i and sees keys up to it when causal)."""
    batch, lq, heads, _ = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        slots = [(int(table[b, j // block_size]), j % block_size) for j in range(lens[b])]
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            keys = torch.stack([k_cache[p, s, kvh] for p, s in slots]).double() if slots else None
            values = torch.stack([v_cache[p, s, kvh] for p, s in slots]).double() if slots else None
            for i in range(lq):
                seen = lens[b] - lq + i + 1 if causal else lens[b]
                if seen <= 0:
                    continue                                   # no key: zeros
                weights = torch.softmax(scale * (keys[:seen] @ q[b, i, h].double()), 0)
                out[b, i, h] = weights @ values[:seen]
    return out


def paged(lens, kv_heads, head_dim, block_size, width):
    """Caches whose pages are scattered, every slot no sequence owns NaN, the table padded with -1."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(num_blocks).tolist()
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        for j in range(need[b]):
            table[b, j] = order.pop()
        for j in range(n):
            page, slot = int(table[b, j // block_size]), j % block_size
            k_cache[page, slot] = torch.randn(kv_heads, head_dim)
            v_cache[page, slot] = torch.randn(kv_heads, head_dim)
    return k_cache, v_cache, table


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("lq, causal", [(1, True), (1, False), (3, True)])
def test_batched_paged_decode_is_attention_one_sequence_at_a_time(heads, kv_heads, lq, causal):
    torch.manual_seed(heads * 10 + kv_heads + lq)
    lens = [5, 16, 0, 1, 17, 3] if lq == 1 else [5, 16, 3, 17]      # Lq queries need Lq keys
    block_size, head_dim = 8, 16
    k_cache, v_cache, table = paged(lens, kv_heads, head_dim, block_size, width=5)   # 3 pages are the most used
    q = torch.randn(len(lens), lq, heads, head_dim)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, softmax_scale=0.3, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    expected = naive_decode(q, k_cache, v_cache, lens, table, 0.3, causal)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # in float64 it computes in float64
    out64 = flash_attn_with_kvcache(q.double(), k_cache.double(), v_cache.double(), seqlens, table,
                                    softmax_scale=0.3, causal=causal)
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64, expected, atol=1e-12, rtol=1e-12)


def test_decode_without_a_block_table_reads_contiguous_caches():
    """block_table None: k/v are [B, L, Hkv, D], row b's first cache_seqlens[b] tokens its keys."""
    torch.manual_seed(3)
    lens, heads, kv_heads, head_dim, width = [4, 9, 1], 4, 2, 8, 12
    k = torch.randn(len(lens), width, kv_heads, head_dim)
    v = torch.randn_like(k)
    for b, n in enumerate(lens):
        k[b, n:], v[b, n:] = float("nan"), float("nan")
    q = torch.randn(len(lens), 1, heads, head_dim)
    out = flash_attn_with_kvcache(q, k, v, torch.tensor(lens), causal=True)
    # the same keys as one page per sequence
    table = torch.arange(len(lens), dtype=torch.int32).view(-1, 1)
    expected = naive_decode(q, k, v, lens, table, head_dim ** -0.5, True)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_matches_the_varlen_function_over_the_same_pages():
    """A decode step's query is the last query of a prefill over the same cached tokens."""
    torch.manual_seed(4)
    lens, heads, kv_heads, head_dim, block_size = [7, 16, 20], 6, 3, 16, 8
    k_cache, v_cache, table = paged(lens, kv_heads, head_dim, block_size, width=4)
    q = torch.randn(len(lens), 1, heads, head_dim)
    cu_q = torch.arange(len(lens) + 1, dtype=torch.int32)
    cu_k = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    varlen = flash_attn_varlen_func(q.squeeze(1), k_cache, v_cache, cu_q, cu_k, 1, max(lens), causal=True,
                                    block_table=table)
    decode = flash_attn_with_kvcache(q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), table, causal=True)
    torch.testing.assert_close(decode.squeeze(1), varlen, atol=1e-6, rtol=1e-5)
