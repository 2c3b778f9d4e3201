"""Triton flash_attn_with_kvcache (split-KV paged decode) against the PyTorch reference in float64.

On CPU the kernels run in Triton's interpreter on small shapes in float32/float16; the CUDA tests
run full size in bf16 and under CUDA-graph capture.
"""
import pytest
import torch

from nanovllm.kernels import flash_attn_with_kvcache, torch_flash_attn_with_kvcache
from nanovllm.kernels import decode_attention as decode_attention_module
from nanovllm.engine.shared_prefixes import shared_prefixes
from nanovllm.kernels.decode_attention import (REDUCE_SPLITS, SHARED_PREFIX_ROWS, choose_num_splits, decode_attention,
                                                large_batch, unsplit_batch)
from paged_cache import random_paged_cache

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _setup(lens, heads, kv_heads, head_dim, block_size, dtype, device, width=None):
    k_cache, v_cache, table = random_paged_cache(lens, kv_heads, head_dim, block_size, dtype, device, width)
    q = torch.randn(len(lens), 1, heads, head_dim, device=device).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, seqlens, table


def _ref(q, k_cache, v_cache, seqlens, table):
    return torch_flash_attn_with_kvcache(q.double(), k_cache.double(), v_cache.double(), seqlens, table)


def _check(out, ref, tol):
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm()
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_default(group, head_dim):
    kv_heads = 2 if group < 4 else 1
    lens = [1, 16, 17, 75]
    q, k, v, seqlens, table = _setup(lens, kv_heads * group, kv_heads, head_dim, 16, torch.float32, DEVICE)
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table, causal=True)
    _check(out, _ref(q, k, v, seqlens, table), 1e-5)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, REDUCE_SPLITS + 6])
@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
def test_split_edges(num_splits, use_tma):
    """Context lengths at and around split and tile edges (tiles of 16), down to 1, over many blocks (more
    splits than the reduce combines at once: it takes them in two rounds); K/V tiles loaded through pointers
    and through TMA descriptors (Hopper's path)."""
    bn = 16
    lens = [1, 2, bn - 1, bn, bn + 1, num_splits * bn - 1, num_splits * bn, num_splits * bn + 1, 200]
    q, k, v, seqlens, table = _setup(lens, 4, 2, 64, 16, torch.float32, DEVICE)
    out = decode_attention(q, k, v, seqlens, table, num_splits=num_splits, block_n=bn, use_tma=use_tma)
    _check(out, _ref(q, k, v, seqlens, table), 1e-5)


@pytest.mark.parametrize("block_size,block_n,use_tma", [(32, 16, False), (16, 32, False), (16, 64, False),
                                                      (64, 64, False), (64, 16, True), (32, 32, True)])
def test_block_sizes(block_size, block_n, use_tma):
    """Pages larger and smaller than the key tile (per-row page lookup when block_n > block_size); TMA
    tiles at each offset inside a page."""
    lens = [5, 64, 97, 130]
    q, k, v, seqlens, table = _setup(lens, 8, 2, 64, block_size, torch.float32, DEVICE)
    out = decode_attention(q, k, v, seqlens, table, num_splits=3, block_n=block_n, use_tma=use_tma)
    _check(out, _ref(q, k, v, seqlens, table), 1e-5)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_chunks_of_whole_pages(num_splits):
    """A chunk that spans a page is rounded up to whole pages (pages of 32, tiles of 16), so some
    sequences leave their last splits empty (100 keys in 3 splits: 64 + 36 + nothing)."""
    lens = [1, 33, 64, 95, 100, 200]
    q, k, v, seqlens, table = _setup(lens, 4, 2, 64, 32, torch.float32, DEVICE)
    out = decode_attention(q, k, v, seqlens, table, num_splits=num_splits, block_n=16)
    _check(out, _ref(q, k, v, seqlens, table), 1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_an_order_of_the_rows_changes_no_output(num_splits):
    """Sequences taken in a given order (longest first, as the engine sends them) or as they come write the
    very same rows: the order moves programs, not results."""
    lens = [7, 200, 1, 64, 130, 33]
    q, k, v, seqlens, table = _setup(lens, 8, 2, 64, 16, torch.float32, DEVICE)
    order = torch.argsort(seqlens, descending=True, stable=True).to(torch.int32)
    ordered = decode_attention(q, k, v, seqlens, table, num_splits=num_splits, block_n=16, order=order)
    as_they_come = decode_attention(q, k, v, seqlens, table, num_splits=num_splits, block_n=16)
    assert torch.equal(ordered, as_they_come)
    _check(ordered, _ref(q, k, v, seqlens, table), 1e-5)


def test_fp16_scale_and_zero_length():
    """float16, an explicit softmax_scale, head_dim 96 padded, and an empty context giving zeros."""
    lens = [0, 40, 3]
    q, k, v, seqlens, table = _setup(lens, 2, 1, 96, 16, torch.float16, DEVICE)
    for splits in (1, 2):
        out = decode_attention(q, k, v, seqlens, table, softmax_scale=0.2, num_splits=splits)
        assert out.dtype == torch.float16 and out[0].abs().max() == 0
        ref = torch_flash_attn_with_kvcache(q.double(), k.double(), v.double(), seqlens, table, softmax_scale=0.2)
        _check(out[1:], ref[1:], 2e-3)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_fp8_cache(dtype, tol):
    """An fp8 cache widened in registers: the same as the reference reading the same fp8 values (bf16
    queries: the dots run in float16)."""
    lens = [1, 30, 75]
    q, k, v, seqlens, table = _setup(lens, 4, 2, 64, 16, torch.float8_e4m3fn, DEVICE)
    q = q.to(dtype)
    for splits, use_tma in ((1, False), (3, False), (3, True)):
        out = decode_attention(q, k, v, seqlens, table, num_splits=splits, block_n=16, use_tma=use_tma)
        assert out.dtype == dtype
        _check(out, _ref(q, k, v, seqlens, table), tol)


def _share_pages(table, lens, groups, block_size):
    """Rows of each group take their first pages from the group's first row (as prefix-cache hits do):
    groups = [(rows, pages)]. Returns shared_prefixes' metadata for the table, as tensors (every grouping
    taken, however little it saves)."""
    for rows, pages in groups:
        table[rows[1:], :pages] = table[rows[0], :pages]
    shared = shared_prefixes(table.cpu().numpy(), torch.tensor(lens).numpy(), block_size, SHARED_PREFIX_ROWS, 0.0)
    assert shared is not None
    return tuple(torch.from_numpy(a).to(table.device) for a in shared)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_rows_sharing_pages_read_them_once_for_the_group(group, num_splits):
    """Rows whose first pages are the same blocks: the group's programs read those pages for all of them, each
    row its own keys after them, and the merge gives what every row reading all its keys gives (beside rows in no
    group; a group longer than an item's rows; q heads per kv head 1 to 8, 3 padded in the stacked operand)."""
    torch.manual_seed(0)
    lens = [70, 75, 40, 90, 33, 18, 64, 65] + [50 + 3 * i for i in range(20)]
    q, k, v, seqlens, table = _setup(lens, 2 * group, 2, 32, 16, torch.float32, DEVICE)
    shared = _share_pages(table, lens, [([0, 1, 3, 6, 7], 2), ([2, 4], 1), (list(range(8, 28)), 3)], 16)
    assert int((shared[1][:, 2] > 0).sum()) > 2             # the 20-row group spans two items
    out = decode_attention(q, k, v, seqlens, table, num_splits=num_splits, block_n=16, shared_prefix=shared)
    _check(out, _ref(q, k, v, seqlens, table), 1e-5)
    unshared = decode_attention(q, k, v, seqlens, table, num_splits=num_splits, block_n=16)
    _check(out, unshared.double(), 1e-5)


def test_shared_pages_larger_than_a_tile_with_items_to_spare_and_an_order():
    """Pages of 64 read in 16-key tiles; a whole context shared but for its newest page; items past the step's
    (a graph's capacity) hold no rows and write nothing; rows taken longest first."""
    torch.manual_seed(1)
    lens = [129, 200, 150, 140, 64 * 3 + 1, 20]
    q, k, v, seqlens, table = _setup(lens, 8, 2, 64, 64, torch.float32, DEVICE)
    shared_lens, items, members = _share_pages(table, lens, [([0, 1, 2, 3, 4], 2)], 64)
    assert shared_lens.tolist() == [128] * 5 + [0]
    items = torch.cat([items, torch.zeros(3, 3, dtype=torch.int32, device=items.device)])
    order = torch.argsort(seqlens - shared_lens, descending=True, stable=True).to(torch.int32)
    out = decode_attention(q, k, v, seqlens, table, num_splits=2, block_n=16, order=order,
                           shared_prefix=(shared_lens, items, members))
    _check(out, _ref(q, k, v, seqlens, table), 1e-5)


@pytest.mark.parametrize("block_n", [32, 64])
def test_shared_pages_smaller_than_a_tile(block_n):
    """16-token pages read in larger tiles: a row's own keys start at a page, inside a tile (each row's page
    looked up), and a group's chunk of pages ends inside its last tile."""
    torch.manual_seed(2)
    lens = [90, 101, 77, 130, 45]
    q, k, v, seqlens, table = _setup(lens, 4, 2, 64, 16, torch.float32, DEVICE)
    shared = _share_pages(table, lens, [([0, 1, 2, 3], 3), ([0, 4], 1)], 16)
    assert shared[0].tolist() == [48] * 4 + [0]         # (four rows at 3 pages save more than five at 1)
    for splits in (1, 2):
        out = decode_attention(q, k, v, seqlens, table, num_splits=splits, block_n=block_n, shared_prefix=shared)
        _check(out, _ref(q, k, v, seqlens, table), 1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_shared_pages_of_an_fp8_cache(dtype, tol):
    """An fp8 cache's shared pages widened as the row's own are (bf16 queries: float16 dots)."""
    lens = [40, 47, 33, 60]
    q, k, v, seqlens, table = _setup(lens, 4, 2, 64, 16, torch.float8_e4m3fn, DEVICE)
    q = q.to(dtype)
    shared = _share_pages(table, lens, [([0, 1, 2, 3], 2)], 16)
    out = decode_attention(q, k, v, seqlens, table, num_splits=2, block_n=16, shared_prefix=shared)
    _check(out, _ref(q, k, v, seqlens, table), tol)


def test_more_q_heads_a_kv_head_than_a_group_holds_read_every_key_themselves():
    """Past MAX_SHARED_PREFIX_GROUP q heads a kv head (16 rows' stacked heads would pass 128 operand rows) the
    shared prefix is ignored: the output is still right."""
    lens = [40, 47]
    q, k, v, seqlens, table = _setup(lens, 16, 1, 32, 16, torch.float32, DEVICE)
    shared = _share_pages(table, lens, [([0, 1], 2)], 16)
    out = decode_attention(q, k, v, seqlens, table, num_splits=1, block_n=16, shared_prefix=shared)
    _check(out, _ref(q, k, v, seqlens, table), 1e-5)


def test_choose_num_splits():
    assert choose_num_splits(256, 8, 1024, 132) == 1
    assert choose_num_splits(8, 8, 8192, 132) > 4
    assert choose_num_splits(1, 1, 100, 132) == 1           # too short to split
    assert choose_num_splits(1, 1, 1 << 20, 132) == 64      # capped
    # small fp8 batches run one-warp programs and want ~16 an SM: 16 x 8 kv heads -> 17 chunks
    assert choose_num_splits(16, 8, 16384, 132, programs_per_sm=16) == 17
    # from unsplit_per_sm programs an SM on, none is split, however few that leaves an SM
    assert choose_num_splits(33, 8, 8192, 132, unsplit_per_sm=2) == 1
    assert choose_num_splits(33, 8, 8192, 132) == 2
    assert choose_num_splits(32, 8, 8192, 132, unsplit_per_sm=2) == 3


@pytest.mark.parametrize("kv_heads", [8, 4, 1])
def test_small_bf16_batches_read_unsplit_from_unsplit_batch_on(kv_heads, monkeypatch):
    """A bf16 cache's small batches keep their tiles but stop splitting from UNSPLIT_PROGRAMS_PER_SM (sequence,
    kv head) programs an SM, below the large batches' tiles; unsplit_batch (what warm-up runs besides a lone
    sequence and a large batch) is the first such batch. An fp8 cache's small batches always split (one-warp
    programs want ~16 an SM), and the CPU's stand-in tiles have no such batch."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setitem(decode_attention_module._SM_COUNT, 0, 132)       # an H100's SMs, without a GPU
    config = lambda batch: decode_attention_module._default_config(128, 256, gpu, torch.bfloat16, batch * kv_heads)
    splits = lambda batch: choose_num_splits(batch, kv_heads, 8192, 132, programs_per_sm=config(batch)["programs_per_sm"],
                                             unsplit_per_sm=config(batch).get("unsplit_per_sm"))
    first = unsplit_batch(kv_heads, gpu, torch.bfloat16)
    assert first * kv_heads >= 2 * 132 > (first - 1) * kv_heads
    assert first < large_batch(kv_heads, gpu, torch.bfloat16)
    assert config(first) == config(first - 1) == config(1)              # the same tiles ...
    assert splits(first) == 1 and splits(first - 1) > 1                 # ... unsplit from first on
    assert unsplit_batch(kv_heads, gpu, torch.float8_e4m3fn) is None
    assert unsplit_batch(kv_heads, torch.device("cpu"), torch.bfloat16) is None


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("kv_heads", [8, 4, 1])
def test_large_batches_take_their_own_tiles_from_large_batch_on(kv_heads, cache_dtype, monkeypatch):
    """A GPU's tiles by the step's (sequence, kv head) programs, two kinds for each cache dtype; large_batch (what
    warm-up compiles beside a lone sequence) is the first batch of the second kind. A bf16 cache's large
    batches read 64-key tiles unsplit; an fp8 cache's small ones run one-warp programs, its large ones read
    128-key tiles unsplit."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setitem(decode_attention_module._SM_COUNT, 0, 132)       # an H100's SMs, without a GPU
    config = lambda batch: decode_attention_module._default_config(128, 256, gpu, cache_dtype, batch * kv_heads)
    first = large_batch(kv_heads, gpu, cache_dtype)
    assert config(first) != config(first - 1) and config(1) == config(first - 1)
    assert config(first) == config(first * 4)
    if cache_dtype == torch.bfloat16:
        assert config(first)["block_n"] == 64 and config(first - 1)["block_n"] == 128
        assert choose_num_splits(first, kv_heads, 8192, 132, programs_per_sm=config(first)["programs_per_sm"]) == 1
        small = config(first - 1)         # the small tiles just below: unsplit as well (from unsplit_batch on)
        assert choose_num_splits(first - 1, kv_heads, 8192, 132, programs_per_sm=small["programs_per_sm"],
                                 unsplit_per_sm=small["unsplit_per_sm"]) == 1
    else:
        assert config(first)["num_warps"] == 4 and config(first - 1)["num_warps"] == 1
        # its large tiles read unsplit from the first large batch on (2 splits were 2-13% slower on an H100)
        large = config(first)
        assert choose_num_splits(first, kv_heads, 8192, 132, programs_per_sm=large["programs_per_sm"],
                                 unsplit_per_sm=large.get("unsplit_per_sm")) == 1


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("batch,ctx", [(256, 1024), (8, 8192)])
def test_full_size_bf16(batch, ctx):
    torch.manual_seed(0)
    lens = torch.randint(1, ctx + 1, (batch,)).tolist()
    lens[0], lens[-1] = ctx, 1
    q, k, v, seqlens, table = _setup(lens, 16, 8, 128, 256, torch.bfloat16, "cuda", width=ctx // 256)
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table)
    _check(out, _ref(q, k, v, seqlens, table), 1e-2)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("batch,ctx", [(256, 1024), (8, 8192)])
def test_full_size_fp8_cache(batch, ctx):
    torch.manual_seed(0)
    lens = torch.randint(1, ctx + 1, (batch,)).tolist()
    q, k, v, seqlens, table = _setup(lens, 16, 8, 128, 256, torch.float8_e4m3fn, "cuda", width=ctx // 256)
    out = flash_attn_with_kvcache(q.bfloat16(), k, v, cache_seqlens=seqlens, block_table=table)
    _check(out, _ref(q.bfloat16(), k, v, seqlens, table), 1e-2)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("batch", [4, 64])
def test_cuda_graph_capture(batch):
    """Captured once, replayed with new lengths and new queries written into the static inputs."""
    torch.manual_seed(0)
    ctx = 4096
    lens = [ctx] * batch
    q, k, v, seqlens, table = _setup(lens, 16, 8, 128, 256, torch.bfloat16, "cuda", width=ctx // 256)
    flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table)     # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table)
    for _ in range(2):
        seqlens.copy_(torch.randint(1, ctx + 1, (batch,), device="cuda", dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, _ref(q, k, v, seqlens, table), 1e-2)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("batch,group", [(256, 2), (64, 4), (24, 8)])
def test_full_size_shared_prefixes_under_graph_capture(batch, group, cache_dtype):
    """Eight prompts of 2,000 tokens, each shared by a batch's eighth (the shared-prefix workload's layout):
    the default tiles at full size, captured once and replayed with other groups (fewer items than the
    capacity: the rest hold no rows), as the engine's shared-prefix graphs are."""
    torch.manual_seed(0)
    lens = [2048 + int(n) for n in torch.randint(1, 300, (batch,))]
    q, k, v, seqlens, table = _setup(lens, 8 * group, 8, 128, 256, cache_dtype, "cuda")
    q = q.bfloat16()
    per = batch // 8
    shared = _share_pages(table, lens, [(list(range(i * per, (i + 1) * per)), 7) for i in range(8)], 256)
    static = (shared[0].clone(), torch.zeros(batch // 2, 3, dtype=torch.int32, device="cuda"), shared[2].clone())
    static[1][:len(shared[1])] = shared[1]
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table, shared_prefix=static)
    _check(out, _ref(q, k, v, seqlens, table), 1e-2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table, shared_prefix=static)
    # the next step: half the groups share 3 pages, the others nothing (each row's own page in their place)
    for i in range(8):
        rows = slice(i * per, (i + 1) * per)
        table[rows, 3 if i % 2 == 0 else 0:7] = table[rows, 7:8]
    regrouped = _share_pages(table, lens, [], 256)
    assert sorted(set(regrouped[0].tolist())) == [0, 3 * 256]
    static[0].copy_(regrouped[0])
    static[1].zero_()
    static[1][:len(regrouped[1])] = regrouped[1]
    static[2][:len(regrouped[2])] = regrouped[2]
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, _ref(q, k, v, seqlens, table), 1e-2)
