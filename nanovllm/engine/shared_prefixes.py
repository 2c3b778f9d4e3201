"""Which rows of a decode step begin with the same KV pages, so that decode attention reads those pages once
for the group instead of once a row (kernels/decode_attention.py's shared prefix).

Rows share pages when the prefix cache handed them the same blocks (a system prompt, a few-shot preamble,
a document asked many questions) or when they are one request's n completions. Without grouping, each row
reads the shared pages again: 256 sequences over 8 prompts of 2,000 tokens read 2,000 keys a row where
8 x 2,000 are distinct (Qwen3-0.6B shape, H100: decode attention 88% of such a step).

A row's group covers whole pages before the one holding its newest token (that page may still be written).
Rows are grouped by the pages themselves, longest common run first: where a group's rows diverge after a
common run, it is split into the subgroups that agree longer (the rows in none of them a group of their own at
the common run) if they save more reads than the whole group at the shorter run does (one group per row: a row
reads one shared run, then its own keys).
"""
import numpy as np

# the decode step groups rows only when it saves at least this fraction of the step's key reads (below it,
# the group's kernel and the merge of partial results cost about what they save)
MIN_SAVED_FRACTION = 0.25


def shared_prefixes(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int, rows_per_item: int,
                    min_saved_fraction: float = MIN_SAVED_FRACTION
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(shared_lens [n], items [I, 3], members [M]) int32 for a decode step's rows (block_tables [n, width],
    padded with -1; context_lens [n]), or None where grouping saves too little.

    shared_lens[r]: the tokens at the start of row r's context that its group reads (whole pages; 0: none).
    items: (a member row, whose block table the group's pages are read through; the item's first index in
    `members`; its row count), each item at most rows_per_item rows of one group, a group's rows spread
    evenly over its items (so every item holds at least two when rows_per_item >= 3)."""
    n = len(context_lens)
    if n < 2:
        return None
    own_pages = (context_lens.astype(np.int64) - 1) // block_size
    groups: list[tuple[np.ndarray, int]] = []
    for rows in _partition(block_tables, np.flatnonzero(own_pages > 0), 0):
        groups.extend(_best_groups(block_tables, own_pages, rows, 0)[1])
    saved = sum((len(rows) - 1) * pages for rows, pages in groups) * block_size
    if not groups or saved < min_saved_fraction * float(context_lens.sum()):
        return None
    shared_lens = np.zeros(n, dtype=np.int32)
    items, first = [], 0
    for rows, pages in groups:
        shared_lens[rows] = pages * block_size
        num_items = -(-len(rows) // rows_per_item)
        counts = len(rows) // num_items + (np.arange(num_items) < len(rows) % num_items)
        starts = np.cumsum(counts) - counts
        items.append(np.stack([rows[starts], first + starts, counts], axis=1))
        first += len(rows)
    members = np.concatenate([rows for rows, _ in groups])
    return shared_lens, np.concatenate(items).astype(np.int32), members.astype(np.int32)


def _partition(block_tables: np.ndarray, rows: np.ndarray, col: int) -> list[np.ndarray]:
    """rows by their page at column col: the sets of two or more that hold the same page there."""
    pages = block_tables[rows, col]
    order = np.argsort(pages, kind="stable")
    pages = pages[order]
    same = pages[1:] == pages[:-1]
    if not same.any():              # the common case without a prefix cache hit: nothing shared
        return []
    bounds = np.flatnonzero(~same) + 1
    starts, ends = np.concatenate([[0], bounds]), np.concatenate([bounds, [len(rows)]])
    return [rows[order[start:end]] for start, end in zip(starts, ends) if end - start >= 2]


def _best_groups(block_tables: np.ndarray, own_pages: np.ndarray, rows: np.ndarray, col: int
                 ) -> tuple[int, list[tuple[np.ndarray, int]]]:
    """A grouping of `rows` (two or more, the same pages in columns [0, col]) and the page reads it saves:
    (pages saved, [(rows, shared pages)]). Each branch's own grouping is taken as it comes (not always the most
    saved overall: two rows may save more in the rest's group at the shorter run than in their own longer one)."""
    limit = int(own_pages[rows].min())
    run = block_tables[rows, col:limit]
    agree = (run == run[0]).all(axis=0)
    common = col + (int(np.argmin(agree)) if not agree.all() else limit - col)   # pages all of them share
    best = ((len(rows) - 1) * common, [(rows, common)])
    # the rows that go on past the common run (all of them where they diverge, else those longer than the
    # shortest): those that agree at its next page may share more
    longer = rows[own_pages[rows] > common]
    saved, groups, placed = 0, [], []
    for part in _partition(block_tables, longer, common):
        part_saved, part_groups = _best_groups(block_tables, own_pages, part, common)
        saved += part_saved
        groups.extend(part_groups)
        placed.extend(member for group_rows, _ in part_groups for member in group_rows)
    left = np.setdiff1d(rows, placed) if placed else rows   # the rest still share the common run
    if len(left) >= 2:
        saved += (len(left) - 1) * common
        groups.append((left, common))
    return (saved, groups) if saved > best[0] else best
