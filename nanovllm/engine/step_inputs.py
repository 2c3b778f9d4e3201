"""A step's model inputs, built from its sequences: the token ids and positions the model computes, and
the attention metadata (utils/context.py) that says where their K/V go in the paged cache and what each
token attends to. A prefill computes tokens [num_cached_tokens, num_cached_tokens + num_scheduled_tokens)
of each sequence; a decode computes each sequence's last token; speculative decoding's verification, each
sequence's last token and its drafts. And which of a prefill's rows predict which prompt tokens, for the
sequences that want their prompt's log-probs."""
import itertools

import numpy as np
import torch

from nanovllm.engine.sequence import PENDING, Sequence
from nanovllm.engine.shared_prefixes import shared_prefixes
from nanovllm.utils.context import set_context
from nanovllm.utils.transfer import list_to_device, to_device


def padded_block_tables(seqs: list[Sequence]) -> list[list[int]]:
    """Each seq's block table, padded with -1 to the longest one."""
    pad = [-1] * max(len(seq.block_table) for seq in seqs)
    return [seq.block_table + pad[len(seq.block_table):] for seq in seqs]


def prepare_prefill(seqs: list[Sequence], block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs for tokens [num_cached_tokens, num_cached_tokens + num_scheduled_tokens) of each seq."""
    input_ids, positions, slot_mapping = [], [], []
    cu_seqlens_q, cu_seqlens_k = [0], [0]
    max_seqlen_q = max_seqlen_k = 0
    bs = block_size
    for seq in seqs:
        start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
        input_ids.extend(seq[start:end])
        positions.extend(range(start, end))
        cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
        cu_seqlens_k.append(cu_seqlens_k[-1] + end)
        max_seqlen_q, max_seqlen_k = max(max_seqlen_q, end - start), max(max_seqlen_k, end)
        if not seq.block_table:      # warmup: nothing to store
            continue
        for i in range(start // bs, (end + bs - 1) // bs):
            first = seq.block_table[i] * bs
            slot_mapping.extend(range(first + max(start - i * bs, 0), first + min(end - i * bs, bs)))
    block_tables = None
    if cu_seqlens_k[-1] > cu_seqlens_q[-1]:    # some keys are already cached: attend through pages
        block_tables = list_to_device(padded_block_tables(seqs), torch.int32, device)
    input_ids = list_to_device(input_ids, torch.int64, device)
    positions = list_to_device(positions, torch.int64, device)
    set_context(True, list_to_device(cu_seqlens_q, torch.int32, device),
                list_to_device(cu_seqlens_k, torch.int32, device), max_seqlen_q, max_seqlen_k,
                list_to_device(slot_mapping, torch.int32, device), None, block_tables)
    return input_ids, positions


def prepare_decode(seqs: list[Sequence], block_size: int, device: torch.device, sampled: torch.Tensor,
                   sampled_rows: dict[int, int], shared_prefix_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each seq computes its last token, whose slot is the next free one of its last block. A last
    token still PENDING (sampled by the step before, not yet on the host) is read on the device: from
    `sampled`, the last step's tokens, at the row `sampled_rows` gives its sequence. shared_prefix_rows > 0:
    the rows whose contexts begin with the same pages are grouped (shared_prefixes.py), at most that many an
    item, where that saves enough reads (the context's shared_prefix; None otherwise).

    Runs every step (every millisecond for a lone sequence), so the columns are built as Python
    lists, read into numpy in one pass, and travel in one copy."""
    n = len(seqs)
    width = max(len(seq.block_table) for seq in seqs)
    tokens = [seq.last_token for seq in seqs]
    context_lens = [seq.num_tokens for seq in seqs]
    positions = [length - 1 for length in context_lens]
    slots = [seq.block_table[-1] * block_size + position % block_size for seq, position in zip(seqs, positions)]
    rows = sampled_rows                # a PENDING token's row in `sampled`; -1: on the host already
    sampled_rows = [rows[seq.seq_id] if token == PENDING else -1 for seq, token in zip(seqs, tokens)]
    block_tables = itertools.chain.from_iterable(seq.block_table + [-1] * (width - len(seq.block_table))
                                                 for seq in seqs)
    flat = np.fromiter(itertools.chain(tokens, positions, context_lens, slots, sampled_rows, itertools.repeat(0, n),
                                       block_tables), dtype=np.int32, count=6 * n + n * width)
    shared = None
    if n > 1 and shared_prefix_rows:
        shared = shared_prefixes(flat[6 * n:].reshape(n, width), flat[2 * n:3 * n], block_size, shared_prefix_rows)
    if n > 1:           # a lone sequence's order is the [0] already there (one stream's steps are host-bound)
        # by the keys each row reads itself (a group's shared pages are read by the group's programs)
        flat[5 * n:6 * n] = longest_first(flat[2 * n:3 * n] if shared is None else flat[2 * n:3 * n] - shared[0])
    tables_end = 6 * n + n * width
    if shared is not None:
        flat = np.concatenate([flat, shared[0], shared[1].reshape(-1), shared[2]])
    flat = to_device(flat, device)
    columns = flat[:6 * n].view(6, n)
    shared_prefix = None
    if shared is not None:
        num_items = len(shared[1])
        items_end = tables_end + n + 3 * num_items
        shared_prefix = (flat[tables_end:tables_end + n], flat[tables_end + n:items_end].view(num_items, 3),
                         flat[items_end:])
    set_context(False, slot_mapping=columns[3], context_lens=columns[2],
                block_tables=flat[6 * n:tables_end].view(n, width), decode_order=columns[5],
                shared_prefix=shared_prefix)
    if len(sampled) == n and sampled_rows == list(range(n)):
        input_ids = sampled             # the last step's batch again, every token pending: as sampled
    elif max(sampled_rows) >= 0:
        input_ids = torch.where(columns[4] >= 0, sampled[columns[4].clamp(min=0)], columns[0])
    else:
        input_ids = columns[0]
    return input_ids, columns[1]


def longest_first(context_lens: np.ndarray) -> np.ndarray:
    """The rows by context length, longest first (ties in row order): decode attention's program order, so
    that no long sequence is left to run alone at the end of its kernel (H100, Qwen3-8B shape, bench.py's
    contexts at 97-256 rows: 1-5% faster)."""
    return np.argsort(-context_lens, kind="stable")       # lengths < 2**31: negation stays in range


def segment_rows(seqs: list[Sequence], starts: list[int] | np.ndarray, counts: list[int] | np.ndarray,
                 block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Row by row, seqs[i]'s counts[i] tokens at positions starts[i] on: (each row's sequence, position, and
    KV slot from its sequence's block table), and the block tables padded with -1."""
    counts = np.asarray(counts, dtype=np.int64)
    rows = np.repeat(np.arange(len(seqs)), counts)
    firsts = np.cumsum(counts) - counts         # each sequence's first row
    positions = np.asarray(starts, dtype=np.int64)[rows] + np.arange(len(rows)) - firsts[rows]
    tables = np.array(padded_block_tables(seqs), dtype=np.int64)
    pages = tables[rows, positions // block_size]
    assert (pages >= 0).all(), "a token without a slot (a draft's must be reserved)"
    return rows, positions, pages * block_size + positions % block_size, tables


def prepare_segments(seqs: list[Sequence], starts: list[int], counts: list[int], block_size: int,
                     device: torch.device) -> torch.Tensor:
    """Attention metadata for seqs[i] computing counts[i] tokens at positions starts[i] on (their KV into
    the slots its block table gives them), attending to its cached KV before them: shaped as a prefill over
    cached prefixes (cu_seqlens, block tables), which the varlen attention reads as a chunked prefill's next
    chunk. Returns the positions; the caller supplies the tokens."""
    counts, starts = np.asarray(counts, dtype=np.int64), np.asarray(starts, dtype=np.int64)
    _, positions, slot_mapping, tables = segment_rows(seqs, starts, counts, block_size)
    cu_seqlens_q = np.concatenate([[0], np.cumsum(counts)])
    cu_seqlens_k = np.concatenate([[0], np.cumsum(starts + counts)])
    int32 = [to_device(a.astype(np.int32), device) for a in (cu_seqlens_q, cu_seqlens_k, slot_mapping, tables)]
    set_context(True, int32[0], int32[1], int(counts.max()), int((starts + counts).max()), int32[2], None, int32[3])
    return to_device(positions, device)


def prepare_verify(seqs: list[Sequence], drafts: list[list[int]], block_size: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative decoding's target step, shaped as a decode step of one row per token: each seq computes
    its last token and then its drafts, at positions num_tokens - 1 on (their K/V go to the slots
    reserve_lookahead gave it), and each row attends to its sequence's cached K/V up to its own position
    (a context length of its own over its sequence's block table). Every row's K/V is stored before any row
    attends, so a draft's row sees the rows before it; the decode kernels and the decode graphs serve it.
    The host waits on every such step, so its columns travel as one copy (as prepare_decode's)."""
    assert all(seq.last_token != PENDING for seq in seqs), "a verification step needs every token known"
    tokens = [t for seq, d in zip(seqs, drafts) for t in (seq.last_token, *d)]
    return _decode_rows(seqs, [seq.num_tokens - 1 for seq in seqs], [len(d) + 1 for d in drafts], block_size,
                        device, tokens)


def prepare_decode_rows(seqs: list[Sequence], starts: list[int], counts: list[int], block_size: int,
                        device: torch.device) -> torch.Tensor:
    """seqs[i] computing counts[i] tokens at positions starts[i] on, one decode row a token, each attending to
    its sequence's K/V up to its own position (as a verification's rows): a draft model's passes, which so
    replay its decode graphs. Returns the positions; the caller supplies the tokens."""
    return _decode_rows(seqs, starts, counts, block_size, device)[1]


def _decode_rows(seqs: list[Sequence], starts: list[int], counts: list[int], block_size: int, device: torch.device,
                 tokens: list[int] | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Sets the decode-row context of seqs[i]'s counts[i] tokens at starts[i] on; returns (the tokens on the
    device, if given, the positions), every column in one copy."""
    rows, positions, slots, tables = segment_rows(seqs, starts, counts, block_size)
    num_rows, width = len(rows), tables.shape[1]
    lead = 0 if tokens is None else num_rows
    flat = np.empty(lead + 4 * num_rows + num_rows * width, dtype=np.int32)     # as prepare_decode's
    flat[:lead] = tokens or []
    context_lens = positions + 1
    flat[lead:lead + num_rows] = positions
    flat[lead + num_rows:lead + 2 * num_rows] = context_lens
    flat[lead + 2 * num_rows:lead + 3 * num_rows] = slots
    flat[lead + 3 * num_rows:lead + 4 * num_rows] = longest_first(context_lens)
    flat[lead + 4 * num_rows:] = tables[rows].ravel()                # each row reads its sequence's block table
    flat = to_device(flat, device)
    context = flat[lead + num_rows:]
    set_context(False, slot_mapping=context[num_rows:2 * num_rows], context_lens=context[:num_rows],
                block_tables=context[3 * num_rows:].view(num_rows, width),
                decode_order=context[2 * num_rows:3 * num_rows])
    return (flat[:lead] if tokens is not None else None), flat[lead:lead + num_rows]


def prompt_logprob_targets(seqs: list[Sequence], computed: list[Sequence], wanted: list[tuple[int, int]]
                           ) -> tuple[list[tuple[int, int, int]], list[int], list[int]]:
    """Which rows of a prefill's hidden states predict which prompt tokens, for the sequences that want
    their prompt's log-probs (`wanted`: (index in seqs, k)): position p of a prompt of P tokens predicts
    token p + 1, for p < P - 1. Returns (spans, rows, targets): per wanted sequence, its first predicted
    token's index, how many, and its k; the rows (among `computed`'s tokens) and the tokens they predict."""
    offsets, offset = {}, 0
    for seq in computed:
        offsets[seq.seq_id] = offset
        offset += seq.num_scheduled_tokens
    rows, targets, spans = [], [], []
    for i, k in wanted:
        seq = seqs[i]
        start = seq.num_cached_tokens
        end = min(start + seq.num_scheduled_tokens, seq.num_prompt_tokens - 1)
        count = max(end - start, 0)
        spans.append((start + 1, count, k))
        if count:
            rows.extend(range(offsets[seq.seq_id], offsets[seq.seq_id] + count))
            targets.extend(seq.token_ids[start + 1:end + 1])
    return spans, rows, targets
