"""Triton repetition / frequency / presence penalties, in place on the logits, and the count of a step's
sampled tokens into the output-count table.

`apply_penalties` edits logits[rows[i]] by the state of table row state_rows[i] (PenaltyState: a bool
prompt-token table and an int32 output-count table, [state rows, vocab] each). Its grid is (penalized
rows, vocabulary blocks): a program reads BLOCK logits of its row and the same BLOCK columns of the
row's prompt flags and output counts straight from the tables, through its state-row index (no
gathered [rows, vocab] copies), and writes the penalized logits back: one pass, every byte read once.
A row whose repetition weight is 1 never reads its prompt flags (they cannot change anything), and a
row whose three weights are all no-ops returns at once.

The arithmetic is the torch reference's (nanovllm.layers.logits_processor.apply_penalties), operation
for operation in float32: repetition over the tokens in the prompt or the output (logit > 0: divided
by r, else multiplied by r; an IEEE-rounded division, as torch's on the CPU), then minus (f * count + p * (count
> 0)), rounded to the logits' dtype at the end. No fused multiply-adds (each product an explicit mul.rn), so the
results are IEEE float32 arithmetic's, as the reference computes it on the CPU (Triton's CPU interpreter rounds
float32 to bfloat16 toward zero: one bfloat16 ulp off at most there). On an H100 the kernel differed from
torch's CUDA path in the last bit (the GPU test now holds it to the CPU's arithmetic, the CUDA path within an ulp).

`count_tokens` adds 1 at (state_rows[i], token_ids[i]): one program a row, one atomic add, in place of
index_put_(accumulate=True)'s sort and launches.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _product(a, b, INTERPRET: tl.constexpr):
    """a * b rounded on its own: on the GPU an explicit mul.rn, which neither LLVM nor ptxas contracts into a
    fused multiply-add with the sum it feeds (with enable_fp_fusion=False alone, an H100 run found the kernel
    off the torch path in the last bit, where f * c is inexact)."""
    if INTERPRET:
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _penalties_kernel(logits_ptr, rows_ptr, state_rows_ptr, prompt_ptr, counts_ptr, repetition_ptr,
                      frequency_ptr, presence_ptr, vocab_size, stride_logits, stride_state,
                      BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    i = tl.program_id(0)
    repetition = tl.load(repetition_ptr + i)
    frequency = tl.load(frequency_ptr + i)
    presence = tl.load(presence_ptr + i)
    uses_prompt = repetition != 1.0
    if not uses_prompt and frequency == 0.0 and presence == 0.0:
        return                      # x / 1, x * 1 and x - 0 leave every logit as it is
    row = tl.load(rows_ptr + i).to(tl.int64)
    state = tl.load(state_rows_ptr + i).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab_size
    x_ptrs = logits_ptr + row * stride_logits + cols
    raw = tl.load(x_ptrs, mask=ok, other=0.0)
    counts = tl.load(counts_ptr + state * stride_state + cols, mask=ok, other=0)
    seen = counts > 0
    if uses_prompt:
        seen = seen | (tl.load(prompt_ptr + state * stride_state + cols, mask=ok, other=0) != 0)
    x = raw.to(tl.float32)
    x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
    c = counts.to(tl.float32)
    frequency = tl.zeros_like(c) + frequency
    presence = tl.zeros_like(c) + presence
    x = x - (_product(frequency, c, INTERPRET) + _product(presence, (c > 0).to(tl.float32), INTERPRET))
    tl.store(x_ptrs, x.to(raw.dtype), mask=ok)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, state_rows: torch.Tensor, prompt_mask: torch.Tensor,
                    output_counts: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor, block: int = 1024) -> None:
    """In place, for each i: logits[rows[i]] penalized by prompt_mask[state_rows[i]] (bool) and
    output_counts[state_rows[i]] (int32) with weights repetition[i], frequency[i], presence[i] (float32).
    The tables are read where they lie; only their rows named in state_rows are touched."""
    num = rows.numel()
    vocab_size = logits.size(1)
    assert logits.stride(1) == 1 and prompt_mask.dtype == torch.bool and output_counts.dtype == torch.int32
    assert prompt_mask.size(1) == output_counts.size(1) == vocab_size
    assert prompt_mask.stride() == output_counts.stride() and output_counts.stride(1) == 1
    if num == 0:
        return
    block = min(block, triton.next_power_of_2(vocab_size))
    # enable_fp_fusion=False: no multiply-add contraction, so the roundings are the torch reference's
    _penalties_kernel[(num, triton.cdiv(vocab_size, block))](
        logits, rows, state_rows, prompt_mask.view(torch.uint8), output_counts, repetition.to(torch.float32),
        frequency.to(torch.float32), presence.to(torch.float32), vocab_size, logits.stride(0),
        output_counts.stride(0), BLOCK=block, INTERPRET=logits.device.type != "cuda", num_warps=4,
        enable_fp_fusion=False)


@triton.jit
def _count_kernel(counts_ptr, state_rows_ptr, token_ids_ptr, stride_state):
    i = tl.program_id(0)
    state = tl.load(state_rows_ptr + i).to(tl.int64)
    token = tl.load(token_ids_ptr + i).to(tl.int64)
    tl.atomic_add(counts_ptr + state * stride_state + token, 1, sem="relaxed")


def count_tokens(output_counts: torch.Tensor, state_rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """output_counts[state_rows[i], token_ids[i]] += 1 for each i (repeated pairs add up)."""
    assert output_counts.dtype == torch.int32 and output_counts.stride(1) == 1
    if state_rows.numel():
        _count_kernel[(state_rows.numel(),)](output_counts, state_rows, token_ids, output_counts.stride(0),
                                             num_warps=1)
