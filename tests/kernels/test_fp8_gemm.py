"""The FP8 GEMM kernels against the torch path (nanovllm.layers.quantization.fp8): under Triton's interpreter on
small shapes (CPU), and at full size, through cuBLASLt's _scaled_mm and CUDA graphs on the GPU."""
from dataclasses import replace

import pytest
import torch

from nanovllm.kernels import fp8_gemm, skinny_gemm
from nanovllm.layers.quantization.fp8 import (dequantize_weight, fp8_linear_torch, quantize_activations,
                                              quantize_weight)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"      # the small-shape tests: the interpreter on CPU, compiled on a GPU
cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def activations(m, k, dtype=torch.float32, device=DEVICE, seed=0, zero_row=True):
    """Rows of very different sizes, an all-zero first row (when there are others) and a few outliers."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device) * torch.logspace(-3, 1, m, device=device)[:, None]
    if zero_row and m > 1:
        x[0] = 0.0
    x[-1, :: max(1, k // 7)] *= 50.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("shape", [(1, 64), (6, 300), (3, 5000)])   # one group, ragged, more than one sweep
def test_activation_quantization_is_the_torch_paths_bit_for_bit(shape, group, dtype):
    x = activations(*shape, dtype=dtype)
    x[-1, 1:4] = torch.tensor([-1e-9, 1e-9, -3e-5], device=DEVICE) * x[-1].abs().max()    # rounded to -0, 0 and -0
    q, scale = fp8_gemm.quantize_activations(x, group)
    q_ref, scale_ref = quantize_activations(x, group)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.equal(scale, scale_ref) and torch.equal(bits(q), bits(q_ref))


@pytest.mark.parametrize("block_scaled", [False, True], ids=["channel", "block"])
@pytest.mark.parametrize("first", [first for first, _ in fp8_gemm.CONFIGS])
def test_each_tile_config_matches_the_torch_path(first, block_scaled):
    """Every tile config, on ragged M, N and K (wrapped rows and columns, masked K tail)."""
    config = fp8_gemm.choose_config(first)
    scheme = "block" if block_scaled else "channel"
    m, n, k = config.block_m + 3, 2 * config.block_n + 5, 300
    x = activations(m, k, seed=first)
    q_w, s_w = quantize_weight(torch.randn(n, k, device=DEVICE) * 0.05, scheme)
    q_x, s_x = fp8_gemm.quantize_activations(x, 128 if block_scaled else None)
    out = fp8_gemm.fp8_gemm(q_x, s_x, q_w, s_w, torch.float32, block_scaled, config=config)
    assert_matches_the_torch_path(out, x, q_w, s_w, scheme, config.block_m)


def assert_matches_the_torch_path(out, x, q_w, s_w, scheme, block_m):
    """A kernel's output (float32, or the model's dtype: its rounding allowed too) against fp8_linear_torch
    (float32 sums in another order: rounding apart). Tiles of 64 rows or more run on Hopper's FP8 wgmma, which
    keeps about 14 bits of its running sum (DeepSeek-V3, section 3.3.2) within each 128-product step: bounded
    against the sum of the products' magnitudes there."""
    ref = fp8_linear_torch(x.float(), q_w, s_w, scheme)
    rounding = 8e-3 if out.dtype == torch.bfloat16 else 1e-4      # bf16 keeps 8 bits
    if DEVICE == "cuda" and block_m >= 64:
        magnitude = reference(x.float(), q_w, s_w, scheme, absolute=True)
        excess = ((out.float() - ref).abs() - rounding * ref.abs()).clamp(min=0)
        ratio = (excess / (magnitude + 1e-6)).max().item()
        print(f"{block_m}-row tiles, {scheme}: |out - ref| <= {ratio:.2e} x the products' magnitude")
        assert ratio <= 2 ** -11
    else:
        torch.testing.assert_close(out.float(), ref, rtol=rounding, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("split", [False, True], ids=["whole-k", "split-k"])
@pytest.mark.parametrize("block_scaled", [False, True], ids=["channel", "block"])
@pytest.mark.parametrize("first", [first for first, _ in fp8_gemm.SKINNY_CONFIGS])
def test_each_decode_config_matches_the_torch_path(first, block_scaled, split):
    """The decode GEMM on the first and last M of its bucket, ragged N and K (a masked tail, a partial last
    group), K whole or split (parts added by the last program to arrive), against the torch path; through
    fp8_linear in the model's dtype too."""
    config = fp8_gemm.choose_skinny_config(first)
    config = replace(config, programs_per_sm=64 if split else 0)
    scheme = "block" if block_scaled else "channel"
    n, k = 2 * config.block_n + 5, 8 * config.block_k + 76
    assert (skinny_gemm.split_k(3, k, config, torch.device(DEVICE)) > 1) == split
    q_w, s_w = quantize_weight(torch.randn(n, k, device=DEVICE) * 0.05, scheme)
    last = max(m for m in range(first, config.block_m + 1) if fp8_gemm.choose_skinny_config(m) == config
               or fp8_gemm.choose_skinny_config(m) == fp8_gemm.choose_skinny_config(first))
    for m in sorted({first, last}):
        x = activations(m, k, seed=m)
        q_x, s_x = fp8_gemm.quantize_activations(x, 128 if block_scaled else None)
        out = fp8_gemm.fp8_skinny_gemm(q_x, s_x, q_w, s_w, torch.float32, block_scaled, config)
        assert_matches_the_torch_path(out, x, q_w, s_w, scheme, config.block_m)
        x = x.bfloat16()                                       # the model's dtype, through the config chosen for M
        out = fp8_gemm.fp8_linear(x, q_w, s_w, block_scaled)
        if m == 1 and not block_scaled:     # one row: the GEMV reads it unquantized
            ref = x.float() @ dequantize_weight(q_w, s_w, scheme).t()
            torch.testing.assert_close(out.float(), ref, rtol=8e-3, atol=1e-5 * ref.abs().max().item())
        else:
            assert_matches_the_torch_path(out, x, q_w, s_w, scheme, config.block_m)
    assert not skinny_gemm._tile_counters(torch.device(DEVICE)).any()       # every tile's counter reset


@pytest.mark.parametrize("block_scaled", [False, True], ids=["channel", "block"])
def test_one_row_with_channel_scales_takes_the_gemv(block_scaled, monkeypatch):
    """A lone row with per-channel weights goes to skinny_gemm.gemv: fp8_linear hands it over unquantized
    (no quantization pass), fp8_matmul quantized with its scale; block weights stay on the dot kernel."""
    scheme = "block" if block_scaled else "channel"
    q_w, s_w = quantize_weight(torch.randn(200, 384, device=DEVICE) * 0.05, scheme)
    x = activations(1, 384, seed=3)
    calls = []
    real_gemv = skinny_gemm.gemv
    monkeypatch.setattr(skinny_gemm, "gemv", lambda *args, **kwargs: calls.append(kwargs) or real_gemv(*args, **kwargs))
    out = fp8_gemm.fp8_linear(x, q_w, s_w, block_scaled)
    q_x, s_x = fp8_gemm.quantize_activations(x, 128 if block_scaled else None)
    quantized = fp8_gemm.fp8_matmul(q_x, s_x, q_w, s_w, block_scaled, torch.float32)
    counts = fp8_gemm.config_token_counts()          # the warm-up reaches the GEMV and the skinny kernel too
    assert 1 in counts and any(fp8_gemm.choose_skinny_config(m) and not fp8_gemm.reads_unquantized(m, block_scaled)
                               for m in counts)
    if block_scaled:
        assert not calls
        return
    assert [sorted(kwargs) for kwargs in calls] == [["b_scale"], ["a_scale", "b_scale", "out_dtype"]]
    w = dequantize_weight(q_w, s_w, scheme)
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(quantized, fp8_linear_torch(x, q_w, s_w, scheme), rtol=1e-5, atol=1e-5)


def test_the_skinny_buckets_cover_a_decode_batch_then_hand_over():
    assert fp8_gemm.choose_skinny_config(0) is None
    largest = fp8_gemm.SKINNY_CONFIGS[-1][1].block_m
    for m in range(1, largest + 1):
        config = fp8_gemm.choose_skinny_config(m)
        assert config is not None and m <= config.block_m
    assert fp8_gemm.choose_skinny_config(largest + 1) is None
    assert set(first for first, _ in fp8_gemm.SKINNY_CONFIGS) <= set(fp8_gemm.config_token_counts())


def test_fp8_linear_keeps_leading_dims_and_the_input_dtype():
    x = activations(6, 256).view(2, 3, 256)
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE) * 0.05
    q_w, s_w = quantize_weight(weight, "channel")
    out = fp8_gemm.fp8_linear(x, q_w, s_w, block_scaled=False)
    assert out.shape == (2, 3, 96) and out.dtype == torch.float32
    # float32 sums of 256 products in another order: ~1 in 30 weight draws differs by 1.2e-5 relative
    torch.testing.assert_close(out, fp8_linear_torch(x, q_w, s_w, "channel"), rtol=5e-5, atol=1e-5)
    assert fp8_gemm.fp8_linear(torch.empty(0, 256, device=DEVICE), q_w, s_w, False).shape == (0, 96)
    assert not fp8_gemm.scaled_mm_applies(64, 96, 256, torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize("reader, last", [("norm", 512), ("silu", 192)])
def test_a_gemm_defers_its_scales_from_17_rows_to_its_readers_limit_on_hopper(reader, last, monkeypatch):
    """Where cuBLASLt's unscaled GEMM is the faster, its reader's extra loads included (decode batches of 17-512
    rows into a residual norm, 17-192 into SiLU-and-mul) and only there: a single stream and small batches keep
    the skinny tiles, prefill chunks the row-wise GEMM with its own scales."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(fp8_gemm, "_has_rowwise_scaled_mm", lambda device: device.type == "cuda")
    defers = [m for m in range(1, 1025)
              if fp8_gemm.defers_output_scales(m, 4096, 4096, torch.bfloat16, cuda, reader)]
    assert defers == list(range(17, last + 1))
    assert fp8_gemm.UNSCALED_MIN_TOKENS == 17 and fp8_gemm.UNSCALED_MAX_TOKENS[reader] == last
    assert not fp8_gemm.defers_output_scales(64, 4096, 4096, torch.float16, cuda)     # _scaled_mm: bf16 out here
    assert not fp8_gemm.defers_output_scales(64, 4096, 4104, torch.bfloat16, cuda)    # K not 16-aligned
    assert not fp8_gemm.defers_output_scales(64, 4104, 4096, torch.bfloat16, cuda)    # N not 16-aligned
    assert not fp8_gemm.defers_output_scales(64, 4096, 4096, torch.bfloat16, cpu)


def test_the_warm_up_buckets_are_the_configs_first_counts():
    counts = fp8_gemm.config_token_counts()
    assert counts[0] == 1 and list(counts) == sorted(counts)
    for i, first in enumerate(counts):
        last = counts[i + 1] - 1 if i + 1 < len(counts) else 1 << 20
        assert fp8_gemm.choose_config(first) == fp8_gemm.choose_config(last)
        assert 128 % fp8_gemm.choose_config(first).block_k == 0


# ---- GPU, full size ---------------------------------------------------------------------------------------------
SHAPES_8B = {"qkv": (6144, 4096), "down": (4096, 12288)}     # Qwen3-8B's (N, K)


def reference(x, q_w, s_w, scheme, absolute=False):
    """float32 product of the same quantized values (the torch path's quantization, dequantized); absolute:
    of their magnitudes (what a sum's rounding scales with)."""
    q_x, s_x = quantize_activations(x, 128 if scheme == "block" else None)
    a = q_x.float() * (s_x.repeat_interleave(128, 1)[:, :x.shape[1]] if scheme == "block" else s_x[:, None])
    w = dequantize_weight(q_w, s_w, scheme)
    return a.abs() @ w.abs().t() if absolute else a @ w.t()


@cuda
def test_gpu_activation_quantization_is_bit_exact():
    x = activations(4096, 4096, torch.bfloat16, "cuda")
    for group in (None, 128):
        q, scale = fp8_gemm.quantize_activations(x, group)
        q_ref, scale_ref = quantize_activations(x, group)
        assert torch.equal(scale, scale_ref) and torch.equal(bits(q), bits(q_ref))


@cuda
@pytest.mark.parametrize("path", ["triton-channel", "scaled-mm", "triton-block"])
@pytest.mark.parametrize("layer", SHAPES_8B)
def test_gpu_gemms_against_a_float32_reference(path, layer):
    if path == "scaled-mm" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("row-wise _scaled_mm needs compute capability 9.0")
    torch.backends.cuda.matmul.allow_tf32 = False
    scheme = "block" if path == "triton-block" else "channel"
    n, k = SHAPES_8B[layer]
    g = torch.Generator("cuda").manual_seed(0)
    q_w, s_w = quantize_weight((torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16(), scheme)
    for m in (1, 16, 256, 4096):
        x = activations(m, k, torch.bfloat16, "cuda", seed=m, zero_row=False)   # (no 0/0 in the ratios)
        use_scaled_mm = None if scheme == "block" else path == "scaled-mm"
        out = fp8_gemm.fp8_linear(x, q_w, s_w, block_scaled=scheme == "block", use_scaled_mm=use_scaled_mm)
        ref = reference(x, q_w, s_w, scheme)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        err = (out.float() - ref).norm() / ref.norm()
        if path == "scaled-mm" and fp8_gemm.SCALED_MM_FAST_ACCUM:
            # the tensor cores' own ~14-bit running sum over all of K (no promotion every 128 products): an output
            # near zero is off by a small part of its products' magnitude, not of itself. Beyond bf16's rounding
            # of the output, within 2^-10 of that magnitude (the promoted kernels: 2^-11; measured on an H100:
            # 2.2e-4 to 6.5e-4), and the whole product within 5e-3 (measured 2.2e-3 to 3.3e-3)
            magnitude = reference(x, q_w, s_w, scheme, absolute=True)
            excess = ((out.float() - ref).abs() - 2 ** -8 * ref.abs()).clamp(min=0)
            worst, bound, max_err = (excess / magnitude).max(), 2 ** -10, 5e-3
        else:   # bf16 output rounding alone is up to 2^-9 = 2e-3 per element
            worst = ((out.float() - ref).abs() / (ref.abs() + 1e-2 * ref.abs().amax(1, keepdim=True))).max()
            bound, max_err = 3e-2, 4e-3
        print(f"{path} {layer} M={m}: relative error {err:.2e}, worst element {worst:.2e} (bound {bound:.1e})")
        assert err < max_err and worst < bound


@cuda
@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_gpu_graph_replay_equals_eager_and_m_is_not_specialized(scheme):
    """Within a bucket no M compiles anything new (M is not specialized on), and a captured graph replays
    new inputs exactly as the eager call computes them."""
    import triton
    n, k = 1024, 2048
    q_w, s_w = quantize_weight(torch.randn(n, k, device="cuda").bfloat16() * 0.02, scheme)
    block_scaled = scheme == "block"
    for first in fp8_gemm.config_token_counts():
        fp8_gemm.fp8_linear(activations(first, k, torch.bfloat16, "cuda"), q_w, s_w, block_scaled)
    compiled = []
    triton.knobs.runtime.jit_cache_hook = lambda *, fn, key, **_: compiled.append(fn.name) and False
    try:
        for m in (2, 3, 7, 15, 33, 100, 300, 1000):
            fp8_gemm.fp8_linear(activations(m, k, torch.bfloat16, "cuda"), q_w, s_w, block_scaled)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert not compiled, compiled
    static_x = activations(8, k, torch.bfloat16, "cuda")
    fp8_gemm.fp8_linear(static_x, q_w, s_w, block_scaled)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fp8_gemm.fp8_linear(static_x, q_w, s_w, block_scaled)
    for seed in (1, 2):
        static_x.copy_(activations(8, k, torch.bfloat16, "cuda", seed=seed))
        graph.replay()
        assert torch.equal(static_out, fp8_gemm.fp8_linear(static_x, q_w, s_w, block_scaled))
