"""Triton sampling kernels: every pass reads the logits once and never sorts the vocabulary.

`sample` draws each row's token by Gumbel-max: argmax(x / T + G) over the tokens with x >= the row's
threshold, G = -log(E), E ~ Exp(1), is an exact draw from softmax(x / T) restricted to those tokens.
Rows with temperature 0 take the plain argmax. Ties go to the lowest index, as torch.argmax.
The noise of token j in a row is Philox(key, j): each row brings its own key (a request's seed and the
position it samples, or a per-step random one), so a seeded row draws the same token wherever it sits
in whatever batch.

`candidates` finds, in one pass, each row's K largest logits with their ids (top-k, top-p and
log-probs need no more) and the softmax normalizers; `exact_thresholds` is the exact fallback for a
row whose top-k or top-p boundary lies beyond its candidates: a bisection over the float order, one
pass a step. A flat or tied row can overflow its candidate buffer (a partial set): its log-probs' top k
then come from the row itself (`_exact_top`, one pass a place), chosen on the device by the row's count.

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
def _chunk_argmax_kernel(logits_ptr, temperatures_ptr, thresholds_ptr, keys_ptr, skip_ptr, best_val_ptr,
                         best_idx_ptr, vocab_size, stride_row, num_chunks,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr, HAS_SKIP: tl.constexpr,
                         HAS_THRESHOLDS: tl.constexpr):
    """Each step takes BLOCK logits as four quarter tiles, so that one Philox call (four numbers)
    serves four logits: the random numbers, not the memory reads, bound this kernel."""
    QUARTER: tl.constexpr = BLOCK // 4
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if HAS_SKIP:
        if tl.load(skip_ptr + row) != 0:
            return
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    threshold = tl.load(thresholds_ptr + row) if HAS_THRESHOLDS else float("-inf")
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


@triton.jit
def _pick_kernel(best_val_ptr, best_idx_ptr, tokens_ptr, num_chunks, CHUNKS_PAD: tl.constexpr):
    """A row's token: the best of its chunks' winners (the lowest chunk on a tie, as argmax would)."""
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS_PAD)
    ok = chunks < num_chunks
    values = tl.load(best_val_ptr + row * num_chunks + chunks, mask=ok, other=float("-inf"))
    top = tl.max(values, 0)
    winner = tl.min(tl.where(ok & (values == top), chunks, CHUNKS_PAD), 0)
    token = tl.load(best_idx_ptr + row * num_chunks + winner)
    tl.store(tokens_ptr + row, token.to(tl.int64))


def _grid_sizes(vocab_size: int, chunk: int, block: int) -> tuple[int, int, int]:
    chunk = max(64, min(chunk, triton.next_power_of_2(vocab_size)))
    block = min(block, chunk)
    return chunk, block, triton.cdiv(vocab_size, chunk)


def sample(logits: torch.Tensor, temperatures: torch.Tensor, thresholds: torch.Tensor | None = None,
           keys: torch.Tensor | None = None, skip: torch.Tensor | None = None, chunk: int = 8192,
           block: int = 1024) -> torch.Tensor:
    """Token ids [rows] (int64) drawn from softmax(logits / temperature) over the tokens with
    logits >= thresholds (none dropped by default), argmax where temperature is 0. keys: int64 Philox
    keys per row (default: random from torch's generator, so torch.manual_seed repeats a run). Rows
    whose `skip` flag is set are not drawn (their result is undefined)."""
    rows, vocab_size = logits.shape
    assert logits.stride(1) == 1 and temperatures.shape == (rows,)
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    chunk, block, num_chunks = _grid_sizes(vocab_size, chunk, block)
    device = logits.device
    if keys is None:
        keys = torch.randint(0, 2 ** 62, (rows,), dtype=torch.int64, device=device)
    # few launches and tensors: a lone sequence's decode step is bound by the host's work
    best_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    best_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=device)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    _chunk_argmax_kernel[(rows, num_chunks)](
        logits, temperatures.to(torch.float32), None if thresholds is None else thresholds.to(torch.float32),
        keys, skip, best_val, best_idx, vocab_size, logits.stride(0), num_chunks, CHUNK=chunk, BLOCK=block,
        HAS_SKIP=skip is not None, HAS_THRESHOLDS=thresholds is not None, num_warps=4,
    )
    _pick_kernel[(rows,)](best_val, best_idx, tokens, num_chunks, CHUNKS_PAD=triton.next_power_of_2(num_chunks),
                          num_warps=1)
    return tokens


# ---- candidates: each row's largest logits and its softmax normalizers, in two light passes --------
@triton.jit
def _order_key(x):
    """float32 -> int32 with the same order (negative floats have their magnitude bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _from_order_key(key):
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["rows"])     # batch sizes vary: one compiled variant for all
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
    values = bits.view(torch.float32).masked_fill(packed == MIN_INT64, float("-inf"))   # a pad's bits are a NaN's
    return values, 2147483647 - (packed & 0xFFFFFFFF)


def _chunk_size(vocab_size: int) -> int:
    """About 128 chunks a row (each chunk's max is one distinct element: k <= chunks of them bound the
    k-th largest from below), of 16 to 1024 logits."""
    return max(16, min(1024, triton.next_power_of_2(triton.cdiv(vocab_size, 128))))


def max_candidates(vocab_size: int) -> int:
    """The largest k that `candidates` serves (top-k and log-probs beyond it take the bisection)."""
    return min(64, triton.cdiv(vocab_size, _chunk_size(vocab_size)))


def gather_candidates(logits: torch.Tensor, temperatures: torch.Tensor, k: int, capacity: int = 512):
    """Two passes: per-chunk maxima and sums (stats [3, rows, chunks]); then every logit at least the
    k-th largest chunk maximum (floors: a lower bound of the k-th largest logit) is gathered, packed and
    unordered, into [rows, capacity] (counts: how many passed; more than capacity for a flat or tied row,
    whose buffer then holds a partial set)."""
    rows, vocab_size = logits.shape
    assert logits.stride(1) == 1 and 1 <= k <= max_candidates(vocab_size)
    chunk = _chunk_size(vocab_size)
    num_chunks = triton.cdiv(vocab_size, chunk)
    device = logits.device
    stats = torch.empty(3, rows, num_chunks, dtype=torch.float32, device=device)
    counts = torch.zeros(rows, dtype=torch.int32, device=device)
    packed = torch.full((rows, capacity), MIN_INT64, dtype=torch.int64, device=device)
    if rows:
        _row_stats_kernel[(rows, num_chunks)](logits, temperatures.to(torch.float32), stats, vocab_size,
                                              logits.stride(0), num_chunks, rows, CHUNK=chunk, num_warps=4)
    # a fresh tensor: a one-row view is already "contiguous" at an offset, and a pointer that is not
    # 16-byte aligned makes Triton compile another variant in the middle of a request (seen on an H100)
    floors = stats[0].topk(k, dim=1).values[:, -1].clone(memory_format=torch.contiguous_format)
    if rows:
        _gather_kernel[(rows, num_chunks)](logits, floors, counts, packed, vocab_size, logits.stride(0),
                                           CHUNK=chunk, CAPACITY=capacity, num_warps=4)
    return stats, floors, counts, packed


@triton.jit
def _exact_top(row_ptr, vocab_size, num_top, ids_ptr, values_ptr, shift, CHUNK: tl.constexpr):
    """A row's num_top largest logits, largest first, ties lowest id first (the candidates' order):
    ids, and values - shift. One pass over the row a place, each taking the largest packed (value, id)
    key below the last one taken. The slow path, for a row whose candidate buffer overflowed."""
    lanes = tl.arange(0, CHUNK)
    last = tl.max(tl.full([CHUNK], 9223372036854775807, dtype=tl.int64), 0)    # an int64 scalar for the loop
    for place in range(num_top):
        best = tl.full([CHUNK], -9223372036854775808, dtype=tl.int64)
        for start in range(0, vocab_size, CHUNK):
            offs = start + lanes
            inside = offs < vocab_size
            x = tl.load(row_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32)
            key = (_order_key(x).to(tl.int64) << 32) | (2147483647 - offs).to(tl.int64)
            best = tl.maximum(best, tl.where(inside & (key < last), key, -9223372036854775808))
        last = tl.max(best, 0)
        tl.store(ids_ptr + place, (2147483647 - (last & 0xFFFFFFFF)).to(ids_ptr.dtype.element_ty))
        tl.store(values_ptr + place, _from_order_key((last >> 32).to(tl.int32)) - shift)


@triton.jit(do_not_specialize=["k"])
def _exact_top_kernel(logits_ptr, counts_ptr, values_ptr, ids_ptr, vocab_size, stride_row, k,
                      CAPACITY: tl.constexpr, CHUNK: tl.constexpr):
    """For a row whose buffer overflowed (counts > CAPACITY), its sorted candidates become its exact
    top k, then -inf pads; other rows return at once."""
    row = tl.program_id(0)
    if tl.load(counts_ptr + row) > CAPACITY:
        out = row.to(tl.int64) * CAPACITY
        _exact_top(logits_ptr + row.to(tl.int64) * stride_row, vocab_size, k, ids_ptr + out, values_ptr + out,
                   0.0, CHUNK)
        rest = tl.arange(0, CAPACITY)
        tl.store(values_ptr + out + rest, float("-inf"), mask=rest >= k)
        tl.store(ids_ptr + out + rest, 2147483647, mask=rest >= k)


def _top_chunk(vocab_size: int) -> int:
    """_exact_top's tile: 1024 logits (8 int64 keys a thread at 4 warps)."""
    return min(1024, triton.next_power_of_2(vocab_size))


def candidates(logits: torch.Tensor, temperatures: torch.Tensor, k: int, capacity: int = 512):
    """(values, token ids, floors, complete, row max, log(sum(exp(x))), sum(exp((x - max) / T))): each
    row's largest logits, sorted descending (float32; ties: lowest id first; -inf pads), which are every
    logit >= floors[row], at least k of them, where complete[row]; where not (a flat or tied row
    overflowed the buffer), the row's exact top k, found in the row itself. Then whole-row statistics
    (T = 1 where it is 0). See gather_candidates."""
    stats, floors, counts, packed = gather_candidates(logits, temperatures, k, capacity)
    values, token_ids = unpack_candidates(packed.sort(dim=1, descending=True).values)
    rows, vocab_size = logits.shape
    if rows:    # no host sync: each program reads its row's count and returns at once where complete
        _exact_top_kernel[(rows,)](logits, counts, values, token_ids, vocab_size, logits.stride(0), k,
                                   CAPACITY=capacity, CHUNK=_top_chunk(vocab_size), num_warps=4)
    chunk_max, chunk_sum, chunk_sum_t = stats
    row_max = chunk_max.amax(dim=1, keepdim=True)
    inv_t = 1.0 / torch.where(temperatures == 0, 1.0, temperatures.float()).unsqueeze(1)
    log_z = row_max.squeeze(1) + (chunk_sum * torch.exp(chunk_max - row_max)).sum(1).log()
    z_t = (chunk_sum_t * torch.exp((chunk_max - row_max) * inv_t)).sum(1)
    return values, token_ids, floors, counts <= capacity, row_max.squeeze(1), log_z, z_t


@triton.jit
def _candidate_noise(key, ids, BLOCK: tl.constexpr):
    """Gumbel noise of these token ids exactly as _chunk_argmax_kernel gives it: token j is number
    (j % BLOCK) // (BLOCK / 4) of the four that Philox counter j // BLOCK * BLOCK / 4 + j % (BLOCK / 4) makes."""
    QUARTER: tl.constexpr = BLOCK // 4
    within = ids % BLOCK
    u0, u1, u2, u3 = tl.rand4x(key, (ids - within) // 4 + within % QUARTER)
    quarter = within // QUARTER
    return _gumbel(tl.where(quarter == 0, u0, tl.where(quarter == 1, u1, tl.where(quarter == 2, u2, u3))))


@triton.jit(do_not_specialize=["rows", "num_held", "num_top"])
def _finish_kernel(logits_ptr, packed_ptr, counts_ptr, floors_ptr, stats_ptr, temperatures_ptr, top_k_ptr,
                   top_p_ptr, min_p_ptr, keys_ptr, thresholds_ptr, settled_ptr, tokens_ptr, drawn_ptr,
                   top_ids_ptr, top_values_ptr, log_z_ptr, vocab_size, stride_row, num_chunks, rows, num_held,
                   num_top, CAPACITY: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
                   TOP_CHUNK: tl.constexpr, LOGPROBS: tl.constexpr, HAS_FILTERS: tl.constexpr):
    """One program a row, on its gathered candidates: log(Z) and the top num_top (log-probs; from the
    row itself where its buffer overflowed); the filters' threshold (the rules of
    layers/logits_processor.thresholds_from_candidates) and whether the candidates settle it; and when
    every token it keeps is a candidate, the draw itself."""
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS)
    plane = rows * num_chunks
    on = c < num_chunks
    chunk_max = tl.load(stats_ptr + row * num_chunks + c, mask=on, other=float("-inf"))
    m = tl.max(chunk_max, 0)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0.0
    t = tl.where(greedy, 1.0, temperature)
    idx = tl.arange(0, CAPACITY)
    packed = tl.sort(tl.load(packed_ptr + row.to(tl.int64) * CAPACITY + idx), descending=True)
    values = tl.where(packed == -9223372036854775808, float("-inf"),
                      _from_order_key((packed >> 32).to(tl.int32)))
    ids = (2147483647 - (packed & 0xFFFFFFFF)).to(tl.int32)
    complete = tl.load(counts_ptr + row) <= CAPACITY    # else the buffer holds some of the logits >= floor
    if LOGPROBS:
        chunk_sum = tl.load(stats_ptr + plane + row * num_chunks + c, mask=on, other=0.0)
        log_z = m + tl.log(tl.sum(chunk_sum * tl.exp(chunk_max - m), 0))
        tl.store(log_z_ptr + row, log_z)
        if complete:
            top = idx < num_top
            tl.store(top_ids_ptr + row * num_top + idx, ids, mask=top)
            tl.store(top_values_ptr + row * num_top + idx, values - log_z, mask=top)
        else:   # the largest may be among those left out: num_top passes over the row find them
            _exact_top(logits_ptr + row.to(tl.int64) * stride_row, vocab_size, num_top,
                       top_ids_ptr + row * num_top, top_values_ptr + row * num_top, log_z, TOP_CHUNK)
    if HAS_FILTERS:
        chunk_sum_t = tl.load(stats_ptr + 2 * plane + row * num_chunks + c, mask=on, other=0.0)
        z_t = tl.sum(chunk_sum_t * tl.exp((chunk_max - m) / t), 0)
        floor = tl.load(floors_ptr + row)
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        floor_min_p = tl.where(min_p > 0.0, m + t * tl.log(tl.where(min_p > 0.0, min_p, 1.0)), float("-inf"))
        kth = tl.max(tl.where(idx == top_k - 1, values, float("-inf")), 0)
        threshold = tl.where(top_k > 0, tl.maximum(floor_min_p, kth), floor_min_p)
        k_ok = (top_k == 0) | ((top_k <= num_held) & complete)     # the k-th largest is a candidate
        weights = tl.where(values >= threshold, tl.exp((values - m) / t), 0.0)
        cumulative = tl.cumsum(weights, 0)
        kept_mass = tl.sum(weights, 0)
        inside = complete & (threshold >= floor)
        total = tl.where(inside, kept_mass, z_t)
        boundary = tl.minimum(tl.sum((cumulative < top_p * total).to(tl.int32), 0), CAPACITY - 1)
        at_boundary = tl.max(tl.where(idx == boundary, values, float("-inf")), 0)
        has_p = top_p < 1.0
        p_ok = (top_p >= 1.0) | inside | ((threshold == float("-inf")) & complete & (kept_mass >= top_p * total))
        threshold = tl.where(has_p & p_ok, tl.maximum(threshold, at_boundary), threshold)
        settled = k_ok & p_ok
        tl.store(thresholds_ptr + row, tl.where(settled, threshold, floor_min_p))
        tl.store(settled_ptr + row, settled.to(tl.int32))
        drawn = settled & complete & (threshold >= floor) & (threshold > float("-inf"))
        score = tl.where(values >= threshold, values / t, float("-inf"))
        if not greedy:
            score += _candidate_noise(tl.load(keys_ptr + row), ids, BLOCK)
        best = tl.max(score, 0)
        tl.store(tokens_ptr + row, tl.min(tl.where(score == best, ids, 2147483647), 0).to(tl.int64))
        tl.store(drawn_ptr + row, drawn.to(tl.int32))


def filter_and_draw(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor,
                    top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                    filter_rows: torch.Tensor | None, num_top: int = 0, capacity: int = 512):
    """The GPU sampler's whole path after the penalties: candidates, one finishing kernel (log(Z) and
    the top num_top, the filters' thresholds, the draw for rows the candidates settle), the exact search
    for rows they do not, and the full-vocabulary draw for rows not drawn yet. Returns (tokens,
    thresholds or None, top ids, top logits - log(Z), log(Z)); the last three are None when no log-probs
    are asked (num_top -1). num_top must be at most max_candidates(vocab)."""
    rows, vocab_size = logits.shape
    device = logits.device
    has_filters = top_k is not None
    if not has_filters and num_top < 0:
        return sample(logits, temperatures, None, keys), None, None, None, None
    assert num_top <= max_candidates(vocab_size)
    k = max_candidates(vocab_size) if has_filters else max(num_top, 1)
    stats, floors, counts, packed = gather_candidates(logits, temperatures, k, capacity)
    num_chunks = stats.size(2)
    thresholds = torch.empty(rows, dtype=torch.float32, device=device)
    settled = torch.empty(rows, dtype=torch.int32, device=device)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    drawn = torch.zeros(rows, dtype=torch.int32, device=device)
    width = max(num_top, 1)
    top_ids = torch.empty(rows, width, dtype=torch.int32, device=device)
    top_values = torch.empty(rows, width, dtype=torch.float32, device=device)
    log_z = torch.empty(rows, dtype=torch.float32, device=device)
    dummy = thresholds
    _, block, _ = _grid_sizes(vocab_size, 8192, 1024)      # sample()'s noise layout
    if rows:
        _finish_kernel[(rows,)](
            logits, packed, counts, floors, stats, temperatures, top_k if has_filters else counts,
            top_p if has_filters else dummy, min_p if has_filters else dummy, keys, thresholds, settled,
            tokens, drawn, top_ids, top_values, log_z, vocab_size, logits.stride(0), num_chunks, rows, k,
            max(num_top, 0), CAPACITY=capacity, CHUNKS=triton.next_power_of_2(num_chunks), BLOCK=block,
            TOP_CHUNK=_top_chunk(vocab_size), LOGPROBS=num_top >= 0, HAS_FILTERS=has_filters, num_warps=4)
    if has_filters and filter_rows is not None:
        exact_thresholds(logits, filter_rows, temperatures, top_k, top_p, thresholds, settled)
    thresholds = thresholds if has_filters else None
    full = sample(logits, temperatures, thresholds, keys, skip=drawn)
    tokens = torch.where(drawn.bool(), tokens, full)
    if num_top < 0:
        return tokens, thresholds, None, None, None
    return tokens, thresholds, top_ids[:, :num_top].long(), top_values[:, :num_top], log_z


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
