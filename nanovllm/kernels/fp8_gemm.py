"""FP8 (e4m3) W8A8 GEMMs: activations quantized on the fly, multiplied by FP8 weights on tensor cores.

`fp8_linear(x, weight, weight_scale, block_scaled)` is y = x @ W^T for e4m3 weights W [N, K] with float32
scales, in two launches that never wait for the host (a decode step replays in a CUDA graph):
1. `quantize_activations`: one Triton pass over x [M, K] in the model's dtype. Per token (weights with
   per-channel scales) or per token and group of 128 columns (128x128 block weights): scale = amax / 448
   (amax at least MIN_AMAX), value = x / scale (IEEE division), clamped to +-448 and rounded to the nearest
   e4m3 value, ties to even: the very values nanovllm.layers.quantization computes in torch.
2. The GEMM, float32 accumulation, the scales applied in the epilogue, output in the model's dtype:
   - per-channel weights: `torch._scaled_mm` with row-wise scales (scale_a [M, 1], scale_b [1, N]) where it
     applies (bf16 output, K and N multiples of 16, a Hopper-class GPU) and the batch is large, its sums kept
     in the tensor cores' accumulator across K (SCALED_MM_FAST_ACCUM);
     otherwise our Triton kernel, which promotes its partial sums to float32 every 128 products and applies
     both scales once after the K loop;
   - 128x128 block weights: our Triton kernel; each K step of 128 columns is one tensor-core dot whose float32
     result is scaled by its activation group's and weight block's scales before it joins the accumulator
     (DeepSeek's promotion: the FP8 dot's limited internal accumulation never spans more than 128 products);
   - a decode step (M <= 64), either scheme: `fp8_skinny_gemm`, the same dot with K split over more programs
     (a weight-bound GEMM needs every SM streaming), its parts added in a fixed order; one row with
     per-channel weights: `skinny_gemm.gemv`, float32 products on CUDA cores (fp8_linear then skips the
     quantization pass: the GEMV reads the row in the model's dtype).

Tiles are chosen on M alone (CONFIGS; M is never specialized on), so start-up can compile every variant by
running one batch per bucket (config_token_counts). Under Triton's interpreter (CPU tests) float32 -> e4m3
conversion is rounded by hand (its own cast rounds some values to the wrong binade).
"""
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from nanovllm.kernels import skinny_gemm
from nanovllm.kernels.dependent_launch import enter, pdl_options
from nanovllm.kernels.launch import launch
from nanovllm.kernels.skinny_gemm import SkinnyConfig

FP8_MAX = 448.0         # largest finite float8_e4m3fn value
MIN_AMAX = 1e-12        # an all-zero row or group gets a tiny scale (its values quantize to 0), never 0/0
GROUP = 128             # activation group (block scheme) = the weight block's K width
SCALED_MM_MIN_TOKENS = 65   # fewer rows: our decode tiles (SKINNY_CONFIGS; cuBLASLt idles SMs at these shapes)
# _scaled_mm's sums stay in the tensor cores' own accumulator over the whole K (no promotion to float32 every few
# steps): 6-16% faster from 192 rows up on an H100, with a few times bf16's output rounding added (docs/benchmarks.md,
# 2026-11-27); vLLM's CUTLASS FP8 GEMMs on Hopper accumulate the same way (FP8FastAccum schedules)
SCALED_MM_FAST_ACCUM = True
# a GEMM of UNSCALED_MIN_TOKENS..UNSCALED_MAX_TOKENS[reader] rows whose reader can apply its scales runs unscaled
# (per-tensor _scaled_mm with unit scales) and leaves both scales to that reader (layers.quantization.ScaledOutput).
# "norm", the residual RMSNorm after o_proj and down_proj: cuBLASLt's per-tensor kernels take 10-30% less time than
# the row-wise path on the 4096-column projections of Qwen3-8B, none above ~512 rows, and at 17-64 rows 4-14% less
# than our skinny tiles with their scales (H100). "silu", SiLU-and-mul after gate_up_proj: its row-wise kernel at
# 144-192 rows takes 56-67 us against the unscaled one's 48-50; from ~200 rows the gate's loads of both halves'
# column scales for every row cost more than the GEMM saves (8B FP8 decode steps of 192-256 rows 0.1-0.2 ms slower;
# bench.py's standard workload 10,035-10,054 tok/s with the 192-row limit against 10,002 with 512, H100)
UNSCALED_MIN_TOKENS = 17
UNSCALED_MAX_TOKENS = {"norm": 512, "silu": 192}
# the kernels' copies (a @triton.jit function reads only constexpr globals)
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int        # 128, or a divisor of it: one K step never spans two weight blocks
    num_warps: int
    num_stages: int
    group_m: int = 8    # row tiles that share a column tile's weights while they sit in L2


# (smallest M, config), for an H100/H200. Decode (M <= 16) streams the weights: narrow column tiles so that
# enough programs keep loads in flight on every SM; prefill takes 128x128 tensor-core tiles.
CONFIGS: tuple[tuple[int, GemmConfig], ...] = (
    (1, GemmConfig(16, 32, 128, 4, 6)),
    (17, GemmConfig(32, 64, 128, 4, 5)),
    (65, GemmConfig(64, 128, 128, 4, 4)),
    (257, GemmConfig(128, 128, 128, 8, 3)),
)


def config_token_counts() -> tuple[int, ...]:
    """One row count per tile config fp8_linear can pick, skinny or not, and per GEMV (one row): the engine's
    warm-up runs each once. 2: the first skinny bucket's first count that per-channel weights reach (one row
    goes to the GEMV)."""
    return tuple(sorted({first for first, _ in CONFIGS} | {first for first, _ in SKINNY_CONFIGS} | {1, 2}))


def choose_config(num_rows: int) -> GemmConfig:
    return [config for first, config in CONFIGS if num_rows >= first][-1]


# ---- activation quantization -------------------------------------------------------------------------------
@triton.jit
def _to_e4m3(y, INTERPRET: tl.constexpr):
    """float32 y, already within +-448, as float8_e4m3fn rounded to nearest even."""
    if INTERPRET:
        # the interpreter's cast puts some values in the wrong binade: round onto e4m3's grid by hand, then
        # cast values it holds exactly. Normal range: keep 3 of float32's 23 mantissa bits (round to even);
        # below 2^-6 (subnormal) the grid is every 2^-9, rounded to even by the 1.5 * 2^23 trick.
        bits = y.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        subnormal = (y * 512.0 + 12582912.0 - 12582912.0) / 512.0
        rounded = tl.where(tl.abs(y) < 0.015625, subnormal, normal)
        y = tl.where(rounded == 0.0, y * 0.0, rounded)     # a negative value rounded to zero keeps its sign: -0
    return y.to(tl.float8e4nv)


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, K, num_groups, stride_x, stride_q, stride_s,
                            GROUP_SIZE: tl.constexpr, GROUPS: tl.constexpr, INTERPRET: tl.constexpr,
                            PDL: tl.constexpr = False):
    """Program (row, g): groups [g * GROUPS, (g + 1) * GROUPS) of one row, each GROUP_SIZE columns wide."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    inside = (groups[:, None] < num_groups) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _MIN_AMAX)
    scale = tl.math.div_rn(amax, tl.full([GROUPS], _FP8_MAX, tl.float32))
    y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], (GROUPS, GROUP_SIZE)))
    y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)
    tl.store(q_ptr + row * stride_q + cols, _to_e4m3(y, INTERPRET), mask=inside)
    tl.store(s_ptr + row * stride_s + groups, scale, mask=groups < num_groups)


@triton.jit
def _quantize_tokens_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr,
                            INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    """Program row: the row's amax in one sweep, its quantized values in a second (from L1/L2)."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=start + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # the row's scale in every lane (vectors only: no 0-d operands for the precise division)
    amax = tl.zeros([BLOCK], dtype=tl.float32) + tl.maximum(tl.max(amax, 0), _MIN_AMAX)
    scale = tl.math.div_rn(amax, tl.full([BLOCK], _FP8_MAX, tl.float32))
    for start in range(0, K, BLOCK):
        inside = start + offs < K
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=inside, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_FP8_MAX), _FP8_MAX)
        tl.store(q_ptr + row * stride_q + start + offs, _to_e4m3(y, INTERPRET), mask=inside)
    tl.store(s_ptr + row + offs, scale, mask=offs == 0)


def token_warps(block: int) -> int:
    """Warps for a program that sweeps one row BLOCK columns at a time: 8 columns a thread up to 16 warps. On an
    H100 a 4,096-column row (Qwen3-8B's attention output) takes 2.1 us at 16 warps against 2.9 at 4, 8-256 rows."""
    return min(16, max(4, block // 256))


def quantize_activations(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 values [M, K], float32 scales): per token ([M]) with group_size None, else per
    token and group of group_size columns ([M, ceil(K / group_size)], row-major)."""
    num_rows, width = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(num_rows, width, dtype=torch.float8_e4m3fn, device=x.device)
    interpret = x.device.type != "cuda"
    if group_size is None:
        scale = torch.empty(num_rows, dtype=torch.float32, device=x.device)
        if num_rows:
            block = min(4096, triton.next_power_of_2(width))
            _quantize_tokens_kernel[(num_rows,)](x, q, scale, width, x.stride(0), q.stride(0), BLOCK=block,
                                                 INTERPRET=interpret, num_warps=token_warps(block),
                                                 **pdl_options(x.device))
        return q, scale
    num_groups = triton.cdiv(width, group_size)
    scale = torch.empty(num_rows, num_groups, dtype=torch.float32, device=x.device)
    groups = min(8, triton.next_power_of_2(num_groups))
    if num_rows:
        _quantize_groups_kernel[(num_rows, triton.cdiv(num_groups, groups))](
            x, q, scale, width, num_groups, x.stride(0), q.stride(0), scale.stride(0), GROUP_SIZE=group_size,
            GROUPS=groups, INTERPRET=interpret, num_warps=4, **pdl_options(x.device))
    return q, scale


# ---- the GEMM -------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, M, N, K, stride_a, stride_b, stride_c,
                     stride_a_scale, stride_b_scale, BLOCK_SCALED: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """c [M, N] = a [M, K] @ b [N, K]^T with a's and b's scales: per row of a and of b, or (BLOCK_SCALED)
    a's per row and 128 columns [M, K/128] and b's per 128x128 block [N/128, K/128]."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_m % M).to(tl.int64)      # ragged tiles read wrapped (in-bounds) rows and store nothing there
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
    b_ptrs = b_ptr + cols[None, :] * stride_b + offs_k[:, None]        # [BLOCK_K, BLOCK_N], K-major
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            inside = offs_k < K - k
            a = tl.load(a_ptrs, mask=inside[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=inside[:, None], other=0.0)
        if BLOCK_SCALED:
            a_scale = tl.load(a_scale_ptr + rows * stride_a_scale + k // 128)
            b_scale = tl.load(b_scale_ptr + (cols // 128) * stride_b_scale + k // 128)
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        else:
            # Hopper's FP8 dots accumulate with ~14 significant bits unless told to promote: at most
            # BLOCK_K products before the partial sum joins the float32 accumulator (Triton's default on
            # sm_90 never promotes)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCK_SCALED:
        acc = acc * tl.load(a_scale_ptr + rows)[:, None] * tl.load(b_scale_ptr + cols)[None, :]
    c_ptrs = c_ptr + rows[:, None] * stride_c + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
             out_dtype: torch.dtype, block_scaled: bool, config: GemmConfig | None = None) -> torch.Tensor:
    """Our Triton GEMM: a [M, K] e4m3 with scales [M] (or [M, ceil(K/128)] if block_scaled), b [N, K] e4m3
    with scales [N] (or [ceil(N/128), ceil(K/128)]) -> [M, N] in out_dtype. `config` overrides the tiles
    chosen for M (benchmark sweeps, tests)."""
    num_rows, width = a.shape
    num_cols = b.shape[0]
    assert b.shape[1] == width and a.dtype == b.dtype == torch.float8_e4m3fn
    assert a.stride(1) == 1 and b.stride(1) == 1 and a_scale.is_contiguous() and b_scale.is_contiguous()
    out = torch.empty(num_rows, num_cols, dtype=out_dtype, device=a.device)
    if num_rows == 0:
        return out
    config = config or choose_config(num_rows)
    assert not block_scaled or 128 % config.block_k == 0
    grid = (triton.cdiv(num_rows, config.block_m) * triton.cdiv(num_cols, config.block_n),)
    launch(_fp8_gemm_kernel, grid,
        a, a_scale, b, b_scale, out, num_rows, num_cols, width, a.stride(0), b.stride(0), out.stride(0),
        a_scale.stride(0) if block_scaled else 0, b_scale.stride(0) if block_scaled else 0,
        BLOCK_SCALED=block_scaled, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, EVEN_K=width % config.block_k == 0, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out


# ---- decode: the GEMM split over K (nanovllm.kernels.skinny_gemm) ---------------------------------------------
# (smallest M, config): a decode step's rows, from H100 sweeps (benchmarks/bench_fp8_gemm.py --sweep); larger M
# takes fp8_gemm or _scaled_mm. 17-64 rows: one 64-row tile, K split in two where the column tiles fill half
# the SMs or less (Qwen3-8B's o and down). Qwen3-8B's four projections at 24-64 rows: 89-92 us against cuBLASLt's
# 108-116 (its 128x128 tiles make 32-192 programs for 132 SMs there); at 96-128 rows within 2%, at 256 behind.
# (Tried and slower: activation quantization fused into this kernel, with CUDA-core products for M <= 4: their
# fp8 -> float32 conversions cost more than the launch saved.)
SKINNY_CONFIGS: tuple[tuple[int, SkinnyConfig], ...] = (
    (1, SkinnyConfig(64, 4, 4, programs_per_sm=1)),
    (17, SkinnyConfig(64, 4, 5, programs_per_sm=0.5, block_m=64)),
)


def choose_skinny_config(num_rows: int) -> SkinnyConfig | None:
    return skinny_gemm.choose_config(num_rows, SKINNY_CONFIGS)


def fp8_skinny_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                    out_dtype: torch.dtype, block_scaled: bool, config: SkinnyConfig | None = None) -> torch.Tensor:
    """fp8_gemm for M <= 64 (a decode step), K split over more programs than N's tiles alone would give."""
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a_scale.is_contiguous() and b_scale.is_contiguous()
    config = config or choose_skinny_config(a.shape[0])
    assert config is not None and a.shape[0] <= config.block_m and config.block_k == GROUP
    return skinny_gemm.skinny_gemm(a, b, a_scale=a_scale, b_scale=b_scale, block_scaled=block_scaled,
                                   out_dtype=out_dtype, config=config)


@lru_cache(maxsize=None)
def _has_rowwise_scaled_mm(device: torch.device) -> bool:
    """Row-wise scaled torch._scaled_mm runs on Hopper-class GPUs (compute capability 9.0 and up)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _scaled_mm_takes(num_cols: int, width: int, out_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch._scaled_mm (cuBLASLt) takes a GEMM of this shape at all: bf16 out, 16-aligned N and K, a
    Hopper-class GPU (row-wise scales there)."""
    return out_dtype == torch.bfloat16 and width % 16 == 0 and num_cols % 16 == 0 and _has_rowwise_scaled_mm(device)


def scaled_mm_applies(num_rows: int, num_cols: int, width: int, out_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a per-channel GEMM of this shape goes through torch._scaled_mm (else our kernel)."""
    return num_rows >= SCALED_MM_MIN_TOKENS and _scaled_mm_takes(num_cols, width, out_dtype, device)


def defers_output_scales(num_rows: int, num_cols: int, width: int, out_dtype: torch.dtype, device: torch.device,
                         reader: str = "norm") -> bool:
    """Whether a per-channel GEMM of this shape, whose reader ("norm" or "silu") can apply the scales, runs
    unscaled_matmul."""
    return (UNSCALED_MIN_TOKENS <= num_rows <= UNSCALED_MAX_TOKENS[reader]
            and _scaled_mm_takes(num_cols, width, out_dtype, device))


@lru_cache(maxsize=None)
def unit_scale(device: torch.device) -> torch.Tensor:
    """unscaled_matmul's scales (1.0), one per device, made before any CUDA graph is captured (the layers that
    may defer their scales ask for it once their weights are loaded)."""
    assert not torch.cuda.is_current_stream_capturing(), "the unit scale is made outside CUDA graph capture"
    return torch.ones((), dtype=torch.float32, device=device)


def unscaled_matmul(q: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """q e4m3 [M, K] @ weight e4m3 [N, K]^T with neither operand's scales applied: [M, N] in out_dtype (the
    caller applies row and column scales later: layers.quantization.ScaledOutput). Accumulates as fp8_matmul's
    _scaled_mm path does."""
    one = unit_scale(q.device)
    return torch._scaled_mm(q, weight.t(), scale_a=one, scale_b=one, out_dtype=out_dtype,
                            use_fast_accum=SCALED_MM_FAST_ACCUM)


def reads_unquantized(num_rows: int, block_scaled: bool) -> bool:
    """A lone row (a single decode stream) with per-channel weights goes to the GEMV, which reads it in the
    model's dtype as it is: no quantization pass (the producer of such a row writes it plain too). The one
    rule for both sides: fp8_linear / fp8_matmul's routing and Fp8Input.applies."""
    return num_rows == 1 and not block_scaled


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_scaled: bool,
               use_scaled_mm: bool | None = None) -> torch.Tensor:
    """x [..., K] in the model's dtype times e4m3 weight [N, K]^T -> [..., N] in x's dtype. weight_scale:
    float32 [N] (per channel) or [ceil(N/128), ceil(K/128)] (block_scaled). `use_scaled_mm` forces the
    per-channel path either way (tests); default: scaled_mm_applies."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if use_scaled_mm is None and reads_unquantized(x.shape[0], block_scaled) and x.stride(1) == 1:
        return skinny_gemm.gemv(x, weight, b_scale=weight_scale).view(*shape[:-1], weight.shape[0])
    q, scale = quantize_activations(x, GROUP if block_scaled else None)
    out = fp8_matmul(q, scale, weight, weight_scale, block_scaled, x.dtype, use_scaled_mm)
    return out.view(*shape[:-1], weight.shape[0])


def fp8_matmul(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               block_scaled: bool, out_dtype: torch.dtype, use_scaled_mm: bool | None = None) -> torch.Tensor:
    """fp8_linear's GEMM for activations already quantized (q e4m3 [M, K], scale as quantize_activations gives
    it, e.g. written by nanovllm.kernels.fp8_activations): [M, N] in out_dtype."""
    num_rows, num_cols = q.shape[0], weight.shape[0]
    if use_scaled_mm is None and reads_unquantized(num_rows, block_scaled):     # a row given quantized: the GEMV too
        return skinny_gemm.gemv(q, weight, a_scale=scale, b_scale=weight_scale, out_dtype=out_dtype)
    if use_scaled_mm is None and choose_skinny_config(num_rows) is not None:
        return fp8_skinny_gemm(q, scale, weight, weight_scale, out_dtype, block_scaled)
    if not block_scaled:
        if use_scaled_mm is None:
            use_scaled_mm = scaled_mm_applies(num_rows, num_cols, q.shape[1], out_dtype, q.device)
        if use_scaled_mm:
            return torch._scaled_mm(q, weight.t(), scale_a=scale.view(-1, 1), scale_b=weight_scale.view(1, -1),
                                    out_dtype=out_dtype, use_fast_accum=SCALED_MM_FAST_ACCUM)
    return fp8_gemm(q, scale, weight, weight_scale, out_dtype, block_scaled)
