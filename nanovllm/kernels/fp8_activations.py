"""FP8 activations written by the pass that produces them: RMSNorm (with the residual add) and SiLU-and-mul
that store e4m3 values and their float32 scales instead of model-dtype rows, for an FP8 layer to multiply.

An FP8 projection's input is otherwise quantized by a launch of its own (fp8_gemm.quantize_activations), one
more pass over the rows before every GEMM; at decode that launch costs about as much as the weights of a small
projection take to stream. Here the row is normalized (or gated), rounded to the model's dtype exactly as
nanovllm.kernels.pointwise rounds it, and quantized in the same program by fp8_gemm's rule: scale = amax / 448
(amax at least MIN_AMAX) per token (group_size None) or per token and group of group_size columns, value =
x / scale (IEEE division), clamped and rounded to the nearest e4m3 value. The values and scales are therefore
the very ones pointwise's kernel followed by quantize_activations would give.

A per-token scale needs the whole row's amax before any value is stored: one program a row, the row in
registers (a second, cached pass for rows wider than MAX_BLOCK). A few wide rows (a decode step's SiLU-and-mul
at up to SPLIT_MAX_ROWS tokens) would leave most SMs idle that way: each row is split over programs of
SPLIT_BLOCK columns instead, one launch writing every block's amax and a second quantizing with the row's
(measured on an H100 at Qwen3-8B's 12,288 columns, scales applied: 8.8 us at 32 rows in one program a row,
6.8 in 4,096-column passes, 5.5 split; from 64 rows the passes are fastest). Per-group scales need only their
group: SiLU-and-mul then splits a row over several programs, as pointwise's kernel does.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.dependent_launch import enter, pdl_options
from nanovllm.kernels.fp8_gemm import _FP8_MAX, _MIN_AMAX, _to_e4m3
from nanovllm.kernels.pointwise import rms_norm_row, silu_and_mul_block, silu_and_mul_cols

MAX_BLOCK = 4096        # widest row a program holds in registers (wider rows: two passes of MAX_BLOCK columns)
SPLIT_MAX_ROWS = 48     # up to this many rows wider than MAX_BLOCK, each row's blocks in programs of their own
SPLIT_BLOCK = 1024


@triton.jit
def _quantize_block(y, q_ptrs, ok, GROUP_SIZE: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """y [BLOCK] float32 (zero where not `ok`), GROUP_SIZE-column groups: values to q_ptrs; the groups' scales
    returned."""
    groups: tl.constexpr = BLOCK // GROUP_SIZE
    yg = tl.reshape(y, [groups, GROUP_SIZE])
    amax = tl.maximum(tl.max(tl.abs(yg), axis=1), _MIN_AMAX)
    scale = tl.math.div_rn(amax, tl.full([groups], _FP8_MAX, tl.float32))
    v = tl.math.div_rn(yg, tl.broadcast_to(scale[:, None], (groups, GROUP_SIZE)))
    v = tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)
    tl.store(q_ptrs, tl.reshape(_to_e4m3(v, INTERPRET), [BLOCK]), mask=ok)
    return scale


@triton.jit
def _row_scale(amax):
    """A row's scale from its running |y| maxima [BLOCK], in every lane (vectors only: no 0-d operands for the
    precise division)."""
    amax = tl.zeros_like(amax) + tl.maximum(tl.max(amax, 0), _MIN_AMAX)
    return tl.math.div_rn(amax, tl.zeros_like(amax) + _FP8_MAX)


@triton.jit
def _store_token(y, scale, q_ptrs, ok, INTERPRET: tl.constexpr):
    v = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -_FP8_MAX), _FP8_MAX)
    tl.store(q_ptrs, _to_e4m3(v, INTERPRET), mask=ok)


@triton.jit
def _rms_norm_quant_kernel(x_ptr, residual_ptr, weight_ptr, q_ptr, s_ptr, residual_out_ptr, row_scale_ptr,
                           col_scale_ptr, width, num_groups, eps, stride_x, stride_r, stride_q, stride_s,
                           stride_r_out, ADD: tl.constexpr, SCALED: tl.constexpr, GROUP_SIZE: tl.constexpr,
                           BLOCK: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    """Program row: (x + residual) normalized, times the weight, rounded as pointwise's kernel rounds it, then
    quantized per token (GROUP_SIZE 0) or per group."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    y = rms_norm_row(x_ptr, residual_ptr, weight_ptr, residual_out_ptr, row_scale_ptr, col_scale_ptr, row, width,
                     eps, stride_x, stride_r, stride_r_out, ADD, SCALED, BLOCK).to(tl.float32)
    q_ptrs = q_ptr + row * stride_q + cols
    if GROUP_SIZE == 0:
        scale = _row_scale(tl.abs(y))
        _store_token(y, scale, q_ptrs, ok, INTERPRET)
        tl.store(s_ptr + row + cols, scale, mask=cols == 0)
    else:
        scale = _quantize_block(y, q_ptrs, ok, GROUP_SIZE, BLOCK, INTERPRET)
        groups = tl.arange(0, BLOCK // GROUP_SIZE)
        tl.store(s_ptr + row * stride_s + groups, scale, mask=groups < num_groups)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, row_scale_ptr, col_scale_ptr, width, num_groups, stride_x,
                               stride_q, stride_s, SCALED: tl.constexpr, GROUP_SIZE: tl.constexpr,
                               BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr, INTERPRET: tl.constexpr,
                               PDL: tl.constexpr = False):
    """Per token (GROUP_SIZE 0): program row, the row's amax over every BLOCK of columns, then its values
    (SINGLE_PASS: the row is one BLOCK, kept in registers). Per group: program (row, block of columns).
    SCALED: x is a GEMM's output whose scales this pass applies (pointwise.silu_and_mul_cols)."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    rs = tl.load(row_scale_ptr + row) if SCALED else 1.0
    offs = tl.arange(0, BLOCK)
    if GROUP_SIZE == 0:
        if SINGLE_PASS:
            ok = offs < width
            y = silu_and_mul_cols(x_row, offs, ok, width, rs, col_scale_ptr, SCALED).to(tl.float32)
            scale = _row_scale(tl.abs(y))
            _store_token(y, scale, q_ptr + row * stride_q + offs, ok, INTERPRET)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, width, BLOCK):
                ok = start + offs < width
                y = silu_and_mul_cols(x_row, start + offs, ok, width, rs, col_scale_ptr, SCALED).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(y))
            scale = _row_scale(amax)
            for start in range(0, width, BLOCK):
                ok = start + offs < width
                y = silu_and_mul_cols(x_row, start + offs, ok, width, rs, col_scale_ptr, SCALED).to(tl.float32)
                _store_token(y, scale, q_ptr + row * stride_q + start + offs, ok, INTERPRET)
        tl.store(s_ptr + row + offs, scale, mask=offs == 0)
    else:
        cols = tl.program_id(1) * BLOCK + offs
        ok = cols < width
        y = silu_and_mul_cols(x_row, cols, ok, width, rs, col_scale_ptr, SCALED).to(tl.float32)
        scale = _quantize_block(y, q_ptr + row * stride_q + cols, ok, GROUP_SIZE, BLOCK, INTERPRET)
        groups = tl.program_id(1) * (BLOCK // GROUP_SIZE) + tl.arange(0, BLOCK // GROUP_SIZE)
        tl.store(s_ptr + row * stride_s + groups, scale, mask=groups < num_groups)


@triton.jit
def _silu_and_mul_block_amax_kernel(x_ptr, amax_ptr, row_scale_ptr, col_scale_ptr, width, num_blocks, stride_x,
                                    SCALED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, block of columns): the block's amax of SiLU(gate) * up, to amax[row, block]."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    y, _, _ = silu_and_mul_block(x_ptr, row, tl.program_id(1), width, stride_x, row_scale_ptr, col_scale_ptr,
                                 SCALED, BLOCK)
    tl.store(amax_ptr + row * num_blocks + tl.program_id(1), tl.max(tl.abs(y.to(tl.float32)), 0))


@triton.jit
def _silu_and_mul_quant_blocks_kernel(x_ptr, q_ptr, s_ptr, amax_ptr, row_scale_ptr, col_scale_ptr, width,
                                      num_blocks, stride_x, stride_q, SCALED: tl.constexpr, BLOCK: tl.constexpr,
                                      BLOCKS: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, block of columns): the row's scale from its blocks' amax (the launch before), then the
    block's values, computed again (the row is still in L2); block 0 stores the scale."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    b = tl.arange(0, BLOCKS)
    block_amax = tl.load(amax_ptr + row * num_blocks + b, mask=b < num_blocks, other=0.0)
    scale = _row_scale(tl.zeros([BLOCK], tl.float32) + tl.max(block_amax, 0))
    y, cols, ok = silu_and_mul_block(x_ptr, row, block, width, stride_x, row_scale_ptr, col_scale_ptr, SCALED, BLOCK)
    _store_token(y.to(tl.float32), scale, q_ptr + row * stride_q + cols, ok, INTERPRET)
    tl.store(s_ptr + row + cols, scale, mask=cols == 0)


def _outputs(num_rows: int, width: int, group_size: int | None, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, int]:
    q = torch.empty(num_rows, width, dtype=torch.float8_e4m3fn, device=device)
    num_groups = 1 if group_size is None else triton.cdiv(width, group_size)
    scale_shape = (num_rows,) if group_size is None else (num_rows, num_groups)
    return q, torch.empty(scale_shape, dtype=torch.float32, device=device), num_groups


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                   group_size: int | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None):
    """pointwise.rms_norm(x, weight, eps, residual, scales) quantized as fp8_gemm.quantize_activations(.,
    group_size) would quantize it: (e4m3 [T, H], scales [T] or [T, ceil(H / group_size)]), and with
    `residual` the sum x + residual (the next layer's residual) third."""
    tokens, width = x.shape
    assert x.stride(1) == 1 and weight.shape == (width,) and weight.dtype == x.dtype
    row_scale, col_scale = scales if scales is not None else (x, x)
    q, scale, num_groups = _outputs(tokens, width, group_size, x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    if tokens:
        block = max(triton.next_power_of_2(width), group_size or 1)
        _rms_norm_quant_kernel[(tokens,)](
            x, x if residual is None else residual, weight, q, scale, residual_out, row_scale, col_scale, width,
            num_groups, eps, x.stride(0), 0 if residual is None else residual.stride(0), q.stride(0),
            0 if group_size is None else scale.stride(0), residual_out.stride(0), ADD=residual is not None,
            SCALED=scales is not None, GROUP_SIZE=group_size or 0, BLOCK=block, INTERPRET=x.device.type != "cuda",
            num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16, **pdl_options(x.device))
    return (q, scale) if residual is None else (q, scale, residual_out)


def silu_and_mul_quant(x: torch.Tensor, group_size: int | None = None,
                       scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """pointwise.silu_and_mul(x, scales) for x [T, 2I] quantized as fp8_gemm.quantize_activations(., group_size)
    would quantize it: (e4m3 [T, I], scales [T] or [T, ceil(I / group_size)])."""
    tokens, double_width = x.shape
    width = double_width // 2
    assert x.stride(1) == 1 and double_width == 2 * width
    row_scale, col_scale = scales if scales is not None else (x, x)
    q, scale, num_groups = _outputs(tokens, width, group_size, x.device)
    if tokens:
        interpret = x.device.type != "cuda"
        if group_size is None and width > MAX_BLOCK and tokens <= SPLIT_MAX_ROWS:
            num_blocks = triton.cdiv(width, SPLIT_BLOCK)
            block_amax = torch.empty(tokens, num_blocks, dtype=torch.float32, device=x.device)
            _silu_and_mul_block_amax_kernel[(tokens, num_blocks)](
                x, block_amax, row_scale, col_scale, width, num_blocks, x.stride(0), SCALED=scales is not None,
                BLOCK=SPLIT_BLOCK, num_warps=4, **pdl_options(x.device))
            _silu_and_mul_quant_blocks_kernel[(tokens, num_blocks)](
                x, q, scale, block_amax, row_scale, col_scale, width, num_blocks, x.stride(0), q.stride(0),
                SCALED=scales is not None, BLOCK=SPLIT_BLOCK, BLOCKS=triton.next_power_of_2(num_blocks),
                INTERPRET=interpret, num_warps=4, **pdl_options(x.device))
        elif group_size is None:
            block = min(MAX_BLOCK, triton.next_power_of_2(width))
            single_pass = block >= width
            _silu_and_mul_quant_kernel[(tokens,)](
                x, q, scale, row_scale, col_scale, width, num_groups, x.stride(0), q.stride(0), 0,
                SCALED=scales is not None, GROUP_SIZE=0, BLOCK=block, SINGLE_PASS=single_pass, INTERPRET=interpret,
                num_warps=16 if not single_pass else 4 if block <= 2048 else 8, **pdl_options(x.device))
        else:
            block = max(group_size, min(1024, triton.next_power_of_2(width)))
            _silu_and_mul_quant_kernel[(tokens, triton.cdiv(width, block))](
                x, q, scale, row_scale, col_scale, width, num_groups, x.stride(0), q.stride(0), scale.stride(0),
                SCALED=scales is not None, GROUP_SIZE=group_size,
                BLOCK=block, SINGLE_PASS=True, INTERPRET=interpret, num_warps=4, **pdl_options(x.device))
    return q, scale
