"""The decode GEMM (nanovllm.kernels.skinny_gemm) in the model's dtype against a float32 matmul: under Triton's
interpreter on small shapes (CPU), at full size on a GPU; and the linear layers' choice of it."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels import skinny_gemm

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# Triton 3.9's interpreter multiplies bfloat16 dots wrongly (float16 right): the kernel is the same for both
DTYPE = torch.bfloat16 if CUDA else torch.float16


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if bias is None else bias.float())


TABLES = {"lm_head": skinny_gemm.CONFIGS}
BUCKETS = [(name, first) for name, table in TABLES.items() for first, _ in table]


@pytest.mark.parametrize("split", [False, True], ids=["whole-k", "split-k"])
@pytest.mark.parametrize("table, first", BUCKETS)
def test_each_config_matches_a_float32_matmul(table, first, split):
    """The first and last M of each bucket, ragged N and K (masked tails), K whole or split (parts added by
    the last program to arrive), with and without a bias: float32 accumulation, one rounding at the end."""
    configs = TABLES[table]
    config = replace(skinny_gemm.choose_config(first, configs), programs_per_sm=64 if split else 0)
    n, k = 2 * config.block_n + 5, 8 * config.block_k + 76
    assert (skinny_gemm.split_k(1, k, config, torch.device(DEVICE)) > 1) == split
    gen = torch.Generator().manual_seed(first)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(DEVICE, DTYPE)
    bias = torch.randn(n, generator=gen).to(DEVICE, DTYPE)
    last = max(m for m in range(first, config.block_m + 1) if skinny_gemm.choose_config(m, configs) is not None
               and skinny_gemm.choose_config(m, configs).block_m == config.block_m)
    for m in sorted({first, last}):
        x = torch.randn(m, k, generator=gen).to(DEVICE, DTYPE)
        for b in (None, bias):
            out = skinny_gemm.skinny_gemm(x, w, b, out_dtype=torch.float32, config=config)
            torch.testing.assert_close(out, reference(x, w, b), rtol=1e-5, atol=1e-4)
            out = skinny_gemm.skinny_gemm(x, w, b, config=config)         # rounded once, to x's dtype
            assert out.dtype == DTYPE
            torch.testing.assert_close(out.float(), reference(x, w, b), rtol=8e-3, atol=1e-3)
    assert not skinny_gemm._tile_counters(torch.device(DEVICE)).any()       # every tile's counter reset


def test_several_row_tiles_and_a_strided_input():
    """More rows than one tile (each row tile has its own counters), rows of x strided (a view)."""
    config = skinny_gemm.SkinnyConfig(32, 4, 2, programs_per_sm=64, block_m=16, block_k=64)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(70, 520, generator=gen).to(DEVICE, DTYPE)
    wide = torch.randn(37, 600, generator=gen).to(DEVICE, DTYPE)
    x = wide[:, 40:560]
    out = skinny_gemm.skinny_gemm(x, w, out_dtype=torch.float32, config=config)
    torch.testing.assert_close(out, reference(x, w, None), rtol=1e-5, atol=1e-4)
    assert not skinny_gemm._tile_counters(torch.device(DEVICE)).any()


@pytest.mark.parametrize("configs", TABLES.values(), ids=TABLES.keys())
def test_the_buckets_cover_a_decode_batch_then_hand_over(configs):
    assert skinny_gemm.choose_config(0, configs) is None
    largest = configs[-1][1].block_m
    for m in range(1, largest + 1):
        config = skinny_gemm.choose_config(m, configs)
        assert config is not None and m <= config.block_m
    assert skinny_gemm.choose_config(largest + 1, configs) is None
    assert {first for first, _ in configs} <= set(skinny_gemm.config_token_counts())    # warmed up at start


def test_split_k_fills_the_device_and_keeps_parts_long():
    config = skinny_gemm.SkinnyConfig(64, 4, 4, programs_per_sm=2)
    device = torch.device(DEVICE)
    target = 2 * skinny_gemm._multiprocessors(device)
    for tiles, width in ((1, 1 << 16), (16, 2048), (64, 4096), (1024, 4096)):
        split = skinny_gemm.split_k(tiles, width, config, device)
        assert split == 1 or width // split >= 4 * config.block_k            # each part 4 K steps or more
        assert tiles * split >= target or width < 2 * split * 4 * config.block_k
        assert split == 1 or tiles * split // 2 < target                      # no more than needed


# ---- one row: gemv ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", [False, True], ids=["whole-k", "split-k"])
@pytest.mark.parametrize("operands", ["model-dtype", "fp8-weights", "fp8-both"])
def test_gemv_matches_a_float32_matmul(operands, split):
    """One row, ragged N and K (masked tails), K whole or split (the last part to arrive adds them in order),
    with and without a bias: FP8 weights with per-row scales, the row unquantized or quantized with its
    scale, against the same values dequantized and multiplied in float32."""
    from nanovllm.layers.quantization.fp8 import quantize_activations, quantize_weight

    config = replace(skinny_gemm.GEMV_CONFIG, block_k=64, programs_per_sm=64 if split else 0)
    n, k = 3 * config.block_n + 5, 8 * config.block_k + 76
    device = torch.device(DEVICE)
    assert (skinny_gemm.split_k(skinny_gemm.triton.cdiv(n, config.block_n), k, config, device) > 1) == split
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(DEVICE)
    x = torch.randn(1, k, generator=gen).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(DEVICE)
    kwargs, w_ref, x_ref = {}, w, x
    if operands != "model-dtype":
        w, w_scale = quantize_weight(w, "channel")
        kwargs["b_scale"] = w_scale
        w_ref = w.float() * w_scale[:, None]
    if operands == "fp8-both":
        x, x_scale = quantize_activations(x)
        kwargs["a_scale"] = x_scale
        x_ref = x.float() * x_scale[:, None]
    for b in (None, bias):
        out = skinny_gemm.gemv(x, w, b, out_dtype=torch.float32, config=config, **kwargs)
        assert out.shape == (1, n) and out.dtype == torch.float32
        torch.testing.assert_close(out, reference(x_ref, w_ref, b), rtol=1e-5, atol=1e-4)
    assert not skinny_gemm._tile_counters(device).any()       # every tile's counter reset


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n, k", [(1024, 2048), (6144, 4096), (4096, 12288)])
def test_gemv_full_size_on_the_gpu_and_in_a_graph(n, k):
    """Qwen3-8B's qkv and down shapes (K whole, K split), FP8 weights, bf16 and FP8 rows, replayed in a CUDA
    graph with new inputs exactly as eager computes them."""
    from nanovllm.layers.quantization.fp8 import quantize_activations, quantize_weight

    gen = torch.Generator(device="cuda").manual_seed(0)
    w, w_scale = quantize_weight(torch.randn(n, k, generator=gen, device="cuda").bfloat16() * 0.02, "channel")
    x = torch.randn(1, k, generator=gen, device="cuda").bfloat16()
    ref = reference(x, w.float() * w_scale[:, None], None)
    out = skinny_gemm.gemv(x, w, b_scale=w_scale, out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    q, q_scale = quantize_activations(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = skinny_gemm.gemv(q, w, a_scale=q_scale, b_scale=w_scale, out_dtype=torch.bfloat16)
    for seed in (1, 2):
        x.copy_(torch.randn(1, k, generator=gen, device="cuda").bfloat16())
        new_q, new_scale = quantize_activations(x)
        q.copy_(new_q), q_scale.copy_(new_scale)
        graph.replay()
        assert torch.equal(static_out, skinny_gemm.gemv(q, w, a_scale=q_scale, b_scale=w_scale,
                                                         out_dtype=torch.bfloat16))
        torch.testing.assert_close(static_out.float(), reference(q.float() * q_scale[:, None],
                                                                 w.float() * w_scale[:, None], None),
                                   rtol=8e-3, atol=1e-3)
    assert not skinny_gemm._tile_counters(torch.device("cuda")).any()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("n, k", [(1024, 2048), (6144, 4096)])
def test_full_size_on_the_gpu(m, n, k):
    """Qwen3-0.6B's o and Qwen3-8B's qkv projection shapes, in a CUDA graph (the counters must be reset for
    every replay), against cuBLAS in float32."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, generator=gen, device="cuda").bfloat16() * 0.02
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    ref = reference(x, w, None)
    out = skinny_gemm.skinny_gemm(x, w, out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_gemm.skinny_gemm(x, w, out_dtype=torch.float32)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)

