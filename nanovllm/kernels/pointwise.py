"""Triton `silu_and_mul` (SwiGLU's gate) and `rms_norm` (optionally adding the residual first): the
model's pointwise stages, one launch each.

They replace torch.compile'd versions: inductor's SiLU kernel read and wrote at about half the copy
bandwidth on long prefills (192 us a layer for 16,384 tokens of Qwen3-0.6B on an H100), and each call
through torch.compile's wrappers cost tens of microseconds on the host, paid 85 times by an eager
prefill (a lone prompt's time to first token). The intermediate roundings follow the torch references
in nanovllm.layers (an activation or normalized value rounded to the input dtype before its product),
so results agree with them.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.dependent_launch import enter, pdl_options


@triton.jit
def silu_and_mul_cols(x_row_ptr, cols, ok, width, row_scale, col_scale_ptr, SCALED: tl.constexpr):
    """SiLU(gate) * up at columns `cols` of the row at x_row_ptr (gate, then up, each `width` wide), in the
    row's dtype, each stage rounded to it (also nanovllm.kernels.fp8_activations' first stage). SCALED: the row
    is a GEMM's output whose scales were left to this pass: each value times row_scale and its column's scale
    first, rounded to the dtype as the GEMM would have rounded it."""
    gate = tl.load(x_row_ptr + cols, mask=ok, other=0.0)
    up = tl.load(x_row_ptr + width + cols, mask=ok, other=0.0)
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    if SCALED:
        gate = (gate * row_scale * tl.load(col_scale_ptr + cols, mask=ok, other=0.0)).to(dtype).to(tl.float32)
        up = (up * row_scale * tl.load(col_scale_ptr + width + cols, mask=ok, other=0.0)).to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def silu_and_mul_block(x_ptr, row, block, width, stride_x, row_scale_ptr, col_scale_ptr, SCALED: tl.constexpr,
                       BLOCK: tl.constexpr):
    """SiLU(gate) * up over the row's block-th BLOCK columns (silu_and_mul_cols): (values, columns, mask)."""
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    row_scale = tl.load(row_scale_ptr + row) if SCALED else 1.0
    return silu_and_mul_cols(x_ptr + row * stride_x, cols, ok, width, row_scale, col_scale_ptr, SCALED), cols, ok


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, row_scale_ptr, col_scale_ptr, width, stride_x, stride_out,
                         SCALED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    y, cols, ok = silu_and_mul_block(x_ptr, row, tl.program_id(1), width, stride_x, row_scale_ptr, col_scale_ptr,
                                     SCALED, BLOCK)
    tl.store(out_ptr + row * stride_out + cols, y, mask=ok)


def silu_and_mul(x: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [tokens, 2I]. `scales` (float32 [tokens], [2I]): x is a GEMM's output
    whose row and column scales this pass applies first (layers.quantization.ScaledOutput)."""
    tokens, double_width = x.shape
    width = double_width // 2
    assert x.stride(1) == 1 and double_width == 2 * width
    row_scale, col_scale = scales if scales is not None else (x, x)
    out = torch.empty(tokens, width, dtype=x.dtype, device=x.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(tokens, triton.cdiv(width, block))](
            x, out, row_scale, col_scale, width, x.stride(0), out.stride(0), SCALED=scales is not None,
            BLOCK=block, num_warps=4, **pdl_options(x.device))
    return out


@triton.jit
def rms_norm_row(x_ptr, residual_ptr, weight_ptr, residual_out_ptr, row_scale_ptr, col_scale_ptr, row, width,
                 eps, stride_x, stride_r, stride_r_out, ADD: tl.constexpr, SCALED: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Row `row` of x (times its row's and each column's scale first, with SCALED: a GEMM's output whose
    scales were left to this pass; plus the residual's, that sum stored to residual_out, with ADD) normalized
    and times the weight, in x's dtype, the normalized value rounded to it first ([BLOCK], zero past `width`;
    also nanovllm.kernels.fp8_activations' first stage)."""
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if SCALED:
        x *= tl.load(row_scale_ptr + row) * tl.load(col_scale_ptr + cols, mask=ok, other=0.0)
    if ADD:
        x += tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(residual_out_ptr + row * stride_r_out + cols, x.to(dtype), mask=ok)
    r = tl.rsqrt(tl.sum(x * x, 0) / width + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return ((x * r).to(dtype).to(tl.float32) * w).to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, row_scale_ptr, col_scale_ptr,
                     width, eps, stride_x, stride_r, stride_out, stride_r_out, ADD: tl.constexpr,
                     SCALED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    y = rms_norm_row(x_ptr, residual_ptr, weight_ptr, residual_out_ptr, row_scale_ptr, col_scale_ptr, row, width,
                     eps, stride_x, stride_r, stride_r_out, ADD, SCALED, BLOCK)
    tl.store(out_ptr + row * stride_out + cols, y, mask=cols < width)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             scales: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [tokens, hidden] times weight (of x's dtype); with `residual`, of x + residual, and
    that sum is returned too (the next layer's residual). `scales` (float32 [tokens], [hidden]): x is a GEMM's
    output whose row and column scales this pass applies first (layers.quantization.ScaledOutput)."""
    tokens, width = x.shape
    assert x.stride(1) == 1 and weight.shape == (width,) and weight.dtype == x.dtype
    row_scale, col_scale = scales if scales is not None else (x, x)
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else out
    if tokens:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(tokens,)](
            x, x if residual is None else residual, weight, out, residual_out, row_scale, col_scale, width, eps,
            x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0), residual_out.stride(0),
            ADD=residual is not None, SCALED=scales is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8,
            **pdl_options(x.device))
    return out if residual is None else (out, residual_out)
