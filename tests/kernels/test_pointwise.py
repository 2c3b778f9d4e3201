"""Triton silu_and_mul and rms_norm against the torch references in nanovllm.layers (on CPU through
Triton's interpreter): equal up to a unit in the last place of each of their two roundings (the
intermediate value's and the output's), where torch's own functions round an ulp differently."""
import pytest
import torch

from nanovllm.kernels.pointwise import rms_norm, silu_and_mul
from nanovllm.layers.activation import silu_and_mul as torch_silu_and_mul
from nanovllm.layers.layernorm import add_rms_norm as torch_add_rms_norm
from nanovllm.layers.layernorm import rms_norm as torch_rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# two units in the last place, relative (bf16 keeps 8 significant bits)
ULP = {torch.float32: 4e-6, torch.bfloat16: 2 ** -6}


def _close(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=ULP[ref.dtype], atol=ULP[ref.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 1100])            # one tile, and tiles with a ragged last one
def test_silu_and_mul(dtype, width):
    torch.manual_seed(0)
    x = (3 * torch.randn(5, 2 * width + 7, device=DEVICE)).to(dtype)[:, :2 * width]   # rows with a stride
    _close(silu_and_mul(x), torch_silu_and_mul(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 100])
def test_rms_norm(dtype, width):
    torch.manual_seed(0)
    x = (4 * torch.randn(6, width, device=DEVICE)).to(dtype)
    residual = torch.randn(6, width, device=DEVICE).to(dtype)
    weight = (1 + 0.2 * torch.randn(width, device=DEVICE)).to(dtype)
    _close(rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6))
    out, summed = rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_summed = torch_add_rms_norm(x, residual, weight, 1e-6)
    _close(summed, ref_summed)
    _close(out, ref_out)
    assert not torch.equal(out, x) and not torch.equal(summed, residual)   # inputs untouched, new tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_applies_a_gemm_outputs_scales_before_the_residual(dtype):
    """With `scales`, x is a GEMM's output without its row and column scales (ScaledOutput's raw values): the
    norm multiplies them in, in float32, before it adds the residual; unit scales change nothing, bit for bit."""
    torch.manual_seed(0)
    width = 100
    raw = (300 * torch.randn(6, width, device=DEVICE)).to(dtype)
    row_scale = torch.logspace(-3, -1, 6, device=DEVICE)
    col_scale = 0.01 + torch.rand(width, device=DEVICE)
    residual = torch.randn(6, width, device=DEVICE).to(dtype)
    weight = (1 + 0.2 * torch.randn(width, device=DEVICE)).to(dtype)
    out, summed = rms_norm(raw, weight, 1e-6, residual, (row_scale, col_scale))
    total = raw.float() * row_scale[:, None] * col_scale[None, :] + residual.float()
    normed = (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).float()
    _close(summed, total.to(dtype))
    _close(out, (normed * weight.float()).to(dtype))
    ones = (torch.ones(6, device=DEVICE), torch.ones(width, device=DEVICE))
    for got, plain in zip(rms_norm(raw, weight, 1e-6, residual, ones), rms_norm(raw, weight, 1e-6, residual)):
        assert torch.equal(got, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 1100])
def test_silu_and_mul_applies_a_gemm_outputs_scales_first(dtype, width):
    """With `scales`, x is gate_up's output without its row and column scales: the gate gives what it gives the
    scaled output the GEMM would have written (scaled in float32, rounded to the dtype; bit for bit on a GPU,
    within the interpreter's own rounding to bfloat16 on CPU); unit scales change nothing, bit for bit."""
    torch.manual_seed(0)
    raw = (300 * torch.randn(5, 2 * width, device=DEVICE)).to(dtype)
    row_scale = torch.logspace(-3, -1, 5, device=DEVICE)
    col_scale = 0.001 + 0.01 * torch.rand(2 * width, device=DEVICE)
    applied = (raw.float() * row_scale[:, None] * col_scale[None, :]).to(dtype)
    if DEVICE == "cuda":
        assert torch.equal(silu_and_mul(raw, (row_scale, col_scale)), silu_and_mul(applied))
    _close(silu_and_mul(raw, (row_scale, col_scale)), silu_and_mul(applied))
    ones = (torch.ones(5, device=DEVICE), torch.ones(2 * width, device=DEVICE))
    assert torch.equal(silu_and_mul(raw, ones), silu_and_mul(raw))


def test_empty_batch():
    assert silu_and_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)
    assert rms_norm(torch.empty(0, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6).shape == (0, 8)
