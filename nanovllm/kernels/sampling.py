"""Triton `sample`: one read of the logits draws every row's token.

Gumbel-max: argmax(logits / T + G) with G = -log(E), E ~ Exp(1), is an exact draw from
softmax(logits / T), and needs no softmax. Rows with temperature 0 take the plain argmax.

Grid (rows, chunks of the vocabulary): a batch of a few hundred rows would leave most SMs idle with
one program per row, so each program scans one chunk and leaves its best (value, index); a tiny
torch argmax over the chunks picks the winner. Ties go to the lowest index, as torch.argmax.
The random stream is Philox keyed by a seed drawn from torch's generator on the logits' device, so
torch.manual_seed makes runs repeatable, and nothing here syncs with the host.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _chunk_argmax_kernel(logits_ptr, temperatures_ptr, seed_ptr, best_val_ptr, best_idx_ptr,
                         vocab_size, stride_row, num_chunks,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    seed = tl.load(seed_ptr)

    best_val = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < vocab_size
        x = tl.load(row_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        if not greedy:
            u = tl.rand(seed, row * vocab_size + offs)                 # uniform in [0, 1)
            x += -tl.log(tl.maximum(-tl.log(u), 1e-20))                # Gumbel(0, 1)
        x = tl.where(ok, x, float("-inf"))
        better = x > best_val                                            # strict: keep the earlier index
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, offs, best_idx)

    top = tl.max(best_val, 0)
    # lowest index among the lanes holding the maximum (lanes never updated hold index 0 and -inf)
    idx = tl.min(tl.where(best_val == top, best_idx, 2147483647), 0)
    out = row * num_chunks + chunk
    tl.store(best_val_ptr + out, top)
    tl.store(best_idx_ptr + out, idx)


def sample(logits: torch.Tensor, temperatures: torch.Tensor, chunk: int = 8192, block: int = 1024) -> torch.Tensor:
    """Token ids [rows] (int64) drawn from softmax(logits / temperature), argmax where temperature is 0."""
    rows, vocab_size = logits.shape
    assert logits.stride(1) == 1 and temperatures.shape == (rows,)
    chunk = min(chunk, triton.next_power_of_2(vocab_size))
    block = min(block, chunk)
    num_chunks = triton.cdiv(vocab_size, chunk)
    best_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    seed = torch.randint(0, 2 ** 31 - 1, (1,), dtype=torch.int64, device=logits.device)
    _chunk_argmax_kernel[(rows, num_chunks)](
        logits, temperatures.to(torch.float32), seed, best_val, best_idx, vocab_size, logits.stride(0), num_chunks,
        CHUNK=chunk, BLOCK=block, num_warps=4,
    )
    winner = best_val.argmax(dim=1, keepdim=True)
    return best_idx.gather(1, winner).squeeze(1).to(torch.int64)
