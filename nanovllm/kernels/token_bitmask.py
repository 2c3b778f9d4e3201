"""Structured outputs' token masks on the logits: a token whose bit is 0 in its row's bitmask gets -inf.

A bitmask row holds one bit a token, 32 tokens an int32 word, token t at bit t % 32 of word t // 32
(xgrammar's layout). `apply_token_bitmask` edits logits[rows[i]] by bitmask[i], in place. Its grid is
(masked rows, vocabulary blocks): a program loads BLOCK tokens' words (neighbouring tokens share a word,
so the loads coalesce) and stores -inf where the bit is clear; it never reads the logits. The torch
version (`apply_token_bitmask_reference`) serves the CPU and checks the kernel.
"""
import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit(do_not_specialize=["num_words"])
def _token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab_size, stride_logits, num_words,
                          BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab_size
    words = tl.load(bitmask_ptr + i * num_words + tokens // 32, mask=inside, other=-1)
    banned = ((words >> (tokens % 32)) & 1) == 0      # an arithmetic shift keeps bit 0 right for bit 31 too
    tl.store(logits_ptr + row * stride_logits + tokens, float("-inf"), mask=inside & banned)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [batch, vocab] (unit stride along the vocabulary), bitmask [r, words] int32 (contiguous),
    rows [r] int32 or int64: the batch row each bitmask row masks."""
    if not rows.numel():
        return
    assert logits.stride(1) == 1 and bitmask.is_contiguous() and bitmask.dtype == torch.int32
    assert bitmask.size(1) * 32 >= logits.size(1), "a bitmask row must cover the vocabulary"
    vocab_size = logits.size(1)
    grid = (rows.numel(), triton.cdiv(vocab_size, BLOCK))
    _token_bitmask_kernel[grid](logits, bitmask, rows, vocab_size, logits.stride(0), bitmask.size(1),
                                BLOCK=BLOCK)


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The same in torch, on any device."""
    if not rows.numel():
        return
    vocab_size = logits.size(1)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1                      # [r, words, 32]
    allowed = bits.flatten(1)[:, :vocab_size].bool().to(logits.device)
    rows = rows.long().to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
