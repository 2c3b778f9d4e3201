"""Triton sampling kernels: every pass reads the logits once and never sorts the vocabulary.

`sample` draws each row's token by Gumbel-max: argmax(x / T + G) over the tokens with x >= the row's
threshold, G = -log(E), E ~ Exp(1), is an exact draw from softmax(x / T) restricted to those tokens.
Rows with temperature 0 take the plain argmax. Ties go to the lowest index, as torch.argmax.
The noise of token j in a row is Philox(key, j): each row brings its own key (a request's seed and the
position it samples, or a per-step random one), so a seeded row draws the same token wherever it sits
in whatever batch.

`candidates` finds, in one pass, each row's K largest logits with their ids (top-k, top-p and
log-probs need no more) and the softmax normalizers; `top_p_thresholds` is the exact fallback for a
row whose top-p boundary lies beyond its candidates: a bisection over the float order, one pass a step.

Grids are (rows, chunks of the vocabulary): a few hundred rows would leave most SMs idle with one
program per row, so each program scans one chunk and a tiny torch reduction merges the chunks.
"""
import torch
import triton
import triton.language as tl

MIN_INT64 = -(2 ** 63)


@triton.jit
def _gumbel(u):
    return -tl.log(tl.maximum(-tl.log(u), 1e-20))


@triton.jit
def _keep_best(best_val, best_idx, x, offs):
    better = x > best_val                   # strict: a lane's indices only grow, so ties keep the lowest
    return tl.where(better, x, best_val), tl.where(better, offs, best_idx)


@triton.jit
def _load_kept(row_ptr, offs, vocab_size, threshold, inv_t):
    x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
    return tl.where(x >= threshold, x * inv_t, float("-inf"))


@triton.jit
def _chunk_argmax_kernel(logits_ptr, temperatures_ptr, thresholds_ptr, keys_ptr, best_val_ptr, best_idx_ptr,
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
    threshold = tl.load(thresholds_ptr + row)
    key = tl.load(keys_ptr + row)

    best_val = tl.full([QUARTER], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([QUARTER], dtype=tl.int32)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, QUARTER)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs0 = start + lanes
        offs1, offs2, offs3 = offs0 + QUARTER, offs0 + 2 * QUARTER, offs0 + 3 * QUARTER
        x0 = _load_kept(row_ptr, offs0, vocab_size, threshold, inv_t)
        x1 = _load_kept(row_ptr, offs1, vocab_size, threshold, inv_t)
        x2 = _load_kept(row_ptr, offs2, vocab_size, threshold, inv_t)
        x3 = _load_kept(row_ptr, offs3, vocab_size, threshold, inv_t)
        if not greedy:
            u0, u1, u2, u3 = tl.rand4x(key, start // 4 + lanes)    # uniform in [0, 1)
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


def _grid_sizes(vocab_size: int, chunk: int, block: int) -> tuple[int, int, int]:
    chunk = max(64, min(chunk, triton.next_power_of_2(vocab_size)))
    block = min(block, chunk)
    return chunk, block, triton.cdiv(vocab_size, chunk)


def sample(logits: torch.Tensor, temperatures: torch.Tensor, thresholds: torch.Tensor | None = None,
           keys: torch.Tensor | None = None, chunk: int = 8192, block: int = 1024) -> torch.Tensor:
    """Token ids [rows] (int64) drawn from softmax(logits / temperature) over the tokens with
    logits >= thresholds (none dropped by default), argmax where temperature is 0. keys: int64 Philox
    keys per row (default: random from torch's generator, so torch.manual_seed repeats a run)."""
    rows, vocab_size = logits.shape
    assert logits.stride(1) == 1 and temperatures.shape == (rows,)
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    chunk, block, num_chunks = _grid_sizes(vocab_size, chunk, block)
    device = logits.device
    if thresholds is None:
        thresholds = torch.full((rows,), float("-inf"), device=device)
    if keys is None:
        keys = torch.randint(0, 2 ** 62, (rows,), dtype=torch.int64, device=device)
    best_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    best_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=device)
    _chunk_argmax_kernel[(rows, num_chunks)](
        logits, temperatures.to(torch.float32), thresholds.to(torch.float32), keys, best_val, best_idx,
        vocab_size, logits.stride(0), num_chunks, CHUNK=chunk, BLOCK=block, num_warps=4,
    )
    winner = best_val.argmax(dim=1, keepdim=True)
    return best_idx.gather(1, winner).squeeze(1).to(torch.int64)


# ---- candidates: each row's largest logits and its softmax normalizers, in two light passes --------
@triton.jit
def _order_key(x):
    """float32 -> int32 with the same order (negative floats have their magnitude bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _from_order_key(key):
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _row_stats_kernel(logits_ptr, temperatures_ptr, stats_ptr, vocab_size, stride_row, num_chunks, rows,
                      CHUNK: tl.constexpr):
    """Per (row, chunk): max m, sum(exp(x - m)) and sum(exp((x - m) / T))."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    inv_t = 1.0 / tl.where(temperature == 0.0, 1.0, temperature)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < vocab_size,
                other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    out = row * num_chunks + chunk
    plane = rows * num_chunks
    tl.store(stats_ptr + out, m)
    tl.store(stats_ptr + plane + out, tl.sum(tl.exp(x - m), 0))
    tl.store(stats_ptr + 2 * plane + out, tl.sum(tl.exp((x - m) * inv_t), 0))


@triton.jit
def _gather_kernel(logits_ptr, floors_ptr, counts_ptr, packed_ptr, vocab_size, stride_row,
                   CHUNK: tl.constexpr, CAPACITY: tl.constexpr):
    """Append every logit >= its row's floor to the row's buffer, packed as (order key << 32 | ~id) so
    that one int64 comparison orders by value, then by lowest id. Few pass the floor: the atomics are rare."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < vocab_size,
                other=float("-inf")).to(tl.float32)
    keep = x >= tl.load(floors_ptr + row)
    if tl.sum(keep.to(tl.int32), 0) > 0:
        slot = tl.atomic_add(counts_ptr + row + tl.zeros([CHUNK], dtype=tl.int32), 1, mask=keep)
        packed = (_order_key(x).to(tl.int64) << 32) | (2147483647 - offs).to(tl.int64)
        tl.store(packed_ptr + row.to(tl.int64) * CAPACITY + slot, packed, mask=keep & (slot < CAPACITY))


def unpack_candidates(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float32, token ids int64) from the packed int64 keys."""
    key = (packed >> 32).to(torch.int32)
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return bits.view(torch.float32), 2147483647 - (packed & 0xFFFFFFFF)


def _chunk_size(vocab_size: int) -> int:
    """About 128 chunks a row (each chunk's max is one distinct element: k <= chunks of them bound the
    k-th largest from below), of 16 to 1024 logits."""
    return max(16, min(1024, triton.next_power_of_2(triton.cdiv(vocab_size, 128))))


def max_candidates(vocab_size: int) -> int:
    """The largest k that `candidates` serves (top-k and log-probs beyond it take the bisection)."""
    return min(64, triton.cdiv(vocab_size, _chunk_size(vocab_size)))


def candidates(logits: torch.Tensor, temperatures: torch.Tensor, k: int, capacity: int = 512):
    """(values, token ids, floors, complete, row max, log(sum(exp(x))), sum(exp((x - max) / T))): each
    row's largest logits, sorted descending (float32; ties: lowest id first; -inf pads), which are every
    logit >= floors[row], at least k of them, where complete[row]; then whole-row statistics (T = 1 where
    it is 0).

    Two passes: per-chunk maxima and sums; then every logit at least the k-th largest chunk maximum
    (a lower bound of the k-th largest logit) is gathered. `complete` is False for a row with more than
    `capacity` such logits (a flat or tied row); its candidates are then a partial set."""
    rows, vocab_size = logits.shape
    assert logits.stride(1) == 1 and 1 <= k <= max_candidates(vocab_size)
    chunk = _chunk_size(vocab_size)
    num_chunks = triton.cdiv(vocab_size, chunk)
    device = logits.device
    temperatures = temperatures.to(torch.float32)
    stats = torch.empty(3, rows, num_chunks, dtype=torch.float32, device=device)
    counts = torch.zeros(rows, dtype=torch.int32, device=device)
    packed = torch.full((rows, capacity), MIN_INT64, dtype=torch.int64, device=device)
    if rows:
        _row_stats_kernel[(rows, num_chunks)](logits, temperatures, stats, vocab_size, logits.stride(0),
                                              num_chunks, rows, CHUNK=chunk, num_warps=4)
    chunk_max, chunk_sum, chunk_sum_t = stats
    floors = chunk_max.topk(k, dim=1).values[:, -1].contiguous()
    if rows:
        _gather_kernel[(rows, num_chunks)](logits, floors, counts, packed, vocab_size, logits.stride(0),
                                           CHUNK=chunk, CAPACITY=capacity, num_warps=4)
    values, token_ids = unpack_candidates(packed.sort(dim=1, descending=True).values)
    row_max = chunk_max.amax(dim=1, keepdim=True)
    inv_t = 1.0 / torch.where(temperatures == 0, 1.0, temperatures).unsqueeze(1)
    log_z = row_max.squeeze(1) + (chunk_sum * torch.exp(chunk_max - row_max)).sum(1).log()
    z_t = (chunk_sum_t * torch.exp((chunk_max - row_max) * inv_t)).sum(1)
    return values, token_ids, floors, counts <= capacity, row_max.squeeze(1), log_z, z_t


# ---- exact thresholds by bisection, for rows their candidates do not settle --------------------------
@triton.jit
def _weight_at_least(row_ptr, vocab_size, t, m, inv_t, BY_COUNT: tl.constexpr, CHUNK: tl.constexpr):
    """How many logits are >= t (BY_COUNT), or their unnormalized probability mass."""
    total = 0.0
    for start in range(0, vocab_size, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        if BY_COUNT:
            weight = tl.where(x >= t, 1.0, 0.0)
        else:
            weight = tl.where(x >= t, tl.exp((x - m) * inv_t), 0.0)
        total += tl.sum(weight, 0)
    return total


@triton.jit
def _bisect(row_ptr, vocab_size, lo, hi, target, m, inv_t, BY_COUNT: tl.constexpr, CHUNK: tl.constexpr):
    """The largest order key t in [lo, hi] with weight(x >= t) >= target (lo when none above it is):
    32 halvings of the int32 key range pin one exact float."""
    for _ in range(33):
        if lo < hi:
            mid = lo + (hi - lo + 1) // 2
            t = _from_order_key(mid.to(tl.int32))
            if _weight_at_least(row_ptr, vocab_size, t, m, inv_t, BY_COUNT, CHUNK) >= target:
                lo = mid
            else:
                hi = mid - 1
    return lo


@triton.jit
def _thresholds_kernel(logits_ptr, rows_ptr, temperatures_ptr, top_k_ptr, top_p_ptr, thresholds_ptr, done_ptr,
                       vocab_size, stride_row, CHUNK: tl.constexpr):
    row = tl.load(rows_ptr + tl.program_id(0))
    if tl.load(done_ptr + row) == 0:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        temperature = tl.load(temperatures_ptr + row)
        inv_t = 1.0 / tl.where(temperature == 0.0, 1.0, temperature)
        m = float("-inf")
        for start in range(0, vocab_size, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, tl.max(x, 0))
        lo = _order_key(tl.load(thresholds_ptr + row)).to(tl.int64)
        hi = _order_key(m).to(tl.int64)
        top_k = tl.load(top_k_ptr + row)
        if top_k > 0:
            lo = _bisect(row_ptr, vocab_size, lo, hi, top_k.to(tl.float32), m, inv_t, True, CHUNK)
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:
            floor = _from_order_key(lo.to(tl.int32))
            target = top_p * _weight_at_least(row_ptr, vocab_size, floor, m, inv_t, False, CHUNK)
            lo = _bisect(row_ptr, vocab_size, lo, hi, target, m, inv_t, False, CHUNK)
        tl.store(thresholds_ptr + row, _from_order_key(lo.to(tl.int32)))


def exact_thresholds(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, thresholds: torch.Tensor, done: torch.Tensor, chunk: int = 4096) -> None:
    """For each row in `rows` whose `done` flag is 0, raise thresholds[row] (float32, in place; the
    min-p threshold or -inf on entry) to the row's exact top-k, then top-p boundary among the logits
    >= it. One program a row, ~33 passes over it per filter: the slow path, for rows that need it.
    `done` is read on the device, so nothing waits for the host."""
    if rows.numel():
        _thresholds_kernel[(rows.numel(),)](
            logits, rows, temperatures.to(torch.float32), top_k.to(torch.int32), top_p.to(torch.float32),
            thresholds, done.to(torch.int32), logits.shape[1], logits.stride(0),
            CHUNK=min(chunk, triton.next_power_of_2(logits.shape[1])), num_warps=8,
        )
