import pytest

from nanovllm import SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from block_invariants import check_invariants

pytestmark = pytest.mark.cpu_only     # host bookkeeping only

BS = 4


def seq_of(tokens):
    return Sequence(list(tokens), SamplingParams(), BS)


def computed(bm: BlockManager, seq: Sequence) -> Sequence:
    """Pretend a prefill computed every token: that is when full blocks get hashed."""
    seq.num_cached_tokens = seq.num_tokens
    bm.hash_blocks(seq)
    return seq


def test_allocate_takes_one_block_per_started_block_of_tokens():
    bm = BlockManager(8, BS)
    seq = seq_of(range(10))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and seq.num_cached_tokens == 0
    assert bm.num_free_blocks == 5
    check_invariants(bm, [seq])
    bm.deallocate(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    check_invariants(bm, [])


def test_cannot_allocate_beyond_the_pool():
    bm = BlockManager(2, BS)
    assert not bm.can_allocate(seq_of(range(9)))
    assert bm.can_allocate(seq_of(range(8)))


def test_only_full_computed_blocks_are_hashed():
    bm = BlockManager(8, BS)
    seq = seq_of(range(10))
    bm.allocate(seq)
    assert bm.hash_to_block_id == {}           # nothing computed yet: nothing to share
    computed(bm, seq)
    hashed = [bm.blocks[b].hash != -1 for b in seq.block_table]
    assert hashed == [True, True, False]       # the partial third block is not hashed


def test_hashes_are_chained_over_the_prefix():
    h0 = BlockManager.compute_hash([1, 2, 3, 4])
    assert BlockManager.compute_hash([5, 6, 7, 8], h0) != BlockManager.compute_hash([5, 6, 7, 8])
    assert BlockManager.compute_hash([5, 6, 7, 8], h0) == BlockManager.compute_hash([5, 6, 7, 8], h0)
    bm = BlockManager(16, BS)
    a = computed(bm, allocated(bm, seq_of([1, 2, 3, 4, 5, 6, 7, 8, 0])))
    b = seq_of([9, 9, 9, 9, 5, 6, 7, 8, 0])    # same second block after a different first one
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)


def allocated(bm, seq):
    bm.allocate(seq)
    return seq


def test_shared_prefix_hits_full_blocks_and_counts_references():
    bm = BlockManager(16, BS)
    a = computed(bm, allocated(bm, seq_of(range(10))))
    b = allocated(bm, seq_of(list(range(8)) + [99, 98, 97]))
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    check_invariants(bm, [a, b])
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    check_invariants(bm, [b])


def test_block_holding_the_last_token_is_never_a_hit():
    bm = BlockManager(16, BS)
    a = computed(bm, allocated(bm, seq_of(range(8))))
    b = allocated(bm, seq_of(range(8)))         # the same two full blocks
    assert b.num_cached_tokens == 4             # the last block is recomputed to get its logits
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_a_hash_hit_is_verified_against_the_tokens():
    bm = BlockManager(16, BS)
    a = computed(bm, allocated(bm, seq_of(range(10))))
    bm.blocks[a.block_table[0]].token_ids = [7, 7, 7, 7]   # as if another prefix collided on this hash
    b = allocated(bm, seq_of(range(10)))
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)


def test_freed_blocks_keep_their_prefix_and_can_be_revived():
    bm = BlockManager(4, BS)
    a = computed(bm, allocated(bm, seq_of(range(10))))
    old_table = list(a.block_table)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4
    b = seq_of(range(10))
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == old_table[:2] and b.num_cached_tokens == 8
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table)
    check_invariants(bm, [b])


def test_reusing_a_freed_block_forgets_its_old_prefix():
    bm = BlockManager(3, BS)
    a = computed(bm, allocated(bm, seq_of(range(9))))
    bm.deallocate(a)
    c = computed(bm, allocated(bm, seq_of([50 + i for i in range(12)])))   # takes all three blocks
    check_invariants(bm, [c])
    bm.deallocate(c)
    b = allocated(bm, seq_of(range(9)))
    assert b.num_cached_tokens == 0


def test_can_allocate_counts_shared_blocks_as_free_of_charge():
    bm = BlockManager(4, BS)
    a = computed(bm, allocated(bm, seq_of(range(9))))          # 3 blocks, 1 free
    b = seq_of(list(range(8)) + [1, 2, 3])                      # shares 2 blocks, needs 1 new
    assert bm.can_allocate(b)
    c = seq_of(list(range(4)) + [0] * 7)                        # shares 1 block, needs 2 new
    assert not bm.can_allocate(c)
    check_invariants(bm, [a])


def test_append_needs_a_new_block_only_when_the_last_token_starts_one():
    bm = BlockManager(3, BS)
    seq = allocated(bm, seq_of(range(4)))
    seq.num_cached_tokens = 4
    seq.append_token(4)                          # token 5 starts block 2
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 2
    seq.num_cached_tokens = 5
    seq.append_token(5)                          # still fits in block 2
    bm.may_append(seq)
    assert len(seq.block_table) == 2
    other = allocated(bm, seq_of([9]))           # the last free block
    for t in (6, 7, 8):
        seq.num_cached_tokens = len(seq)
        seq.append_token(t)
    assert len(seq) == 9 and not bm.can_append(seq)
    check_invariants(bm, [seq, other])


def test_decode_hashes_a_block_once_it_fills():
    bm = BlockManager(4, BS)
    seq = computed(bm, allocated(bm, seq_of(range(3))))
    for t in (3, 4):
        seq.append_token(t)
        bm.may_append(seq)
        seq.num_cached_tokens = len(seq)
        bm.hash_blocks(seq)
    assert bm.blocks[seq.block_table[0]].hash == BlockManager.compute_hash([0, 1, 2, 3])
    assert bm.blocks[seq.block_table[1]].hash == -1


def test_prefix_caching_off_never_hits():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    computed(bm, allocated(bm, seq_of(range(10))))
    assert bm.hash_to_block_id == {}
    assert allocated(bm, seq_of(range(10))).num_cached_tokens == 0


@pytest.mark.parametrize("n", [1, 4, 5])
def test_num_blocks_matches_token_count(n):
    bm = BlockManager(8, BS)
    assert len(allocated(bm, seq_of(range(n))).block_table) == (n + BS - 1) // BS


def test_num_forkable_counts_free_blocks_for_partial_copies_only():
    bm = BlockManager(5, BS)
    partial = allocated(bm, seq_of(range(6)))          # 2 blocks, the second partial: 3 free
    assert bm.num_forkable(partial, 10) == 3 and bm.num_forkable(partial, 2) == 2
    whole = allocated(bm, seq_of(range(8)))            # 2 whole blocks: forks copy nothing
    assert bm.num_forkable(whole, 10) == 10
    assert bm.can_fork(whole, 10) and not bm.can_fork(partial, 2)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("prompt_len, num_shared", [(9, 2), (3, 0)])
def test_share_prompt_holds_the_full_blocks_before_the_last_token(prefix_caching, prompt_len, num_shared):
    """A completion waiting to start holds the prompt's blocks that do not hold its last token (by
    reference, so without the prefix cache too) and, once allocated, computes only the rest."""
    bm = BlockManager(8, BS, prefix_caching)
    source = computed(bm, allocated(bm, seq_of(range(prompt_len))))
    shared = source.block_table[:num_shared]
    waiter = source.fork(1)
    bm.share_prompt(source, waiter)
    assert waiter.block_table == shared and waiter.num_cached_tokens == num_shared * BS
    check_invariants(bm, [source, waiter])
    bm.deallocate(source)                        # the prompt's full blocks outlive the completion that made them
    assert bm.num_free_blocks == 8 - num_shared
    assert bm.can_allocate(waiter)
    bm.allocate(waiter)
    assert waiter.block_table[:num_shared] == shared
    assert len(waiter.block_table) == waiter.num_blocks and waiter.num_cached_tokens == num_shared * BS
    check_invariants(bm, [waiter])
    bm.deallocate(waiter)
    assert bm.num_free_blocks == 8 and not bm.used_block_ids


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_share_prompt_copies_a_full_last_block_so_only_the_last_token_is_recomputed(prefix_caching):
    """A prompt that ends on a block boundary: the waiting completion shares the blocks before the last
    and gets its own copy of the last (to copy once the step that writes it has run), so when it starts
    it recomputes the prompt's last token alone, into a block nobody else reads. With no free block for
    the copy it shares the blocks before the last and recomputes the last block whole, as before."""
    bm = BlockManager(4, BS, prefix_caching)
    source = computed(bm, allocated(bm, seq_of(range(8))))      # 2 full blocks
    waiter = source.fork(1)
    copy = bm.share_prompt(source, waiter)
    assert copy == (source.block_table[1], waiter.block_table[1])
    assert waiter.block_table[0] == source.block_table[0] and waiter.num_cached_tokens == 7
    assert bm.blocks[waiter.block_table[1]].ref_count == 1 and len(waiter.block_table) == waiter.num_blocks
    check_invariants(bm, [source, waiter])
    bm.deallocate(source)
    assert bm.can_allocate(waiter)
    bm.allocate(waiter)                                  # nothing more to take: it holds every block
    assert waiter.num_cached_tokens == 7 and len(waiter.block_table) == 2
    check_invariants(bm, [waiter])
    bm.deallocate(waiter)
    assert bm.num_free_blocks == 4

    full = BlockManager(2, BS, prefix_caching)
    source = computed(full, allocated(full, seq_of(range(8))))  # the pool is full: no block for a copy
    waiter = source.fork(1)
    assert full.share_prompt(source, waiter) is None
    assert waiter.block_table == source.block_table[:1] and waiter.num_cached_tokens == BS


def test_a_waiting_completion_needs_free_blocks_for_its_prompts_tail_only():
    bm = BlockManager(3, BS)
    source = computed(bm, allocated(bm, seq_of(range(10))))      # 3 blocks: the pool is full
    waiter = source.fork(1)
    bm.share_prompt(source, waiter)
    assert not bm.can_allocate(waiter)
    bm.deallocate(source)                                        # the partial third block comes free
    assert bm.num_free_blocks == 1 and bm.can_allocate(waiter)


# ---- partial hits: a prompt that shares tokens with a cached block past its last full hit ----------------------
PAGE = 64                                  # partial hits need pages of PARTIAL_HIT_MIN_PAGE tokens or more


def page_seq(tokens, **kw):
    return Sequence(list(tokens), SamplingParams(**kw), PAGE)


def cached_source(bm: BlockManager, length: int = 3 * PAGE) -> Sequence:
    """A sequence computed by an earlier step: its full blocks are hashed, the next step may copy them."""
    bm.start_step()
    source = page_seq(range(1000, 1000 + length))
    bm.allocate(source)
    source.num_cached_tokens = source.num_tokens
    bm.hash_blocks(source)
    bm.start_step()
    return source


def test_a_prompt_sharing_part_of_a_cached_block_copies_it_and_computes_only_the_rest():
    bm = BlockManager(16, PAGE)
    assert bm.min_partial == PAGE // 8
    a = cached_source(bm)
    b = page_seq(list(a[:150]) + [7] * 30)             # 2 full blocks (128 tokens) and 22 of a's third
    assert bm.partial_hit(b) == (a.block_table[2], 22, False)
    assert bm.can_allocate(b)
    copy = bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert copy == (a.block_table[2], b.block_table[2])
    assert b.num_cached_tokens == 150                  # its step computes tokens 150..179 into its own copy
    check_invariants(bm, [a, b])


@pytest.mark.parametrize("length, cached", [(128 + PAGE // 8, 128), (128 + PAGE // 8 + 1, 128 + PAGE // 8)])
def test_a_partial_hit_needs_min_partial_tokens_and_leaves_the_last_token_to_compute(length, cached):
    bm = BlockManager(16, PAGE)
    a = cached_source(bm)
    b = page_seq(a[:length])                           # a prefix of a: it ends inside a's third block
    bm.allocate(b)
    assert b.num_cached_tokens == cached               # shared up to its last token: at least 8 of them
    check_invariants(bm, [a, b])


def test_the_same_prompt_again_recomputes_only_its_last_token():
    bm = BlockManager(16, PAGE)
    a = cached_source(bm)
    b = page_seq(a[:])
    assert bm.allocate(b) == (a.block_table[2], b.block_table[2]) and b.num_cached_tokens == 3 * PAGE - 1


def test_fewer_shared_tokens_than_min_partial_are_recomputed():
    bm = BlockManager(16, PAGE)
    a = cached_source(bm)
    b = page_seq(list(a[:128 + PAGE // 8 - 1]) + [7] * 20)
    assert bm.partial_hit(b) is None and bm.allocate(b) is None and b.num_cached_tokens == 128


def test_a_block_hashed_by_the_step_being_scheduled_is_flagged_not_copied():
    bm = BlockManager(16, PAGE)
    bm.start_step()
    a = page_seq(range(1000, 1000 + 3 * PAGE))
    bm.allocate(a)
    bm.hash_blocks(a, a.num_tokens)                    # as the scheduler does for a prompt it schedules now
    b = page_seq(list(a[:150]) + [7] * 30)
    assert bm.partial_hit(b) == (a.block_table[2], 22, True)     # the scheduler lets b wait a step
    bm.start_step()
    assert bm.partial_hit(b) == (a.block_table[2], 22, False)


def test_allocate_recomputes_what_a_block_hashed_by_the_step_being_scheduled_shares():
    bm = BlockManager(16, PAGE)
    bm.start_step()
    a = page_seq(range(1000, 1000 + 3 * PAGE))
    bm.allocate(a)
    bm.hash_blocks(a, a.num_tokens)
    b = page_seq(list(a[:150]) + [7] * 30)
    assert bm.allocate(b) is None and b.num_cached_tokens == 128     # not copied before the step writes it
    check_invariants(bm, [a, b])


def test_a_block_handed_out_again_or_never_written_is_no_partial_source():
    bm = BlockManager(3, PAGE)
    a = cached_source(bm)
    b = page_seq(list(a[:150]) + [7] * 30)
    bm.deallocate(a)
    assert bm.partial_hit(b) is not None               # freed, its content kept: still a source
    c = page_seq(range(5000, 5000 + 3 * PAGE))
    bm.allocate(c)                                     # takes every block, a's third among them
    assert bm.partial_hit(b) is None and bm.probes == {}
    bm.deallocate(c)
    d = cached_source(bm)
    d.num_cached_tokens = 0                            # as if its step was never launched
    bm.forget_unwritten(d)
    assert bm.partial_hit(page_seq(list(d[:150]) + [7] * 30)) is None and bm.probes == {}


@pytest.mark.parametrize("page, caching, prompt_logprobs", [(32, True, None), (PAGE, False, None), (PAGE, True, 1)])
def test_no_partial_hits_in_small_pages_without_the_prefix_cache_or_for_prompt_logprobs(page, caching,
                                                                                         prompt_logprobs):
    bm = BlockManager(32, page, caching)
    bm.start_step()
    a = Sequence(list(range(1000, 1000 + 3 * page)), SamplingParams(), page)
    bm.allocate(a)
    a.num_cached_tokens = a.num_tokens
    bm.hash_blocks(a)
    bm.start_step()
    b = Sequence(list(a[:2 * page + page // 2]) + [7] * 5, SamplingParams(prompt_logprobs=prompt_logprobs), page)
    assert bm.partial_hit(b) is None and bm.allocate(b) is None
    assert b.num_cached_tokens == (2 * page if caching and prompt_logprobs is None else 0)


# ---- a drafter whose K/V at a position read the token after it (EAGLE-3): reads_next_token ------------------------
def head_blocks(num_blocks: int = 16, block_size: int = BS) -> BlockManager:
    return BlockManager(num_blocks, block_size, reads_next_token=True)


def earlier(bm: BlockManager, seq: Sequence) -> Sequence:
    """seq allocated and computed by a step before the one being scheduled."""
    bm.start_step()
    computed(bm, allocated(bm, seq))
    bm.start_step()
    return seq


def test_a_block_records_the_token_after_it_once_known():
    bm = head_blocks()
    a = earlier(bm, seq_of(range(8)))                  # two whole blocks: the token after the second is unknown
    assert [bm.blocks[b].next_token for b in a.block_table] == [4, -1]
    a.append_token(42)                                 # its first sampled token arrives
    bm.hash_blocks(a)
    assert [bm.blocks[b].next_token for b in a.block_table[:2]] == [4, 42]
    check_invariants(bm, [a])


def test_a_block_followed_by_another_token_is_shared_but_for_its_last_position():
    """The cached block's last position read token 4 of a; b has 50 there: b copies the block and computes
    its position 3 again (a partial hit of all but the last token), whatever the page size."""
    bm = head_blocks()
    a = earlier(bm, seq_of(range(10)))
    b = seq_of([0, 1, 2, 3, 50, 51, 52])
    assert bm.partial_hit(b) == (a.block_table[0], BS - 1, False)
    assert bm.allocate(b) == (a.block_table[0], b.block_table[0])
    assert b.num_cached_tokens == BS - 1 and b.block_table[0] not in a.block_table
    c = seq_of(list(range(8)) + [60, 61])              # block 0 followed by a's token: shared; block 1 is not
    assert bm.allocate(c) == (a.block_table[1], c.block_table[1])
    assert c.block_table[0] == a.block_table[0] and c.num_cached_tokens == BS + BS - 1
    check_invariants(bm, [a, b, c])


def test_a_block_is_shared_whole_where_a_cached_copy_read_the_same_token():
    """Two blocks of one prefix that read different tokens after it: each prompt shares the one it matches."""
    bm = head_blocks()
    a = earlier(bm, seq_of(range(10)))
    b = seq_of([0, 1, 2, 3, 50, 51, 52])
    bm.allocate(b)
    computed(bm, b)                                    # its copy of block 0 now reads 50: the newest of the hash
    bm.start_step()
    again = allocated(bm, seq_of(range(10)))
    assert again.block_table[:2] == a.block_table[:2] and again.num_cached_tokens == 2 * BS
    like_b = allocated(bm, seq_of([0, 1, 2, 3, 50, 51, 52]))
    assert like_b.block_table[0] == b.block_table[0] and like_b.num_cached_tokens == BS
    check_invariants(bm, [a, b, again, like_b])


def test_a_block_whose_next_token_is_not_known_yet_is_copied():
    bm = head_blocks()
    a = earlier(bm, seq_of(range(8)))                  # its second block's next token: still to be sampled
    b = seq_of(list(range(8)) + [42, 43])
    assert bm.allocate(b) == (a.block_table[1], b.block_table[1]) and b.num_cached_tokens == 2 * BS - 1
    a.append_token(42)
    bm.hash_blocks(a)
    bm.start_step()
    c = allocated(bm, seq_of(list(range(8)) + [42, 44]))
    assert c.block_table[:2] == a.block_table[:2] and c.num_cached_tokens == 2 * BS
    check_invariants(bm, [a, b, c])


def test_a_partial_hit_stops_a_token_early_where_the_cached_next_token_differs():
    bm = head_blocks(16, PAGE)
    a = cached_source(bm)
    b = page_seq(list(a[:150]) + [7] * 30)             # shares 22 tokens of a's third block, then differs
    assert bm.partial_hit(b) == (a.block_table[2], 21, False)
    same = page_seq(a[:])                              # a again: the cached token after its 63 shared is its own
    assert bm.partial_hit(same) == (a.block_table[2], PAGE - 1, False)


def test_completions_split_off_copy_the_prompts_last_block_even_when_full():
    bm = head_blocks(5)
    whole = allocated(bm, seq_of(range(8)))            # 2 whole blocks, 3 free: one copy a completion
    assert bm.num_forkable(whole, 10) == 3
    child = whole.fork(1)
    assert bm.fork(whole, child) == (whole.block_table[1], child.block_table[1])
    assert child.block_table[0] == whole.block_table[0] and child.block_table[1] != whole.block_table[1]
    check_invariants(bm, [whole, child])


# ---- a position a drafter has not written yet (a draft model's last accepted draft) ------------------------------
def test_a_held_back_position_keeps_its_block_and_the_later_ones_unpublished_until_written():
    bm = BlockManager(16, BS)
    seq = allocated(bm, seq_of(range(14)))
    bm.hold_back(seq, 7)                               # the second block's last position
    computed(bm, seq)
    assert [bm.blocks[b].hash != -1 for b in seq.block_table] == [True, False, False, False]
    bm.drafter_wrote_from(seq, 8)                      # from a later position on: the hole is still there
    bm.hash_blocks(seq)
    assert bm.blocks[seq.block_table[1]].hash == -1
    bm.drafter_wrote_from(seq, 7)
    bm.hash_blocks(seq)
    assert [bm.blocks[b].hash != -1 for b in seq.block_table] == [True, True, True, False]
    check_invariants(bm, [seq])


def test_a_hold_ends_with_the_sequences_blocks():
    bm = BlockManager(16, BS)
    seq = allocated(bm, seq_of(range(10)))
    bm.hold_back(seq, 2)
    bm.deallocate(seq)                                 # preempted or finished: recomputed, if ever, whole
    assert not bm.held_back
    computed(bm, allocated(bm, seq))
    assert all(bm.blocks[b].hash != -1 for b in seq.block_table[:2])
