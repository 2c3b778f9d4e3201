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
def _gumbel(u):
    return -tl.log(tl.maximum(-tl.log(u), 1e-20))


@triton.jit
def _keep_best(best_val, best_idx, x, offs):
    better = x > best_val                   # strict: a lane's indices only grow, so ties keep the lowest
    return tl.where(better, x, best_val), tl.where(better, offs, best_idx)


@triton.jit
def _chunk_argmax_kernel(logits_ptr, temperatures_ptr, seed_ptr, best_val_ptr, best_idx_ptr,
                         vocab_size, stride_row, num_chunks,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Each step takes BLOCK logits as four quarter tiles, so that one Philox call (four numbers)
    serves four logits: the random numbers, not the memory reads, bound this kernel."""
    QUARTER: tl.constexpr = BLOCK // 4
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    seed = tl.load(seed_ptr)
    counter = row * (num_chunks * (CHUNK // 4))       # this row's first Philox counter

    best_val = tl.full([QUARTER], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([QUARTER], dtype=tl.int32)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, QUARTER)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs0 = start + lanes
        offs1, offs2, offs3 = offs0 + QUARTER, offs0 + 2 * QUARTER, offs0 + 3 * QUARTER
        x0 = tl.load(row_ptr + offs0, mask=offs0 < vocab_size, other=float("-inf")).to(tl.float32) * inv_t
        x1 = tl.load(row_ptr + offs1, mask=offs1 < vocab_size, other=float("-inf")).to(tl.float32) * inv_t
        x2 = tl.load(row_ptr + offs2, mask=offs2 < vocab_size, other=float("-inf")).to(tl.float32) * inv_t
        x3 = tl.load(row_ptr + offs3, mask=offs3 < vocab_size, other=float("-inf")).to(tl.float32) * inv_t
        if not greedy:
            u0, u1, u2, u3 = tl.rand4x(seed, counter + start // 4 + lanes)    # uniform in [0, 1)
            x0, x1, x2, x3 = x0 + _gumbel(u0), x1 + _gumbel(u1), x2 + _gumbel(u2), x3 + _gumbel(u3)
        best_val, best_idx = _keep_best(best_val, best_idx, x0, offs0)
        best_val, best_idx = _keep_best(best_val, best_idx, x1, offs1)
        best_val, best_idx = _keep_best(best_val, best_idx, x2, offs2)
        best_val, best_idx = _keep_best(best_val, best_idx, x3, offs3)

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
    chunk = max(64, min(chunk, triton.next_power_of_2(vocab_size)))
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
