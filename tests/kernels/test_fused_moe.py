"""Triton MoE kernels (nanovllm.kernels.fused_moe) against the torch oracle in nanovllm.layers.fused_moe.

On CPU through Triton's interpreter at tiny shapes (tiles of 16 so that a few pairs span several row blocks
and column tiles); on a GPU at Qwen3-30B-A3B's and Mixtral-8x7B's shapes, under CUDA graphs, and with no
compilation past the warm-up's token counts. float32 agrees to rounding of the sums' order; bfloat16 to a
few units in the last place (the oracle rounds at the same points: gate, up, silu, product, expert output,
weighted output, and the k-sum once). FP8 experts (per-row and 128x128-block scales) against the oracle's
FP8 arithmetic (nanovllm.layers.quantization.fp8's torch path, expert by expert) the same way."""
import pytest
import torch

from compilations import assert_none_compiled, recorded_compilations
from nanovllm.kernels import fused_moe as kernels
from nanovllm.kernels.fused_moe import MoeConfig, Tile, choose_config, config_token_counts, group_pairs
from nanovllm.kernels.moe_routing import route
from nanovllm.layers import fused_moe as oracle
from nanovllm.layers.quantization.fp8 import fp8_linear_torch, quantize_experts

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SMALL = MoeConfig(16, Tile(16, 16, 4, 2), Tile(16, 16, 4, 2))        # tiny tiles: many blocks and tiles
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _weights(num_experts, hidden, inter, dtype, device=DEVICE, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device, generator=g) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, device=device, generator=g) * inter ** -0.5
    return w13.to(dtype), w2.to(dtype)


def _inputs(num_tokens, hidden, num_experts, top_k, dtype, device=DEVICE, seed=1):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device=device, generator=g).to(dtype)
    logits = torch.randn(num_tokens, num_experts, device=device, generator=g)
    weights, ids = oracle.route(logits, top_k, True)
    return x, weights, ids


def _check(out, ref, ulps, max_normwise=1.0):
    """|out - ref| within `ulps` units in the last place of |ref| plus of the output's mean magnitude (the
    k-sum cancels: an element near zero carries its terms' rounding). On CPU, bf16 results are mostly the
    oracle's bits: a rounding left out or added would change about half of them by an ulp or two."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    ulp = 2.0 ** -23 if ref.dtype == torch.float32 else 2.0 ** -7
    if ref.dtype == torch.bfloat16 and not CUDA:
        assert (out != ref).float().mean() <= 0.02
    out, ref = out.float(), ref.float()
    bound = ulps * ulp * (ref.abs() + ref.abs().mean())
    worst = ((out - ref).abs() / bound).max().item()
    normwise = ((out - ref).norm() / ref.norm()).item()
    print(f"worst {worst * ulps:.2f} ulps (bound {ulps}), normwise {normwise:.2e}")
    assert worst <= 1, f"off by {worst:.2f} x the bound ({ulps} ulps)"
    assert normwise <= max_normwise, f"normwise {normwise:.2e} > {max_normwise:.1e}"


def _fp8_experts(w13, w2, scheme):
    """The experts quantized as online FP8 quantization does: (w13, w2, w13_scale, w2_scale); block scales
    of gate and up separately ([E, 2 x row blocks, column blocks])."""
    inter = w13.shape[1] // 2
    (gate, gate_scale), (up, up_scale), (down, down_scale) = (
        quantize_experts(w, scheme) for w in (w13[:, :inter], w13[:, inter:], w2))
    return torch.cat([gate, up], 1), down, torch.cat([gate_scale, up_scale], 1), down_scale


def scaled_linear(w13_scale):
    """The oracle's FP8 projection for experts with these scales (per row [E, 2I], per block [E, ., .])."""
    if w13_scale is None:
        return None
    scheme = "block" if w13_scale.dim() == 3 else "channel"
    return lambda x, weight, scale: fp8_linear_torch(x, weight, scale, scheme)


def _moe_vs_oracle(x, w13, w2, weights, ids, config=None, ulps=None, w13_scale=None, w2_scale=None):
    out = kernels.fused_moe(x, w13, w2, weights, ids, config, w13_scale=w13_scale, w2_scale=w2_scale)
    return _check_against_oracle(out, x, w13, w2, weights, ids, ulps, w13_scale, w2_scale)


def _check_against_oracle(out, x, w13, w2, weights, ids, ulps=None, w13_scale=None, w2_scale=None):
    if x.is_cuda:           # cuBLAS may otherwise sum split-K partials in bf16
        matmul = torch.backends.cuda.matmul
        reduced, matmul.allow_bf16_reduced_precision_reduction = matmul.allow_bf16_reduced_precision_reduction, False
    try:
        ref = oracle.fused_moe(x, w13, w2, weights, ids.long(), w13_scale, w2_scale, scaled_linear(w13_scale))
    finally:
        if x.is_cuda:
            matmul.allow_bf16_reduced_precision_reduction = reduced
    _check(out, ref, ulps or (64 if x.dtype == torch.float32 else 2),
           FP8_GPU_NORMWISE if x.is_cuda and w13_scale is not None else 1.0)
    return out


# ---- grouping -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("splits", [0, 1, 3])    # 0: the placing programs count
def test_group_pairs_layout(splits):
    """Each expert's pairs in pair order from its group's start, padded with -1 to a multiple of BLOCK_M;
    blocks tagged with their expert, -1 past the last group; with 3000 pairs, scans of several chunks."""
    num_experts, block_m = 10, 16
    g = torch.Generator(DEVICE).manual_seed(0)
    ids = torch.randint(0, 7, (3000,), device=DEVICE, generator=g).to(torch.int32)     # experts 7..9 empty
    ids[ids == 4] = 5                                                                  # expert 4 empty, 5 heavy
    config = MoeConfig(block_m, SMALL.gate_up, SMALL.down, splits=splits)
    sorted_pairs, block_expert = group_pairs(ids, num_experts, config)
    sorted_pairs, block_expert, ids = sorted_pairs.cpu(), block_expert.cpu(), ids.cpu()
    start = 0
    for e in range(num_experts):
        mine = (ids == e).nonzero().squeeze(1).to(torch.int32)
        size = -(-len(mine) // block_m) * block_m
        assert torch.equal(sorted_pairs[start:start + len(mine)], mine)
        assert (sorted_pairs[start + len(mine):start + size] == -1).all()
        assert (block_expert[start // block_m:(start + size) // block_m] == e).all()
        start += size
    assert (block_expert[start // block_m:] == -1).all()
    assert len(block_expert) * block_m >= start


# ---- the experts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter", [
    (1, 4, 2, 32, 16),
    (5, 8, 2, 64, 48),
    (33, 16, 4, 48, 40),         # ragged: neither H nor I a multiple of 16; 132 pairs over ~16 blocks
])
def test_fused_moe_matches_oracle(dtype, num_tokens, num_experts, top_k, hidden, inter):
    w13, w2 = _weights(num_experts, hidden, inter, dtype)
    x, weights, ids = _inputs(num_tokens, hidden, num_experts, top_k, dtype)
    _moe_vs_oracle(x, w13, w2, weights, ids, SMALL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_default_config(dtype):
    """The tiles chosen for T (BLOCK_K 128 > H: one masked step), int64 ids as the torch route gives them."""
    w13, w2 = _weights(8, 40, 24, dtype)
    x, weights, ids = _inputs(5, 40, 8, 2, dtype)
    out = _moe_vs_oracle(x, w13, w2, weights, ids)
    assert torch.equal(kernels.fused_moe(x, w13, w2, weights, ids.int()), out)       # and again: the same bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_uneven_loads(dtype):
    """Every token on expert 2 (33 pairs: three blocks), or on 2 and 5; most experts empty; a token whose
    two slots name the same expert; top-1 (no k-sum)."""
    torch.manual_seed(0)
    num_tokens, hidden, inter, num_experts = 33, 32, 32, 8
    w13, w2 = _weights(num_experts, hidden, inter, dtype)
    x, weights, _ = _inputs(num_tokens, hidden, num_experts, 2, dtype)
    one = torch.full((num_tokens, 1), 2, device=DEVICE)
    _moe_vs_oracle(x, w13, w2, weights[:, :1], one, SMALL)
    two = torch.tensor([2, 5], device=DEVICE).repeat(num_tokens, 1)
    two[7] = 5
    _moe_vs_oracle(x, w13, w2, weights, two, SMALL)
    skewed = torch.randint(0, 3, (num_tokens, 2), device=DEVICE) * 3           # experts 0, 3, 6 only
    _moe_vs_oracle(x, w13, w2, weights, skewed, SMALL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_fp8_experts_match_the_oracle(dtype, scheme):
    """e4m3 experts: I = 192 (gate's last scale block half full, up's blocks starting after it), H = 256
    (two K steps of 128), 7 tokens on top-2 of 4; the default tiles and 32-column ones."""
    w13, w2 = _weights(4, 256, 192, dtype)
    q13, q2, s13, s2 = _fp8_experts(w13, w2, scheme)
    assert q13.dtype == torch.float8_e4m3fn and s13.shape == ((4, 4, 2) if scheme == "block" else (4, 384))
    x, weights, ids = _inputs(7, 256, 4, 2, dtype)
    for config in (None, MoeConfig(16, Tile(32, 128, 4, 2), Tile(32, 128, 4, 2))):
        out = _moe_vs_oracle(x, q13, q2, weights, ids, config, w13_scale=s13, w2_scale=s2)
    # and the quantization shows: not the unquantized experts' output
    assert not torch.allclose(out.float(), oracle.fused_moe(x, w13, w2, weights, ids).float(), atol=1e-3)


@pytest.mark.parametrize("experts", ["bfloat16", "float32", "fp8-channel", "fp8-block"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_down_in_token_chunks_gives_the_same_bits(monkeypatch, experts, top_k):
    """A long prefill's down projection and k-sum run DOWN_CHUNK_TOKENS tokens at a time (their pairs grouped
    again): 17 tokens in chunks of 8 (and a ragged last one) give bitwise the one-launch result."""
    dtype = torch.float32 if experts == "float32" else torch.bfloat16
    hidden, inter = (256, 192) if experts.startswith("fp8") else (48, 40)
    w13, w2 = _weights(8, hidden, inter, dtype)
    scales = {}
    if experts.startswith("fp8"):
        w13, w2, s13, s2 = _fp8_experts(w13, w2, experts.removeprefix("fp8-"))
        scales = dict(w13_scale=s13, w2_scale=s2)
    x, weights, ids = _inputs(17, hidden, 8, top_k, dtype)
    config = SMALL if not scales else MoeConfig(16, Tile(32, 128, 4, 2), Tile(32, 128, 4, 2))
    whole = kernels.fused_moe(x, w13, w2, weights, ids, config, **scales)
    monkeypatch.setattr(kernels, "DOWN_CHUNK_TOKENS", 8)
    chunked = kernels.fused_moe(x, w13, w2, weights, ids, config, **scales)
    assert torch.equal(chunked, whole)
    _check_against_oracle(chunked, x, w13, w2, weights, ids, **scales)      # and right, chunked
    monkeypatch.setattr(kernels, "DOWN_CHUNK_TOKENS", 17)
    assert torch.equal(kernels.fused_moe(x, w13, w2, weights, ids, config, **scales), whole)


def test_fused_moe_no_tokens():
    w13, w2 = _weights(4, 32, 16, torch.float32)
    out = kernels.fused_moe(torch.empty(0, 32, device=DEVICE), w13, w2, torch.empty(0, 2, device=DEVICE),
                            torch.empty(0, 2, dtype=torch.int32, device=DEVICE))
    assert out.shape == (0, 32)


@pytest.mark.parametrize("top_k, num_experts", [(8, 128), (2, 8), (1, 60), (4, 64)])
def test_configs_by_rows_per_expert(top_k, num_experts):
    """config_token_counts names one T per distinct config, every T picks one of those, and the tile grows
    with the rows an expert sees on average (T*k/E), not with T."""
    counts = config_token_counts(top_k, num_experts)
    configs = [choose_config(t, torch.bfloat16, top_k, num_experts) for t in counts]
    assert counts == tuple(sorted(set(counts))) and counts[0] == 1
    assert {choose_config(t, torch.bfloat16, top_k, num_experts) for t in range(1, 20000, 7)} == set(configs)
    block_m = [choose_config(t, torch.bfloat16, top_k, num_experts).block_m for t in range(1, 20000, 7)]
    assert block_m == sorted(block_m)
    assert choose_config(256, torch.bfloat16, 8, 128).block_m < choose_config(256, torch.bfloat16, 2, 8).block_m
    # FP8 experts switch tiles at the same token counts (the warm-up compiles theirs too), K steps of 128
    fp8 = [choose_config(t, torch.bfloat16, top_k, num_experts, fp8=True) for t in range(1, 20000, 7)]
    warmed = {choose_config(t, torch.bfloat16, top_k, num_experts, fp8=True) for t in counts}
    assert set(fp8) == warmed and len(warmed) == len(counts)
    assert all(c.gate_up.block_k == c.down.block_k == 128 for c in fp8)
    assert [c.block_m for c in fp8] == sorted(c.block_m for c in fp8)


# ---- on a GPU -------------------------------------------------------------------------------------------
QWEN = dict(num_experts=128, top_k=8, hidden=2048, inter=768)
MIXTRAL = dict(num_experts=8, top_k=2, hidden=4096, inter=14336)


@pytest.fixture(scope="module")
def qwen_weights():
    if not CUDA:
        pytest.skip("needs CUDA")
    return _weights(QWEN["num_experts"], QWEN["hidden"], QWEN["inter"], torch.bfloat16)


@pytest.fixture(scope="module")
def qwen_experts(qwen_weights):
    """The experts in bf16 ("none", no scales) and quantized to FP8 per row and per 128x128 block."""
    return {"none": (*qwen_weights, None, None),
            **{scheme: _fp8_experts(*qwen_weights, scheme) for scheme in ("channel", "block")}}


# Hopper's FP8 wgmma (the 64- and 128-row tiles) keeps ~14 significant bits over a K step's 128 products
# (the oracle: float32): relative to a random sum's size that is ~2^-13 sqrt(K) (5.5e-3 at K = 2048). Measured
# on an H100: normwise 5.7e-3 at 4,096 tokens (Qwen3-30B-A3B) and 300 (Mixtral), 3e-4 or less on the 16- and
# 32-row tiles; worst element 13.9 ulps. A misapplied scale or block is off by tens of percent.
FP8_GPU_ULPS, FP8_GPU_NORMWISE = 32, 1.5e-2


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 4096])
def test_gpu_qwen_shape(qwen_weights, num_tokens):
    w13, w2 = qwen_weights
    x = torch.randn(num_tokens, QWEN["hidden"], device="cuda").bfloat16()
    logits = torch.randn(num_tokens, QWEN["num_experts"], device="cuda")
    weights, ids = route(logits, QWEN["top_k"], True)
    ref_weights, ref_ids = oracle.route(logits, QWEN["top_k"], True)
    # the exponentials differ in the last bit: two experts within that of each other may swap places
    assert (ids.long() == ref_ids).float().mean() > 0.999
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(probs.gather(1, ids.long()), probs.gather(1, ref_ids), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-7)
    out = _moe_vs_oracle(x, w13, w2, weights, ids, ulps=4)
    assert torch.equal(kernels.fused_moe(x, w13, w2, weights, ids), out)         # bitwise, call to call


@needs_cuda
@pytest.mark.parametrize("scheme", ["none", "channel"])
def test_gpu_long_prefill_in_down_chunks(monkeypatch, qwen_experts, scheme):
    """12,345 tokens at Qwen3-30B-A3B's shape: down and the k-sum in two chunks (8,192 + a ragged 4,153),
    bitwise the one-launch result, and the largest buffer half as large."""
    w13, w2, s13, s2 = qwen_experts[scheme]
    x, weights, ids = _inputs(12345, QWEN["hidden"], QWEN["num_experts"], QWEN["top_k"], torch.bfloat16)
    ids = ids.int()

    def run():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = kernels.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base

    chunked, chunked_peak = run()
    monkeypatch.setattr(kernels, "DOWN_CHUNK_TOKENS", 1 << 30)
    whole, whole_peak = run()
    assert torch.equal(chunked, whole)
    pair_outputs = 12345 * QWEN["top_k"] * QWEN["hidden"] * 2
    assert whole_peak - chunked_peak >= pair_outputs * (1 - 8192 / 12345) * 0.9


@needs_cuda
def test_gpu_qwen_one_expert(qwen_weights):
    """256 tokens on one expert (16+ row blocks of one group), and all 8 slots on it (127 experts empty)."""
    w13, w2 = qwen_weights
    x, weights, _ = _inputs(256, QWEN["hidden"], QWEN["num_experts"], QWEN["top_k"], torch.bfloat16)
    _moe_vs_oracle(x, w13, w2, weights[:, :1], torch.full((256, 1), 77, device="cuda"), ulps=4)
    _moe_vs_oracle(x, w13, w2, weights, torch.full((256, 8), 5, device="cuda"), ulps=4)


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 3, 16])
def test_gpu_mixtral_shape(num_tokens):
    w13, w2 = _weights(MIXTRAL["num_experts"], MIXTRAL["hidden"], MIXTRAL["inter"], torch.bfloat16)
    x, weights, ids = _inputs(num_tokens, MIXTRAL["hidden"], MIXTRAL["num_experts"], MIXTRAL["top_k"],
                              torch.bfloat16)
    _moe_vs_oracle(x, w13, w2, weights, ids, ulps=4)


@needs_cuda
def test_gpu_float32(qwen_weights):
    w13, w2 = (w.float() for w in qwen_weights)
    x, weights, ids = _inputs(40, QWEN["hidden"], QWEN["num_experts"], QWEN["top_k"], torch.float32)
    _moe_vs_oracle(x, w13, w2, weights, ids, ulps=256)


@needs_cuda
@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 4096])
def test_gpu_fp8_qwen_shape(qwen_experts, scheme, num_tokens):
    w13, w2, s13, s2 = qwen_experts[scheme]
    x, weights, ids = _inputs(num_tokens, QWEN["hidden"], QWEN["num_experts"], QWEN["top_k"], torch.bfloat16)
    out = _moe_vs_oracle(x, w13, w2, weights, ids, ulps=FP8_GPU_ULPS, w13_scale=s13, w2_scale=s2)
    assert torch.equal(kernels.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2), out)


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_gpu_fp8_mixtral_shape(num_tokens):
    w13, w2, s13, s2 = _fp8_experts(*_weights(MIXTRAL["num_experts"], MIXTRAL["hidden"], MIXTRAL["inter"],
                                              torch.bfloat16), "block")
    x, weights, ids = _inputs(num_tokens, MIXTRAL["hidden"], MIXTRAL["num_experts"], MIXTRAL["top_k"],
                              torch.bfloat16)
    _moe_vs_oracle(x, w13, w2, weights, ids, ulps=FP8_GPU_ULPS, w13_scale=s13, w2_scale=s2)


@needs_cuda
@pytest.mark.parametrize("scheme", ["none", "channel", "block"])
def test_gpu_cuda_graph_replay(qwen_experts, scheme):
    """Captured once, replayed on new logits and hidden states: the same bits as eager."""
    w13, w2, s13, s2 = qwen_experts[scheme]
    x = torch.randn(64, QWEN["hidden"], device="cuda").bfloat16()
    logits = torch.randn(64, QWEN["num_experts"], device="cuda")

    def step():
        weights, ids = route(logits, QWEN["top_k"], True)
        return kernels.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)
    step()                                                                      # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        assert torch.equal(out, step())


@needs_cuda
@pytest.mark.parametrize("scheme", ["none", "channel", "block"])
def test_gpu_no_compilation_past_warm_up(qwen_experts, scheme):
    """After one call at each of config_token_counts(), no token count compiles another kernel variant."""
    w13, w2, s13, s2 = qwen_experts[scheme]

    def step(num_tokens):
        x = torch.randn(num_tokens, QWEN["hidden"], device="cuda").bfloat16()
        weights, ids = route(torch.randn(num_tokens, QWEN["num_experts"], device="cuda"), 8, True)
        kernels.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)
    for t in config_token_counts(8, QWEN["num_experts"]):
        step(t)
    with recorded_compilations() as compiled:
        for t in (1, 2, 3, 16, 17, 32, 63, 64, 65, 100, 128, 512, 1000, 1024, 1500, 4096, 5000):
            step(t)
    assert_none_compiled(compiled)
