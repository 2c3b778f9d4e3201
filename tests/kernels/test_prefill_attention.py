"""Triton flash_attn_varlen_func against the PyTorch reference run in float64.

On CPU the kernel runs in Triton's interpreter, on small shapes and in float32/float16 (the
interpreter's bf16 tl.dot is broken in Triton 3.9); the CUDA tests run full size in bf16.
"""
import pytest
import torch

from nanovllm.kernels import flash_attn_varlen_func, torch_flash_attn_varlen_func
from nanovllm.kernels.prefill_attention import SHORT_KEYS, _default_config, mean_keys, prefill_attention
from paged_cache import random_paged_cache

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _cu(lens, device):
    return torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)


def _paged(lens_k, num_heads, head_dim, block_size, dtype, device):
    return random_paged_cache(lens_k, num_heads, head_dim, block_size, dtype, device, extra_blocks=3)


def _check(out, ref, tol):
    assert out.shape == ref.shape and out.dtype != torch.float64
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm()
    assert err < tol, f"relative error {err:.2e}"


def _ref(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, block_table=None, scale=None):
    return torch_flash_attn_varlen_func(q.double(), k.double(), v.double(), cu_q, cu_k, max(lens_q),
                                        max(lens_k), softmax_scale=scale, causal=causal,
                                        block_table=block_table)


# sequences whose keys outnumber their queries (prefix-cached prompts), lengths around tile edges
LENS_Q = [1, 16, 33, 7]
LENS_K = [1, 40, 33, 30]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 2, 3, 4])   # 3: a tile of 32 rows holds 10 queries, 2 rows idle
@pytest.mark.parametrize("head_dim", [64, 128])
def test_packed(causal, group, head_dim):
    kv_heads = 1 if group == 4 else 2
    nq, nk = sum(LENS_Q), sum(LENS_K)
    q = torch.randn(nq, kv_heads * group, head_dim, device=DEVICE)
    k = torch.randn(nk, kv_heads, head_dim, device=DEVICE)
    v = torch.randn(nk, kv_heads, head_dim, device=DEVICE)
    cu_q, cu_k = _cu(LENS_Q, DEVICE), _cu(LENS_K, DEVICE)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal)
    _check(out, _ref(q, k, v, cu_q, cu_k, LENS_Q, LENS_K, causal), 1e-5)


@pytest.mark.parametrize("block_size,block_n", [(16, None), (32, None), (16, 32), (64, 32)])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("use_tma", [False, None], ids=["pointers", "default"])
def test_paged(block_size, block_n, group, use_tma):
    """K/V read through the block table; block_n > block_size takes the per-row page lookup (and
    pointer loads, TMA or not)."""
    kv_heads, head_dim = 2, 64
    lens_q, lens_k = [3, 50, 20], [70, 50, 37]
    q = torch.randn(sum(lens_q), kv_heads * group, head_dim, device=DEVICE)
    k_cache, v_cache, table = _paged(lens_k, kv_heads, head_dim, block_size, torch.float32, DEVICE)
    cu_q, cu_k = _cu(lens_q, DEVICE), _cu(lens_k, DEVICE)
    out = prefill_attention(q, k_cache, v_cache, cu_q, cu_k, causal=True, block_table=table, block_n=block_n,
                            use_tma=use_tma)
    _check(out, _ref(q, k_cache, v_cache, cu_q, cu_k, lens_q, lens_k, True, table), 1e-5)



def _rows_of(cache, table, lens_q, lens_k):
    """This step's K (or V) rows packed like q, read out of the pages (what the engine just stored there)."""
    rows = []
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        pos = torch.arange(nk - nq, nk, device=cache.device)
        rows.append(cache[table[i, pos // cache.shape[1]].long(), pos % cache.shape[1]])
    return torch.cat(rows)


@pytest.mark.parametrize("use_tma", [False, None], ids=["pointers", "default"])
def test_paged_with_this_steps_kv_beside(use_tma):
    """A paged batch whose pages are smaller than a key tile (no TMA for them), given this step's K/V
    packed like q (k_new, v_new; on a GPU by default read through TMA): the sequences with nothing cached
    read those, the others their pages, and the outputs are the reference's. Garbage written into the
    fresh sequences' pages afterwards changes nothing, so those are not read through the block table."""
    block_size, block_n = 16, 32
    kv_heads, group, head_dim = 2, 2, 64
    lens_q, lens_k = [20, 3, 50, 37], [20, 70, 50, 37]          # the second continues a cached prefix
    q = torch.randn(sum(lens_q), kv_heads * group, head_dim, device=DEVICE)
    k_cache, v_cache, table = _paged(lens_k, kv_heads, head_dim, block_size, torch.float32, DEVICE)
    k_new, v_new = _rows_of(k_cache, table, lens_q, lens_k), _rows_of(v_cache, table, lens_q, lens_k)
    cu_q, cu_k = _cu(lens_q, DEVICE), _cu(lens_k, DEVICE)
    ref = _ref(q, k_cache, v_cache, cu_q, cu_k, lens_q, lens_k, True, table)
    for i in (0, 2, 3):
        pages = table[i][table[i] >= 0].long()
        k_cache[pages] = float("nan")
        v_cache[pages] = 1e4
    out = prefill_attention(q, k_cache, v_cache, cu_q, cu_k, causal=True, block_table=table, block_n=block_n,
                            use_tma=use_tma, k_new=k_new, v_new=v_new)
    _check(out, ref, 1e-5)


def test_pages_tma_reads_ignore_this_steps_kv():
    """Where the pages can be read through TMA (pages as large as a tile), k_new/v_new go unread: one
    source's pipeline, half the shared memory two would take."""
    kv_heads, head_dim = 2, 64
    lens_q, lens_k = [20, 3], [20, 70]
    q = torch.randn(sum(lens_q), kv_heads * 2, head_dim, device=DEVICE)
    k_cache, v_cache, table = _paged(lens_k, kv_heads, head_dim, 32, torch.float32, DEVICE)
    cu_q, cu_k = _cu(lens_q, DEVICE), _cu(lens_k, DEVICE)
    garbage = torch.full((sum(lens_q), kv_heads, head_dim), float("nan"), device=DEVICE)
    out = prefill_attention(q, k_cache, v_cache, cu_q, cu_k, causal=True, block_table=table, block_n=16,
                            use_tma=True, k_new=garbage, v_new=garbage)
    _check(out, _ref(q, k_cache, v_cache, cu_q, cu_k, lens_q, lens_k, True, table), 1e-5)

def test_paged_head_dim_128_fp16_non_causal():
    lens_q, lens_k = [20, 9], [20, 41]
    q = torch.randn(sum(lens_q), 4, 128, device=DEVICE).half()
    k_cache, v_cache, table = _paged(lens_k, 2, 128, 16, torch.float16, DEVICE)
    cu_q, cu_k = _cu(lens_q, DEVICE), _cu(lens_k, DEVICE)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k),
                                 causal=False, block_table=table)
    assert out.dtype == torch.float16
    _check(out, _ref(q, k_cache, v_cache, cu_q, cu_k, lens_q, lens_k, False, table), 2e-3)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_paged_fp8_cache(dtype, tol):
    """A prompt continuing an fp8 cache: tiles widened in registers, as the reference reads them."""
    lens_q, lens_k = [3, 40], [70, 40]
    q = torch.randn(sum(lens_q), 4, 64, device=DEVICE).to(dtype)
    k_cache, v_cache, table = _paged(lens_k, 2, 64, 16, torch.float8_e4m3fn, DEVICE)
    cu_q, cu_k = _cu(lens_q, DEVICE), _cu(lens_k, DEVICE)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k),
                                 causal=True, block_table=table)
    assert out.dtype == dtype
    _check(out, _ref(q, k_cache, v_cache, cu_q, cu_k, lens_q, lens_k, True, table), tol)


def test_tile_sizes_scale_and_strided_q():
    """Other tiles, a given softmax_scale, q a view of a fused qkv output, head_dim 80 padded to 128."""
    lens = [45, 18, 64]
    n, heads, head_dim = sum(lens), 2, 80
    qkv = torch.randn(n, 3 * heads * head_dim, device=DEVICE)
    q, k, v = (t.view(n, heads, head_dim) for t in qkv.split(heads * head_dim, dim=1))
    cu = _cu(lens, DEVICE)
    for block_m, block_n in [(16, 16), (32, 16), (16, 64)]:
        out = prefill_attention(q, k, v, cu, cu, softmax_scale=0.3, causal=True, block_m=block_m, block_n=block_n)
        _check(out, _ref(q, k, v, cu, cu, lens, lens, True, scale=0.3), 1e-5)


def test_fewer_keys_than_queries():
    """Bottom-right alignment: early queries of a sequence with Lk < Lq see no key and give zeros."""
    lens_q, lens_k = [10, 4], [6, 4]
    q = torch.randn(sum(lens_q), 2, 64, device=DEVICE)
    k = torch.randn(sum(lens_k), 2, 64, device=DEVICE)
    v = torch.randn(sum(lens_k), 2, 64, device=DEVICE)
    cu_q, cu_k = _cu(lens_q, DEVICE), _cu(lens_k, DEVICE)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 10, 6, causal=True)
    assert out[:4].abs().max() == 0
    _check(out, _ref(q, k, v, cu_q, cu_k, lens_q, lens_k, True), 1e-5)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_full_size_paged_fp8_cache():
    torch.manual_seed(0)
    lens_q = [1024] * 6 + [1500, 548]
    lens_k = [n + 300 * i for i, n in enumerate(lens_q)]
    q = torch.randn(sum(lens_q), 16, 128, device="cuda", dtype=torch.bfloat16)
    cu_q, cu_k = _cu(lens_q, "cuda"), _cu(lens_k, "cuda")
    k, v, table = _paged(lens_k, 8, 128, 256, torch.float8_e4m3fn, "cuda")
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, block_table=table)
    _check(out, _ref(q, k, v, cu_q, cu_k, lens_q, lens_k, True, table), 1e-2)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_full_size_bf16(paged, head_dim):
    """16k query tokens: 16 sequences, the paged ones with cached prefixes (Lq < Lk), GQA 16/8."""
    torch.manual_seed(0)
    heads, kv_heads = 16, 8
    lens_q = [1024] * 14 + [1500, 548]
    lens_k = [n + (300 * i if paged else 0) for i, n in enumerate(lens_q)]
    q = torch.randn(sum(lens_q), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    cu_q, cu_k = _cu(lens_q, "cuda"), _cu(lens_k, "cuda")
    if paged:
        k, v, table = _paged(lens_k, kv_heads, head_dim, 256, torch.bfloat16, "cuda")
    else:
        k = torch.randn(sum(lens_k), kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        table = None
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, block_table=table)
    _check(out, _ref(q, k, v, cu_q, cu_k, lens_q, lens_k, True, table), 1e-2)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_tma_tiles(paged, cache_dtype):
    """K/V tiles copied through TMA descriptors (the Hopper path) equal the reference: packed K/V sliced
    out of a fused qkv row (row stride wider than the heads), or pages of a cache, the last tile of each
    sequence masked."""
    kv_heads, group, head_dim = 2, 2, 64
    lens_q, lens_k = [3, 40, 17], [35, 40, 50]
    q = torch.randn(sum(lens_q), kv_heads * group, head_dim, device=DEVICE)
    cu_q, cu_k = _cu(lens_q, DEVICE), _cu(lens_k, DEVICE)
    if paged:
        k, v, table = _paged(lens_k, kv_heads, head_dim, 32, cache_dtype, DEVICE)   # two tiles a page
    else:
        kv = torch.randn(sum(lens_k), 3 * kv_heads, head_dim, device=DEVICE).to(cache_dtype)
        k, v, table = kv[:, kv_heads:2 * kv_heads], kv[:, 2 * kv_heads:], None
    out = prefill_attention(q, k, v, cu_q, cu_k, causal=True, block_table=table, block_n=16, use_tma=True)
    _check(out, _ref(q, k.float(), v.float(), cu_q, cu_k, lens_q, lens_k, True, table), 1e-5)


def test_tma_refused_where_it_cannot_read():
    """use_tma=True on tensors TMA cannot describe (head_dim 96 would read a neighbour's columns) is
    an error, not a silent fallback; the default falls back to pointer loads."""
    q = torch.randn(8, 2, 96, device=DEVICE)
    k = torch.randn(8, 2, 96, device=DEVICE)
    cu = _cu([8], DEVICE)
    with pytest.raises(ValueError, match="TMA"):
        prefill_attention(q, k, k, cu, cu, causal=True, use_tma=True)
    out = prefill_attention(q, k, k, cu, cu, causal=True)
    _check(out, _ref(q, k, k, cu, cu, [8], [8], True), 1e-5)


def test_tile_size_follows_the_key_range(monkeypatch):
    """On a Hopper GPU, 64 x 64 tiles where the longest sequence's average query sees fewer than SHORT_KEYS
    keys (8 fresh prompts of 2,000 tokens), 128 x 128 otherwise; the warm-up's two runs land one each
    side (a fresh prompt of SHORT_KEYS tokens, one token after SHORT_KEYS + 1 cached ones)."""
    from nanovllm.kernels import prefill_attention
    monkeypatch.setattr(prefill_attention, "shared_memory", lambda device: 227 * 1024)
    cuda = torch.device("cuda")
    tiles = lambda q, k: _default_config(128, torch.bfloat16, cuda, mean_keys(q, k, causal=True))["block_m"]
    assert tiles(2000, 2000) == 64
    assert tiles(1024, 2048) == 128 and tiles(12000, 12000) == 128
    assert tiles(SHORT_KEYS, SHORT_KEYS) == 64 and tiles(1, SHORT_KEYS + 2) == 128
    assert _default_config(128, torch.bfloat16, cuda)["block_m"] == 128       # no key range given
