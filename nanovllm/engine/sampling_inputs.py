"""A step's sampling inputs (SamplingTensors), built on rank 0 from its sequences apart from the
attention inputs (step_inputs.py): temperatures, filters, random keys, banned tokens, and the penalized
rows with where their state lies in PenaltyState (penalty_state.py).

Random keys: a seeded request's row draws with a key made of its seed, its place among the request's
n completions and the position of the token it samples, so it draws the same token wherever it sits,
whatever else runs, through preemption and recomputation. Other rows take keys from one random number
per step (torch's CPU generator: torch.manual_seed repeats a run).
"""
import numpy as np
import torch

from nanovllm.engine.penalty_state import PenaltyState
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import Penalties, SamplingTensors
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.transfer import arrays_to_device, to_device

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: nearby inputs give unrelated 64-bit outputs."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def seeded_key(seed: int, index: int, position: int) -> int:
    """The Philox key of the token at `position` of completion `index` of a request seeded `seed`."""
    return _mix(_mix(_mix(seed & _MASK64) ^ index) ^ position) >> 2     # < 2**62: fits int64 and torch seeds


def _plain_greedy(p: SamplingParams) -> bool:
    """Greedy, and nothing that edits or reports on the logits but min_tokens' bans (allowed tokens, logit
    bias, penalties, log-probs)."""
    return p.greedy and p.logprobs is None and not p.has_penalties and not p.edits_logits


def argmax_suffices(seqs: list[Sequence]) -> bool:
    """Whether each of these sequences' next tokens (and, in a verification, the tokens after its drafts) is
    simply its logits' argmax: greedy, and nothing edits or reports on the logits (penalties, min_tokens'
    bans, log-probs; structured outputs' masks are the caller's to rule out). The sampler's draw would be
    that argmax (ties: the lowest id, as torch.argmax), so its inputs need not be built.

    Asked every step of every batch: a sampled first row answers at once (the inputs are built next, walking
    the rows themselves); else the params are checked once per distinct SamplingParams (a batch usually
    shares one), the rows walked again only where some params have min_tokens."""
    if seqs and not _plain_greedy(seqs[0].sampling_params):
        return False
    distinct = {id(seq.sampling_params): seq.sampling_params for seq in seqs}.values()
    if not all(_plain_greedy(p) for p in distinct):
        return False
    return not any(p.min_tokens for p in distinct) or all(
        seq.sampling_params.min_tokens <= seq.num_completion_tokens for seq in seqs)


def build_sampling_tensors(seqs: list[Sequence], logits_rows: list[int] | None, vocab_size: int,
                           eos_token_ids: frozenset[int], penalty_state: PenaltyState,
                           device: torch.device, offsets: list[int] | None = None
                           ) -> tuple[SamplingTensors, torch.Tensor | None]:
    """The step's SamplingTensors, and the state rows of its penalized rows (to count their tokens).
    offsets (speculative decoding's verification, see build_verify_tensors): row i samples the token
    offsets[i] places after seqs[i]'s next one (its seeded key and min_tokens go by that position).

    Runs every step for up to hundreds of rows, so each feature is looked up once per distinct
    SamplingParams (a batch usually shares one) and only the features present walk the rows."""
    n = len(seqs)
    ahead = offsets or [0] * n
    params = [seq.sampling_params for seq in seqs]
    distinct = list({id(p): p for p in params}.values())

    def column(value) -> np.ndarray | list:
        return np.full(n, value(distinct[0])) if len(distinct) == 1 else [value(p) for p in params]

    # temperature, top_p, min_p: rows padded to 16 bytes, since Triton compiles a variant per pointer
    # alignment and a batch size that moved the rows' starts would make the first steps wait for compiles
    width = -(-n // 4) * 4
    floats = np.zeros((3, width), dtype=np.float32)
    floats[0, :n] = column(lambda p: p.temperature)
    keys = int(torch.randint(0, 2 ** 62 - 2 ** 20, (1,))) + np.arange(n, dtype=np.int64)
    if any(p.seed is not None for p in distinct):
        for i, seq in enumerate(seqs):
            if params[i].seed is not None:
                keys[i] = seeded_key(params[i].seed, seq.index, seq.num_tokens + ahead[i])
    filtered = any(p.has_filters and not p.greedy for p in distinct)
    ints = np.zeros((1, n), dtype=np.int32)
    if filtered:
        floats[1, :n] = column(lambda p: 1.0 if p.greedy else p.top_p)
        floats[2, :n] = column(lambda p: 0.0 if p.greedy else p.min_p)
        ints[0] = column(lambda p: 0 if p.greedy else min(p.top_k, vocab_size))
    host = [floats, keys] + ([ints] if filtered else [])
    if logits_rows is not None:
        host.append(np.array(logits_rows, dtype=np.int64))
    # one pinned copy for them all, queued behind the step
    floats, keys, *rest = arrays_to_device(host, device)
    tensors = SamplingTensors(temperatures=floats[0, :n], keys=keys)
    if filtered:
        ints, *rest = rest
        tensors.top_p, tensors.min_p, tensors.top_k = floats[1, :n], floats[2, :n], ints[0]
        def searched(p: SamplingParams) -> bool:     # a row the exact search may have to settle
            return not p.greedy and (p.top_k > 0 or p.top_p < 1.0)
        if len(distinct) == 1:
            rows = np.arange(n) if searched(distinct[0]) else []
        else:
            rows = [i for i, p in enumerate(params) if searched(p)]
        tensors.filter_rows = to_device(np.array(rows, dtype=np.int32), device)
    if rest:
        tensors.logits_rows = rest[0]
    wanted = [p.logprobs for p in distinct if p.logprobs is not None]
    tensors.max_logprobs = max(wanted) if wanted else None

    if any(p.min_tokens for p in distinct):
        banned_rows, banned_ids = [], []
        for i, seq in enumerate(seqs):
            p = params[i]
            # this row samples completion token num_completion_tokens + ahead[i]
            if seq.num_completion_tokens + ahead[i] < p.min_tokens:
                stops = p.min_tokens_bans(eos_token_ids)
                banned_rows += [i] * len(stops)
                banned_ids += sorted(stops)
        if banned_rows:
            tensors.banned = tuple(to_device(np.array(a, dtype=np.int64), device) for a in (banned_rows, banned_ids))

    if any(p.edits_logits for p in distinct):
        _logit_edits(tensors, params, device)

    state_rows = None
    if any(p.has_penalties for p in distinct):
        # rows that sample a token (not a prompt chunk whose token is thrown away)
        penalized = [i for i, p in enumerate(params) if p.has_penalties
                     and seqs[i].num_cached_tokens + seqs[i].num_scheduled_tokens >= seqs[i].num_tokens]
        if penalized:
            state_rows = penalty_state.rows_for([seqs[i] for i in penalized])
            pick = [params[i] for i in penalized]
            # the weights' rows padded to 16 bytes, as the floats above (one compiled variant of the kernel)
            num = len(pick)
            weights = np.zeros((3, -(-num // 4) * 4), dtype=np.float32)
            weights[:, :num] = [[p.repetition_penalty for p in pick], [p.frequency_penalty for p in pick],
                                [p.presence_penalty for p in pick]]
            weights = to_device(weights, device)
            # the tables themselves: the penalties read each row's state where it lies
            tensors.penalties = Penalties(
                rows=to_device(np.array(penalized, dtype=np.int64), device), state_rows=state_rows,
                prompt_mask=penalty_state.prompt_mask, output_counts=penalty_state.output_counts,
                repetition=weights[0, :num], frequency=weights[1, :num], presence=weights[2, :num])
    # argmax_suffices, from the distinct params (min_tokens: no row is banned anything)
    tensors.argmax_only = tensors.banned is None and all(_plain_greedy(p) for p in distinct)
    return tensors, state_rows


def _logit_edits(tensors: SamplingTensors, params: list[SamplingParams], device: torch.device) -> None:
    """tensors.allowed and tensors.bias for the rows whose params have allowed_token_ids or logit_bias. A
    distinct params' allowed list travels once (rows that share it name its set), its bias once a row; the
    host arrays are built once per distinct params, not per row."""
    groups: dict[int, tuple[SamplingParams, list[int]]] = {}     # id(params) -> (params, its rows), first seen first
    for i, p in enumerate(params):
        if p.edits_logits:
            groups.setdefault(id(p), (p, []))[1].append(i)
    allowed, bias = [], []          # per distinct params: (rows, set index, ids) / (rows, ids, values)
    for p, row_list in groups.values():
        rows = np.array(row_list, dtype=np.int64)
        if p.allowed_token_ids:
            ids = np.array(p.allowed_token_ids, dtype=np.int64)
            allowed.append((rows, np.full(rows.size, len(allowed), dtype=np.int64),
                            np.full(ids.size, len(allowed), dtype=np.int64), ids))
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias))
            values = np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias))
            bias.append((np.repeat(rows, ids.size), np.tile(ids, rows.size), np.tile(values, rows.size)))
    if allowed:
        tensors.allowed = tuple(arrays_to_device([np.concatenate(column) for column in zip(*allowed)], device))
    if bias:
        tensors.bias = tuple(arrays_to_device([np.concatenate(column) for column in zip(*bias)], device))


def build_verify_tensors(seqs: list[Sequence], drafts: list[list[int]], vocab_size: int,
                         eos_token_ids: frozenset[int], penalty_state: PenaltyState,
                         device: torch.device) -> tuple[SamplingTensors, torch.Tensor | None]:
    """Speculative decoding's verification step: a row per token each sequence may gain (len(drafts[i]) + 1
    rows for seqs[i]), row j sampling as if drafts[i][:j] were already its output: the key of its token's
    position, min_tokens counted up to it, and penalties that count those drafts too (each penalized row
    reads a private copy of its sequence's state row, with its drafts before it added). Returns the
    tensors and the penalized rows' state rows in PenaltyState (to count the emitted tokens, as
    build_sampling_tensors does)."""
    row_seqs = [seq for seq, draft in zip(seqs, drafts) for _ in range(len(draft) + 1)]
    offsets = [j for draft in drafts for j in range(len(draft) + 1)]
    tensors, state_rows = build_sampling_tensors(row_seqs, None, vocab_size, eos_token_ids, penalty_state, device,
                                                 offsets)
    if tensors.penalties is None:
        return tensors, state_rows
    penalized = [i for i, seq in enumerate(row_seqs) if seq.sampling_params.has_penalties]
    row_drafts = [draft for draft in drafts for _ in range(len(draft) + 1)]
    prior = [(k, token) for k, i in enumerate(penalized) for token in row_drafts[i][:offsets[i]]]
    p = tensors.penalties
    counts = p.output_counts[p.state_rows]
    if prior:
        at = to_device(np.array(prior, dtype=np.int64).T.copy(), device)
        counts.index_put_((at[0], at[1]), torch.ones(len(prior), dtype=counts.dtype, device=device), accumulate=True)
    own = torch.arange(len(penalized), dtype=torch.int64, device=device)
    tensors.penalties = Penalties(rows=p.rows, state_rows=own, prompt_mask=p.prompt_mask[p.state_rows],
                                  output_counts=counts, repetition=p.repetition, frequency=p.frequency,
                                  presence=p.presence)
    return tensors, state_rows
