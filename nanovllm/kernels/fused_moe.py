"""Fused mixture-of-experts kernels: the experts' grouped SwiGLU GEMMs for the tokens' top-k experts (the
router's top-k itself: moe_routing.py).

`fused_moe` is four or five launches and never waits for the host, so a decode step replays in a CUDA graph;
every grid depends on the token count T alone, and T-dependent integers are never specialized on:
1. `_count_kernel`, a program per (expert, slice of the pairs): how many (token, slot) pairs chose it.
   Skipped for small batches (fewer than 4 rows per expert on average), where the placing programs
   count the few pairs themselves: one launch fewer a layer in the weight-bound step.
2. `_place_kernel`, the same grid: lays the pairs out expert by expert, each expert's group padded to a
   multiple of BLOCK_M rows (pads hold -1), in pair order, and tags every BLOCK_M-row block with its
   expert (-1 past the last group). Scans instead of atomics: the layout is the same on every call, and
   nothing needs zeroing first. At most T*k + min(E, T*k)*(BLOCK_M - 1) padded rows: a static grid.
3. `_gate_up_kernel`, a program per (row block, tile of I columns): the gathered tokens' rows times the
   block's expert's gate rows and up rows (two float32 accumulators over the same columns), then
   silu(gate) * up -> act[pair] ([T*k, I]).
4. `_down_kernel`, a program per (row block, tile of H columns): act rows times the expert's down
   projection, times the pair's routing weight -> out_pairs[pair] ([T*k, H]); over DOWN_CHUNK_TOKENS
   tokens at a time (their pairs grouped again by 1-2), so that a long prefill's pair outputs stay small.
5. `_sum_kernel`: each token's k rows summed in float32. No atomics on outputs: results are bitwise
   the same on every call, whatever the layout of the blocks.
The roundings are the torch oracle's (nanovllm.layers.fused_moe): gate, up, silu(gate), the product,
the expert's output and its weighted value are each rounded to the input dtype; the k-sum once.

FP8 experts (e4m3 weights with per-row or 128x128-block scales) add two launches: the hidden states and the
activations are quantized as a linear layer's input is (nanovllm.kernels.fp8_gemm.quantize_activations, per
row or per 128 columns), and each K step is its own FP8 dot whose float32 result joins the accumulator (times
the step's scales if block-scaled; per-row scales once, in the epilogue).

Tiles are chosen on the rows an expert sees on average, T*k/E (CONFIGS): decode (few pairs per expert) takes 16- or 32-row blocks and long
K steps, so that enough programs stream the experts' weights; prefill takes 64/128-row tensor-core tiles.
float32 inputs take exact (IEEE) dots on smaller tiles. On CPU tensors (Triton's interpreter, the
tests) bfloat16 dots are widened and roundings done by hand: the interpreter gets both wrong.
"""
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8_gemm import GROUP, quantize_activations
from nanovllm.kernels.launch import launch

SCAN_CHUNK = 1024      # pair ids read per step by the counting and placing scans
# down and the k-sum take at most this many tokens a launch: a long prefill's [T*k, H] pair outputs were its
# largest activation (Qwen3-30B-A3B at 16,384 tokens: 512 MiB, half the warm-up's peak, which the KV cache's
# sizing leaves free); at 8,192 the attention's buffers are as large, so smaller chunks would free no more
DOWN_CHUNK_TOKENS = 8192


@dataclass(frozen=True)
class Tile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeConfig:
    block_m: int        # rows of a block; each expert's group is padded to a multiple of it
    gate_up: Tile
    down: Tile
    splits: int = 1     # slices of the pairs that count/place scan in parallel (long prefills); 0: few
                        # pairs, which the placing programs count themselves (no count launch)


# (fewest expected rows per expert, config): an expert sees T*k/E rows on average (Qwen3-30B-A3B: T/16,
# Mixtral: T/4), and that, not T, decides the tile. Measured on an H200 at Qwen3-30B-A3B's shape
# (benchmarks/bench_moe.py --sweep): 16-row blocks and long K steps while an expert sees few rows, so that
# enough programs stream the experts' weights; 256-column down tiles for long prefills (16,384 tokens:
# 2.66 ms against 2.99 with 128).
CONFIGS: tuple[tuple[int, MoeConfig], ...] = (
    (0, MoeConfig(16, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4), splits=0)),
    (1, MoeConfig(16, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4), splits=0)),   # FP8's threshold (warm-up counts)
    (4, MoeConfig(16, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4))),     # the pairs outgrow the inline count
    (16, MoeConfig(32, Tile(64, 128, 4, 4), Tile(128, 128, 4, 3))),
    (64, MoeConfig(64, Tile(128, 64, 8, 3), Tile(128, 64, 4, 4), splits=4)),
    (256, MoeConfig(128, Tile(128, 64, 8, 4), Tile(256, 64, 8, 3), splits=16)),
)


# FP8 experts: the same row thresholds (so the same warm-up token counts), K steps of 128 (one scale block).
# H100 sweep at Qwen3-30B-A3B's shape (benchmarks/bench_moe.py --fp8 channel|block --sweep): prefill takes
# 64-row blocks, since 128-row ones hold two 128x128 float32 accumulators plus a block-scaled step's products
# and spill (block scales at 16,384 tokens: 6.4-6.7 ms against 3.0 with 64 rows). From one row an expert on,
# six gate_up stages and (below 16 rows) 256-column down tiles of 8 warps: 1.4% more tok/s on the standard
# workload at 30B-A3B (nineteenth session); a lone token keeps the 4-stage 64-column tiles (7% faster there).
FP8_CONFIGS: tuple[tuple[int, MoeConfig], ...] = (
    (0, MoeConfig(16, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4), splits=0)),
    (1, MoeConfig(16, Tile(64, 128, 4, 6), Tile(256, 128, 8, 3), splits=0)),
    (4, MoeConfig(16, Tile(64, 128, 4, 6), Tile(256, 128, 8, 3))),
    (16, MoeConfig(32, Tile(64, 128, 4, 6), Tile(128, 128, 4, 3))),
    (64, MoeConfig(64, Tile(128, 128, 8, 3), Tile(128, 128, 4, 4), splits=4)),
    (256, MoeConfig(64, Tile(128, 128, 8, 3), Tile(128, 128, 4, 4), splits=16)),
)


def config_token_counts(top_k: int, num_experts: int) -> tuple[int, ...]:
    """One token count per row threshold of the configs for this k and E (the warm-up runs each once, so
    every config fused_moe can pick compiles before the first request)."""
    return tuple(max(1, -(-rows * num_experts // top_k)) for rows, _ in CONFIGS)


def choose_config(num_tokens: int, dtype: torch.dtype, top_k: int, num_experts: int, fp8: bool = False) -> MoeConfig:
    rows_per_expert = num_tokens * top_k // num_experts
    config = [c for rows, c in (FP8_CONFIGS if fp8 else CONFIGS) if rows_per_expert >= rows][-1]
    if dtype == torch.float32:      # IEEE dots and 4-byte tiles: smaller ones fit in shared memory
        small = Tile(min(config.gate_up.block_n, 64), 32, 4, 2)
        config = replace(config, gate_up=small, down=small)
    return config


# ---- grouping the pairs by expert -----------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_pairs", "slice_len"])
def _count_kernel(ids_ptr, counts_ptr, num_experts, num_pairs, slice_len, CHUNK: tl.constexpr):
    """counts[split, expert]: the pairs of this slice that chose this expert."""
    expert = tl.program_id(0)
    split = tl.program_id(1)
    start = split * slice_len
    end = tl.minimum(start + slice_len, num_pairs)
    hits = tl.zeros([CHUNK], dtype=tl.int32)
    for begin in range(start, end, CHUNK):
        pairs = begin + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < end, other=-1)
        hits += (ids == expert).to(tl.int32)
    tl.store(counts_ptr + split * num_experts + expert, tl.sum(hits, 0))


@triton.jit(do_not_specialize=["num_pairs", "slice_len", "num_blocks"])
def _place_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, num_experts, num_pairs, slice_len,
                  num_blocks, SPLITS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                  CHUNK: tl.constexpr, COUNT_CHUNK: tl.constexpr):
    """sorted[group start of e + rank] = pair, for this slice's pairs of expert e, in pair order."""
    expert = tl.program_id(0)
    split = tl.program_id(1)
    experts = tl.arange(0, BLOCK_E)
    mine = experts == expert
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = 0                                  # this expert's pairs in the slices before this one
    if SPLITS == 0:     # few pairs (decode): every program counts them all itself, one launch fewer
        for begin in range(0, num_pairs, COUNT_CHUNK):
            pairs = begin + tl.arange(0, COUNT_CHUNK)
            ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
            totals += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
    for s in tl.static_range(SPLITS):
        counts = tl.load(counts_ptr + s * num_experts + experts, mask=experts < num_experts, other=0)
        totals += counts
        before += tl.where(s < split, tl.sum(tl.where(mine, counts, 0), 0), 0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    group = tl.sum(tl.where(mine, tl.cumsum(padded, 0) - padded, 0), 0)     # exclusive prefix sum

    placed = group + before
    start = split * slice_len
    end = tl.minimum(start + slice_len, num_pairs)
    for begin in range(start, end, CHUNK):
        pairs = begin + tl.arange(0, CHUNK)
        hit = (tl.load(ids_ptr + pairs, mask=pairs < end, other=-1) == expert).to(tl.int32)
        tl.store(sorted_ptr + placed + tl.cumsum(hit, 0) - 1, pairs, mask=hit != 0)
        placed += tl.sum(hit, 0)

    if split == 0:
        count = tl.sum(tl.where(mine, totals, 0), 0)
        size = tl.sum(tl.where(mine, padded, 0), 0)
        pads = count + tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + group + pads, -1, mask=pads < size)
        for b in range(group // BLOCK_M, (group + size) // BLOCK_M, CHUNK):
            blocks = b + tl.arange(0, CHUNK)
            tl.store(block_expert_ptr + blocks, expert, mask=blocks < (group + size) // BLOCK_M)
        if expert == 0:                         # the blocks past the last group: their programs exit
            for b in range(tl.sum(padded, 0) // BLOCK_M, num_blocks, CHUNK):
                blocks = b + tl.arange(0, CHUNK)
                tl.store(block_expert_ptr + blocks, -1, mask=blocks < num_blocks)


def group_pairs(flat_ids: torch.Tensor, num_experts: int, config: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [blocks * BLOCK_M], -1 in pads; expert of each block [blocks], -1 past the end)
    for the pairs' expert ids flat_ids [T*k] (int32)."""
    num_pairs, block_m = flat_ids.numel(), config.block_m
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    device = flat_ids.device
    splits = max(config.splits, 1)
    counts = torch.empty(splits, num_experts, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    slice_len = triton.cdiv(num_pairs, splits)
    grid = (num_experts, splits)
    if config.splits:
        _count_kernel[grid](flat_ids, counts, num_experts, num_pairs, slice_len, CHUNK=SCAN_CHUNK, num_warps=4)
    block_e = triton.next_power_of_2(num_experts)
    _place_kernel[grid](flat_ids, counts, sorted_pairs, block_expert, num_experts, num_pairs, slice_len,
                        num_blocks, SPLITS=config.splits, BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=SCAN_CHUNK,
                        COUNT_CHUNK=max(1, 4096 // block_e), num_warps=4)
    return sorted_pairs, block_expert


# ---- the grouped GEMMs ----------------------------------------------------------------------------------
def _precision(dtype: torch.dtype, device: torch.device) -> str:
    if dtype == torch.float32:
        return "ieee"                   # exact float32 products, as the oracle's
    if dtype == torch.bfloat16 and device.type != "cuda":
        return "interpreter"            # Triton's interpreter: see _dot and _round
    return "tf32"                       # ignored by 16-bit dots: tensor cores, float32 accumulation


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    if PRECISION == "interpreter":      # it multiplies bfloat16 operands as their raw bits: widen them
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _round(x, dtype: tl.constexpr, PRECISION: tl.constexpr):
    """float32 x rounded to dtype (to nearest even), as float32."""
    if PRECISION == "interpreter":      # its float32 -> bfloat16 cast truncates: round the bits by hand
        bits = x.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _block_rows(sorted_ptr, block_expert_ptr, num_n, BLOCK_M: tl.constexpr):
    """This program's (expert, column tile, pair ids of its rows (-1 for pads)); expert -1: nothing to do.
    Consecutive programs share a row block: its A rows and its expert's weights stay in L2."""
    pid = tl.program_id(0)
    block = pid // num_n
    expert = tl.load(block_expert_ptr + block)
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pid % num_n, pairs


@triton.jit
def _weight_scale_ptrs(w_scale_ptr, expert, rows, stride_se, stride_sn, SCALES: tl.constexpr):
    """Where the expert's weight rows `rows` find their scales: one each ([E, N]), or their 128-row block's
    row of per-K-block scales ([E, N/128, K/128]; the K block is added per step)."""
    ptrs = w_scale_ptr + expert.to(tl.int64) * stride_se
    if SCALES == "block":
        return ptrs + (rows // 128) * stride_sn
    else:
        return ptrs + rows


@triton.jit
def _fp8_dot(a, b, acc, a_scale_ptrs, b_scale_ptrs, k, SCALES: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc plus one K step's FP8 product, never more than BLOCK_K <= 128 products in Hopper's narrow FP8
    accumulator before they join the float32 one: block-scaled, the step's own dot times its activation-group
    and weight-block scales; per row, promoted every BLOCK_K products (the scales come after the K loop)."""
    if SCALES == "block":
        a_scale = tl.load(a_scale_ptrs + k // 128)
        b_scale = tl.load(b_scale_ptrs + k // 128)
        return acc + tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
    else:
        return tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)


@triton.jit
def _gate_up_kernel(hidden_ptr, w13_ptr, sorted_ptr, block_expert_ptr, act_ptr, a_scale_ptr, w_scale_ptr,
                    hidden_size, inter_size, stride_hidden, stride_we, stride_wn, stride_a_scale, stride_se,
                    stride_sn, up_scale_offset, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    PRECISION: tl.constexpr, SCALES: tl.constexpr):
    """SCALES "none": 16/32-bit operands. "channel": e4m3 hidden rows with a scale per token and e4m3 weights
    with one per output row ([E, 2I]); "block": a scale per token and 128 columns, and per 128x128 weight
    block ([E, gate blocks then up blocks, K blocks]); up's scales start up_scale_offset entries after gate's."""
    expert, n_tile, pairs = _block_rows(sorted_ptr, block_expert_ptr, tl.cdiv(inter_size, BLOCK_N), BLOCK_M)
    if expert < 0:
        return
    valid = pairs >= 0
    tokens = tl.where(valid, pairs // TOP_K, 0).to(tl.int64)        # pads read token 0, store nothing
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = hidden_ptr + tokens[:, None] * stride_hidden + offs_k[None, :]
    # [BLOCK_K, BLOCK_N] tiles of the gate rows; a ragged last tile reads wrapped (in-bounds) rows
    gate_ptrs = (w13_ptr + expert.to(tl.int64) * stride_we + (cols % inter_size)[None, :] * stride_wn
                 + offs_k[:, None])
    up_offset = inter_size * stride_wn
    a_scale_ptrs = a_scale_ptr + tokens * stride_a_scale
    gate_scale_ptrs = _weight_scale_ptrs(w_scale_ptr, expert, cols % inter_size, stride_se, stride_sn, SCALES)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, hidden_size, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            gate = tl.load(gate_ptrs)
            up = tl.load(gate_ptrs + up_offset)
        else:
            inside = offs_k < hidden_size - k
            a = tl.load(a_ptrs, mask=inside[None, :], other=0.0)
            gate = tl.load(gate_ptrs, mask=inside[:, None], other=0.0)
            up = tl.load(gate_ptrs + up_offset, mask=inside[:, None], other=0.0)
        if SCALES == "none":
            acc_gate = _dot(a, gate, acc_gate, PRECISION)
            acc_up = _dot(a, up, acc_up, PRECISION)
        else:
            acc_gate = _fp8_dot(a, gate, acc_gate, a_scale_ptrs, gate_scale_ptrs, k, SCALES, BLOCK_K)
            acc_up = _fp8_dot(a, up, acc_up, a_scale_ptrs, gate_scale_ptrs + up_scale_offset, k, SCALES, BLOCK_K)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
    if SCALES == "channel":
        a_scale = tl.load(a_scale_ptrs)[:, None]
        acc_gate = acc_gate * a_scale * tl.load(gate_scale_ptrs)[None, :]
        acc_up = acc_up * a_scale * tl.load(gate_scale_ptrs + up_scale_offset)[None, :]
    dtype = act_ptr.dtype.element_ty
    gate = _round(acc_gate, dtype, PRECISION)
    act = _round(gate * tl.sigmoid(gate), dtype, PRECISION)
    out = _round(act * _round(acc_up, dtype, PRECISION), dtype, PRECISION).to(dtype)
    tl.store(act_ptr + pairs.to(tl.int64)[:, None] * inter_size + cols[None, :], out,
             mask=valid[:, None] & (cols < inter_size)[None, :])


@triton.jit
def _down_kernel(act_ptr, w2_ptr, sorted_ptr, block_expert_ptr, weights_ptr, out_ptr, a_scale_ptr, w_scale_ptr,
                 hidden_size, inter_size, stride_we, stride_wn, stride_a_scale, stride_se, stride_sn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 PRECISION: tl.constexpr, SCALES: tl.constexpr):
    """SCALES as _gate_up_kernel's: act rows (e4m3 unless "none") scaled per pair (and 128 columns if
    "block"), the experts' down weights per output row ([E, H]) or per 128x128 block."""
    expert, n_tile, pairs = _block_rows(sorted_ptr, block_expert_ptr, tl.cdiv(hidden_size, BLOCK_N), BLOCK_M)
    if expert < 0:
        return
    valid = pairs >= 0
    rows = tl.where(valid, pairs, 0).to(tl.int64)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * inter_size + offs_k[None, :]
    b_ptrs = (w2_ptr + expert.to(tl.int64) * stride_we + (cols % hidden_size)[None, :] * stride_wn
              + offs_k[:, None])
    a_scale_ptrs = a_scale_ptr + rows * stride_a_scale
    b_scale_ptrs = _weight_scale_ptrs(w_scale_ptr, expert, cols % hidden_size, stride_se, stride_sn, SCALES)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, inter_size, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            inside = offs_k < inter_size - k
            a = tl.load(a_ptrs, mask=inside[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=inside[:, None], other=0.0)
        if SCALES == "none":
            acc = _dot(a, b, acc, PRECISION)
        else:
            acc = _fp8_dot(a, b, acc, a_scale_ptrs, b_scale_ptrs, k, SCALES, BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SCALES == "channel":
        acc = acc * tl.load(a_scale_ptrs)[:, None] * tl.load(b_scale_ptrs)[None, :]
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows, mask=valid, other=0.0)
    out = _round(_round(acc, dtype, PRECISION) * weight[:, None], dtype, PRECISION).to(dtype)
    tl.store(out_ptr + rows[:, None] * hidden_size + cols[None, :], out,
             mask=valid[:, None] & (cols < hidden_size)[None, :])


@triton.jit
def _sum_kernel(pairs_ptr, out_ptr, hidden_size, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slots = tl.arange(0, BLOCK_K)
    x = tl.load(pairs_ptr + (token * TOP_K + slots)[:, None] * hidden_size + cols[None, :],
                mask=(slots < TOP_K)[:, None] & (cols < hidden_size)[None, :], other=0.0)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + token * hidden_size + cols, _round(tl.sum(x.to(tl.float32), 0), dtype, PRECISION).to(dtype),
             mask=cols < hidden_size)


def _scales(scale: torch.Tensor | None) -> str:
    """The SCALES constant for an experts' weight-scale tensor: None, [E, N] (per row) or [E, N/128, K/128]."""
    return "none" if scale is None else "channel" if scale.dim() == 2 else "block"


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeConfig | None = None, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden_states[t]) for hidden_states [T, H],
    w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]; [T, H] in hidden_states' dtype. topk_ids
    int32 or int64. `config` overrides the tiles chosen for T (benchmark sweeps, tests).

    FP8 experts: e4m3 w13 and w2 with float32 scales, per output row (w13_scale [E, 2I], w2_scale [E, H]:
    the hidden states and the activations quantized per row) or per 128x128 block (w13_scale
    [E, 2 ceil(I/128), ceil(H/128)], gate's blocks then up's; w2_scale [E, ceil(H/128), ceil(I/128)]: the
    rows quantized per 128 columns), as nanovllm.kernels.fp8_gemm quantizes a linear layer's input."""
    num_tokens, hidden_size = hidden_states.shape
    num_experts, double_inter, _ = w13.shape
    inter_size, top_k = double_inter // 2, topk_ids.shape[1]
    dtype, device = hidden_states.dtype, hidden_states.device
    assert w13.shape == (num_experts, 2 * inter_size, hidden_size) and w2.shape == (num_experts, hidden_size, inter_size)
    assert w13.is_contiguous() and w2.is_contiguous()
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k)
    scales = _scales(w13_scale)
    assert scales == _scales(w2_scale)
    assert w13.dtype == w2.dtype == (dtype if scales == "none" else torch.float8_e4m3fn)
    if num_tokens == 0:
        return torch.empty(0, hidden_size, dtype=dtype, device=device)
    if hidden_states.stride(1) != 1:
        hidden_states = hidden_states.contiguous()
    config = config or choose_config(num_tokens, dtype, top_k, num_experts, fp8=scales != "none")
    # no copies for the kernels' route (int32 ids, float32 weights, contiguous)
    flat_ids = topk_ids.to(torch.int32).contiguous().view(-1)
    flat_weights = topk_weights.to(torch.float32).contiguous().view(-1)
    sorted_pairs, block_expert = group_pairs(flat_ids, num_experts, config)
    num_blocks, num_pairs = block_expert.numel(), num_tokens * top_k
    precision = _precision(dtype, device)

    tile = config.gate_up
    a, a_scale, w13_scale, up_scale_offset = _operands(hidden_states, w13_scale, scales, inter_size)
    act = torch.empty(num_pairs, inter_size, dtype=dtype, device=device)
    launch(_gate_up_kernel, (num_blocks * triton.cdiv(inter_size, tile.block_n),),
        a, w13, sorted_pairs, block_expert, act, a_scale, w13_scale, hidden_size, inter_size, a.stride(0),
        w13.stride(0), w13.stride(1), a_scale.stride(0), w13_scale.stride(0), _inner_stride(w13_scale),
        up_scale_offset, TOP_K=top_k, BLOCK_M=config.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        EVEN_K=hidden_size % tile.block_k == 0, PRECISION=precision, SCALES=scales, num_warps=tile.num_warps,
        num_stages=tile.num_stages)

    # down and the k-sum over at most DOWN_CHUNK_TOKENS tokens at a time (the tokens' pairs grouped again),
    # each pair through the same tile as unchunked: bitwise the same result, a smaller [pairs, H] buffer
    out = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    for start in range(0, num_tokens, DOWN_CHUNK_TOKENS):
        end = min(num_tokens, start + DOWN_CHUNK_TOKENS)
        pairs = slice(start * top_k, end * top_k)
        if end - start < num_tokens:
            sorted_pairs, block_expert = group_pairs(flat_ids[pairs], num_experts, config)
        # a sum of one is already rounded once: the pairs' outputs are the tokens'
        out_pairs = out[start:end] if top_k == 1 else torch.empty((end - start) * top_k, hidden_size, dtype=dtype,
                                                                  device=device)
        _down(act[pairs], w2, sorted_pairs, block_expert, flat_weights[pairs], out_pairs, w2_scale, scales, config,
              precision)
        if top_k > 1:
            _sum_kernel[(end - start, triton.cdiv(hidden_size, block_h))](
                out_pairs, out[start:end], hidden_size, TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k),
                BLOCK_H=block_h, PRECISION=precision, num_warps=4)
        del out_pairs                   # before the next chunk's: one chunk's pair outputs alive at a time
    return out


def _down(act: torch.Tensor, w2: torch.Tensor, sorted_pairs: torch.Tensor, block_expert: torch.Tensor,
          weights: torch.Tensor, out_pairs: torch.Tensor, w2_scale: torch.Tensor | None, scales: str,
          config: MoeConfig, precision: str) -> None:
    """out_pairs[pair] = weights[pair] * (act[pair] @ the pair's expert's down projection), for the pairs
    grouped as sorted_pairs / block_expert say (ids into act, weights and out_pairs)."""
    hidden_size, inter_size = w2.shape[1], w2.shape[2]
    tile = config.down
    a, a_scale, w2_scale, _ = _operands(act, w2_scale, scales, 0)
    launch(_down_kernel, (block_expert.numel() * triton.cdiv(hidden_size, tile.block_n),),
        a, w2, sorted_pairs, block_expert, weights, out_pairs, a_scale, w2_scale, hidden_size, inter_size,
        w2.stride(0), w2.stride(1), a_scale.stride(0), w2_scale.stride(0), _inner_stride(w2_scale),
        BLOCK_M=config.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=inter_size % tile.block_k == 0,
        PRECISION=precision, SCALES=scales, num_warps=tile.num_warps, num_stages=tile.num_stages)


def _operands(x: torch.Tensor, weight_scale: torch.Tensor | None, scales: str,
              inter_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A GEMM's A operand and its scales (x quantized, per row or per 128 columns, for FP8 experts), the
    weight scales (x itself as a never-read stand-in when there are none), and where up's scales start."""
    if scales == "none":
        return x, x, x, 0
    a, a_scale = quantize_activations(x, GROUP if scales == "block" else None)
    up_scale_offset = (weight_scale.shape[1] // 2 * weight_scale.stride(1) if scales == "block" else inter_size)
    return a, a_scale, weight_scale, up_scale_offset


def _inner_stride(weight_scale: torch.Tensor) -> int:
    """Between an expert's rows of block scales (per-row scales are contiguous: unused)."""
    return weight_scale.stride(1) if weight_scale.dim() == 3 else 0
