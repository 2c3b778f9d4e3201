"""step_inputs.DecodeBlockTables: consecutive decode steps' block tables, kept as one array, are always the
tables the sequences hold, however the steps' batches and blocks change between them."""
import random

import numpy as np
import pytest

from nanovllm import SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_inputs import DecodeBlockTables, padded_block_tables


def kept_tables():
    """Tables of every width through the kept rows (narrow ones are converted afresh in the engine)."""
    tables = DecodeBlockTables()
    tables.CONVERT_WIDTH = 0
    return tables


def decode_step(tables, seqs):
    got = tables.build(seqs)
    assert got.dtype == np.int32
    assert got.tolist() == padded_block_tables(seqs)
    return got


def test_a_sequence_that_gains_a_block_gets_it_in_the_next_step():
    bm, tables = BlockManager(64, 4), kept_tables()
    a, b = Sequence(list(range(7)), SamplingParams(), 4), Sequence(list(range(4)), SamplingParams(), 4)
    bm.allocate(a), bm.allocate(b)
    decode_step(tables, [a, b])
    for _ in range(9):                     # b crosses block boundaries at 4 and 8 tokens, a at 8 and 12
        for seq in (a, b):
            seq.append_token(1)
            bm.may_append(seq)
        decode_step(tables, [a, b])
    assert len(a.block_table) == 4 and len(b.block_table) == 4


def test_lookahead_blocks_given_back_leave_no_trace():
    """Speculation's lookahead blocks are kept in one step and given back before the next: the next step's
    row ends where the sequence's blocks do, even when it is not the widest row."""
    bm, tables = BlockManager(64, 4), kept_tables()
    a, wide = Sequence(list(range(5)), SamplingParams(), 4), Sequence(list(range(40)), SamplingParams(), 4)
    bm.allocate(a), bm.allocate(wide)
    assert bm.reserve_lookahead(a, 8) == 8 and len(a.block_table) == 4
    decode_step(tables, [a, wide])
    bm.release_lookahead(a)
    assert len(a.block_table) == 2
    got = decode_step(tables, [a, wide])
    assert (got[0, 2:] == -1).all()


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_preemptions_and_lookahead_blocks(seed):
    """Sequences join and leave the batch and change order; lookahead blocks (speculation) come and go; a
    preempted sequence comes back with other blocks after a prefill, which clears the kept tables."""
    rng = random.Random(seed)
    bm, tables = BlockManager(2000, 4), kept_tables()
    seqs = []
    for step in range(300):
        event = rng.random()
        if event < 0.1 or not seqs:                                   # a new sequence (its prefill)
            seq = Sequence([1] * rng.randint(1, 30), SamplingParams(), 4)
            bm.allocate(seq)
            seqs.append(seq)
            tables.clear()
        elif event < 0.15:                                            # preempted and recomputed (a prefill)
            seq = rng.choice(seqs)
            bm.deallocate(seq)
            bm.free_block_ids.rotate(rng.randint(1, 50))              # comes back with other blocks
            bm.allocate(seq)
            tables.clear()
        elif event < 0.25 and len(seqs) > 1:                          # finished
            seq = seqs.pop(rng.randrange(len(seqs)))
            bm.deallocate(seq)
        elif event < 0.35:                                             # lookahead blocks given or given back
            seq = rng.choice(seqs)
            if len(seq.block_table) > seq.num_blocks:
                bm.release_lookahead(seq)
            else:
                bm.reserve_lookahead(seq, rng.randint(1, 9))
        for seq in seqs:                                              # one token each
            seq.append_token(1)
            bm.may_append(seq)
        rng.shuffle(seqs)
        decode_step(tables, rng.sample(seqs, rng.randint(1, len(seqs))))


def test_a_stale_table_is_caught():
    """The contract: a preempted sequence comes back through a prefill. Without clear(), a row whose first
    block changed is an error, not a silent read of another sequence's cache."""
    bm, tables = BlockManager(16, 4), kept_tables()
    a = Sequence(list(range(6)), SamplingParams(), 4)
    bm.allocate(a)
    decode_step(tables, [a])
    bm.deallocate(a)
    bm.free_block_ids.rotate(3)
    bm.allocate(a)
    with pytest.raises(AssertionError, match="stale"):
        tables.build([a])


def test_narrow_tables_are_converted_afresh_and_wide_ones_kept():
    bm, tables = BlockManager(256, 4), DecodeBlockTables()
    a = Sequence([1] * (4 * tables.CONVERT_WIDTH - 1), SamplingParams(), 4)
    bm.allocate(a)
    decode_step(tables, [a])
    assert not tables.rows                       # at CONVERT_WIDTH: nothing kept
    for _ in range(6):
        a.append_token(1)
        bm.may_append(a)
        decode_step(tables, [a])
    assert tables.rows == {a.seq_id: 0}
