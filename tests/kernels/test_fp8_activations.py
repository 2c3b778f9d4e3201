"""RMSNorm and SiLU-and-mul that write FP8 activations (nanovllm.kernels.fp8_activations) give, bit for bit,
the values and scales of the unfused kernels they replace: pointwise's kernel, then fp8_gemm's quantization
(under Triton's interpreter on CPU, compiled on a GPU)."""
import pytest
import torch

from nanovllm.kernels import fp8_activations, fp8_gemm, pointwise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def rows(num_rows: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows of very different sizes, one of them all zero, with a few outliers and a stride."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    x = torch.randn(num_rows, width + 3, generator=g, device=DEVICE) * torch.logspace(-2, 1, num_rows, device=DEVICE)[:, None]
    x[-1, ::7] *= 40.0
    return x.to(dtype)[:, :width]


def assert_same_quantization(got, expected):
    (q, scale), (q_ref, scale_ref) = got, expected
    assert q.dtype == torch.float8_e4m3fn and q.shape == q_ref.shape and scale.shape == scale_ref.shape
    assert torch.equal(scale, scale_ref)
    assert torch.equal(bits(q), bits(q_ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("width", [64, 300])        # narrower than a group; ragged groups and a padded block
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm_quant_is_the_norm_then_the_quantization(add, width, group, dtype):
    x, residual = rows(5, width, dtype), rows(5, width, dtype, seed=1)
    x[2] = 0.0
    residual[2] = 0.0                                # an all-zero row: the smallest scale, zero values
    weight = (1 + 0.3 * torch.randn(width, device=DEVICE)).to(dtype)
    if add:
        q, scale, summed = fp8_activations.rms_norm_quant(x, weight, 1e-6, residual, group)
        normed, summed_ref = pointwise.rms_norm(x, weight, 1e-6, residual)
        assert torch.equal(summed, summed_ref)
    else:
        q, scale = fp8_activations.rms_norm_quant(x, weight, 1e-6, None, group)
        normed = pointwise.rms_norm(x, weight, 1e-6)
    assert_same_quantization((q, scale), fp8_gemm.quantize_activations(normed, group))


@pytest.mark.parametrize("group", [None, 128])
def test_rms_norm_quant_applies_a_gemm_outputs_scales_as_the_plain_norm_does(group):
    """A ScaledOutput's raw values and scales: the same e4m3 values and scales as pointwise's norm with those
    scales, then the quantization."""
    width, dtype = 300, torch.bfloat16
    raw, residual = 100 * rows(5, width, dtype), rows(5, width, dtype, seed=1)
    scales = (torch.logspace(-3, -1, 5, device=DEVICE), 0.01 + torch.rand(width, device=DEVICE))
    weight = (1 + 0.3 * torch.randn(width, device=DEVICE)).to(dtype)
    q, scale, summed = fp8_activations.rms_norm_quant(raw, weight, 1e-6, residual, group, scales)
    normed, summed_ref = pointwise.rms_norm(raw, weight, 1e-6, residual, scales)
    assert torch.equal(summed, summed_ref)
    assert_same_quantization((q, scale), fp8_gemm.quantize_activations(normed, group))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("width", [96, 1100])       # one block; several blocks with a ragged last one
def test_silu_and_mul_quant_is_the_gate_then_the_quantization(width, group, dtype):
    x = (3 * rows(4, 2 * width, dtype, seed=2))
    x[1] = 0.0
    got = fp8_activations.silu_and_mul_quant(x, group)
    assert_same_quantization(got, fp8_gemm.quantize_activations(pointwise.silu_and_mul(x), group))


@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("width", [96, 1100])
def test_silu_and_mul_quant_applies_a_gemm_outputs_scales_as_the_plain_gate_does(width, group):
    """gate_up's raw product and its scales (a ScaledOutput): the same e4m3 values and scales as pointwise's
    gate with those scales, then the quantization."""
    raw = 100 * rows(5, 2 * width, torch.bfloat16, seed=4)
    scales = (torch.logspace(-3, -1, 5, device=DEVICE), 0.001 + 0.01 * torch.rand(2 * width, device=DEVICE))
    got = fp8_activations.silu_and_mul_quant(raw, group, scales)
    assert_same_quantization(got, fp8_gemm.quantize_activations(pointwise.silu_and_mul(raw, scales), group))


@pytest.mark.parametrize("scaled", [False, True])
def test_rows_wider_than_a_program_holds_take_two_passes(monkeypatch, scaled):
    """Per-token scales of a row wider than MAX_BLOCK, in more rows than are split: one program a row, its amax
    over every block, then its values."""
    monkeypatch.setattr(fp8_activations, "MAX_BLOCK", 256)
    monkeypatch.setattr(fp8_activations, "SPLIT_MAX_ROWS", 2)
    x = 3 * rows(3, 2 * 700, torch.bfloat16, seed=3)
    scales = (torch.rand(3, device=DEVICE) + 0.5, torch.rand(1400, device=DEVICE) + 0.5) if scaled else None
    got = fp8_activations.silu_and_mul_quant(x, None, scales)
    assert_same_quantization(got, fp8_gemm.quantize_activations(pointwise.silu_and_mul(x, scales), None))


@pytest.mark.parametrize("scaled", [False, True])
def test_few_wide_rows_are_split_over_programs_with_the_rows_scale(monkeypatch, scaled):
    """A few rows wider than MAX_BLOCK: each row's blocks in programs of their own (a ragged last block), the
    row's amax gathered from its blocks before any value is stored; an all-zero row among them."""
    monkeypatch.setattr(fp8_activations, "MAX_BLOCK", 256)
    monkeypatch.setattr(fp8_activations, "SPLIT_BLOCK", 128)
    x = 3 * rows(4, 2 * 700, torch.bfloat16, seed=5)
    x[2] = 0.0
    scales = (torch.rand(4, device=DEVICE) + 0.5, torch.rand(1400, device=DEVICE) + 0.5) if scaled else None
    got = fp8_activations.silu_and_mul_quant(x, None, scales)
    assert_same_quantization(got, fp8_gemm.quantize_activations(pointwise.silu_and_mul(x, scales), None))


def test_no_rows():
    x = torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE)
    q, scale = fp8_activations.silu_and_mul_quant(x)
    assert q.shape == (0, 32) and scale.shape == (0,)
    q, scale, summed = fp8_activations.rms_norm_quant(x, torch.ones(64, dtype=x.dtype, device=DEVICE), 1e-6, x, 128)
    assert q.shape == (0, 64) and scale.shape == (0, 1) and summed.shape == (0, 64)
