import logging
from types import SimpleNamespace

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.engine.scheduler import Scheduler, kv_room_hint
from nanovllm.engine.sequence import PENDING, Sequence, SequenceStatus

pytestmark = pytest.mark.cpu_only     # host bookkeeping only

BS = 4
EOS = 0


def scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024, prefix_caching=True):
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, eos_token_ids=frozenset({EOS}),
                             kvcache_block_size=BS, enable_prefix_caching=prefix_caching, speculative_config=None)
    return Scheduler(config, num_blocks)


def seq(length, first=1, **kw):
    return Sequence(list(range(first, first + length)), SamplingParams(**kw), BS)


def run_step(s: Scheduler, token=7):
    """One schedule + postprocess, as if the model sampled `token` for every sequence."""
    seqs, is_prefill = s.schedule()
    finished = s.postprocess(s.launched(seqs), [token] * len(seqs))
    return seqs, is_prefill, finished


def test_prefill_first_then_decode():
    s = scheduler()
    a, b = seq(5), seq(3, first=100)
    s.add(a), s.add(b)
    seqs, is_prefill = s.schedule()
    assert is_prefill and seqs == [a, b]
    assert [x.num_scheduled_tokens for x in seqs] == [5, 3]
    assert a.status == b.status == SequenceStatus.RUNNING
    s.postprocess(s.launched(seqs), [7, 8])
    assert a.completion_token_ids == [7] and b.completion_token_ids == [8]
    seqs, is_prefill = s.schedule()
    assert not is_prefill and seqs == [a, b] and all(x.num_scheduled_tokens == 1 for x in seqs)


def test_prefill_batch_respects_max_num_seqs():
    s = scheduler(max_num_seqs=2)
    for i in range(3):
        s.add(seq(2, first=10 * i + 1))
    seqs, is_prefill = s.schedule()
    assert is_prefill and len(seqs) == 2 and len(s.waiting) == 1
    s.postprocess(s.launched(seqs), [7, 7])
    seqs, is_prefill = s.schedule()          # running is full: the third waits, decode goes on
    assert not is_prefill and len(seqs) == 2


def test_token_budget_chunks_a_long_prompt():
    s = scheduler(max_num_batched_tokens=8)
    a, b = seq(5), seq(20, first=100)
    s.add(a), s.add(b)
    seqs, is_prefill = s.schedule()
    assert is_prefill and seqs == [a, b] and b.num_scheduled_tokens == 3   # 5 + 3 fills the budget
    assert s.waiting[0] is b and b.status == SequenceStatus.WAITING and len(b.block_table) == 5
    s.postprocess(s.launched(seqs), [7, 9])
    assert a.completion_token_ids == [7]
    assert b.completion_token_ids == [] and b.num_cached_tokens == 3      # a chunk samples nothing
    chunks = []
    while b.status == SequenceStatus.WAITING:
        seqs, is_prefill, _ = run_step(s)
        assert is_prefill and seqs == [b]
        chunks.append(seqs[0].num_cached_tokens)
    assert chunks == [11, 19, 20] and b.completion_token_ids == [7]


def test_preemption_takes_from_the_tail_and_requeues_at_the_head():
    s = scheduler(num_blocks=3)
    a, b, c = seq(4), seq(4, first=20), seq(4, first=40)
    for x in (a, b, c):
        s.add(x)
    run_step(s)                              # all three prefilled, one full block each
    assert s.block_manager.num_free_blocks == 0
    seqs, is_prefill = s.schedule()          # each needs a second block: only preemption frees one
    assert not is_prefill
    assert seqs == [a] and list(s.waiting) == [b, c]
    assert b.status == c.status == SequenceStatus.WAITING and not b.block_table and not c.block_table
    assert s.num_preemptions == 2


def test_a_lone_sequence_that_cannot_grow_is_preempted_itself():
    s = scheduler(num_blocks=2)
    a = seq(4)
    s.add(a)
    run_step(s)
    s.block_manager.allocate(seq(4, first=50))   # something else holds the last free block
    seqs, is_prefill = s.schedule()
    assert seqs == [] and not is_prefill and list(s.waiting) == [a] and not s.running


def test_a_waiting_sequence_starts_beside_running_ones_only_if_the_watermark_stays_free():
    """Else the next decode steps would preempt it again and recompute it, over and over; alone it starts
    whatever it leaves free."""
    s = scheduler(num_blocks=200, max_num_batched_tokens=1024)
    assert s.watermark_blocks == 2                              # 1% of the blocks
    a = seq(4 * 100)
    s.add(a)
    run_step(s)                                                 # a holds 100 blocks: 100 free
    b, c = seq(4 * 99, first=1000), seq(4 * 97, first=2000)
    s.add(b)
    seqs, is_prefill = s.schedule()                             # b would leave 1 free: it waits
    assert not is_prefill and seqs == [a] and list(s.waiting) == [b]
    s.postprocess(s.launched(seqs), [7])                        # a took its 101st block: 99 free
    s.waiting.clear()
    s.add(c)
    seqs, is_prefill = s.schedule()                             # c leaves 2 free: it starts
    assert is_prefill and seqs == [c] and s.block_manager.num_free_blocks == 2
    lone = scheduler(num_blocks=200, max_num_batched_tokens=1024)
    d = seq(4 * 199)
    lone.add(d)
    seqs, is_prefill = lone.schedule()
    assert is_prefill and seqs == [d] and lone.block_manager.num_free_blocks == 1


def test_preempted_sequence_recomputes_and_revives_its_cached_blocks():
    s = scheduler(num_blocks=3)
    a, b = seq(8), seq(3, first=30)
    s.add(a), s.add(b)
    run_step(s)
    s.schedule()                                  # a needs a 3rd block... b is preempted first
    assert list(s.waiting) == [b]
    s.postprocess(s.launched([a]), [5])
    s.preempt(a)
    seqs, is_prefill = s.schedule()
    assert is_prefill and seqs[0] is a and a.num_cached_tokens == 8   # two full blocks revived
    assert a.num_scheduled_tokens == len(a) - 8


def test_finish_on_eos_unless_ignored_and_blocks_are_freed():
    s = scheduler()
    a, b = seq(3), seq(3, first=20, ignore_eos=True)
    s.add(a), s.add(b)
    _, _, finished = run_step(s, token=EOS)
    assert finished == [a] and a.is_finished and not a.block_table
    assert b.status == SequenceStatus.RUNNING and list(s.running) == [b]


def test_finish_at_max_tokens_and_at_max_model_len():
    s = scheduler(max_model_len=6)
    a, b = seq(2, max_tokens=2), seq(3, first=20, max_tokens=100)
    s.add(a), s.add(b)
    run_step(s)
    _, _, finished = run_step(s)
    assert finished == [a] and len(a.completion_token_ids) == 2
    _, _, finished = run_step(s)
    assert finished == [b] and len(b) == 6
    assert s.is_finished() and s.block_manager.num_free_blocks == 64


def test_abort_all_frees_everything():
    s = scheduler(max_num_batched_tokens=4)
    a, b = seq(3), seq(10, first=20)
    s.add(a), s.add(b)
    run_step(s)                                   # a running, b partly prefilled
    s.abort_all()
    assert s.is_finished() and s.block_manager.num_free_blocks == 64


# ---- pipelined steps: the next step is scheduled and launched before this one's tokens arrive -------

def test_next_step_is_scheduled_before_the_sampled_token_arrives():
    s = scheduler()
    a = seq(3)
    s.add(a)
    first = s.launched(s.schedule()[0])
    assert first == [a] and a.token_ids == [1, 2, 3, PENDING] and a.num_cached_tokens == 3
    seqs, is_prefill = s.schedule()            # decode of the pending token: position 3, context of 4
    assert not is_prefill and seqs == [a] and len(a) == 4
    second = s.launched(seqs)
    assert a.token_ids == [1, 2, 3, PENDING, PENDING] and a.num_cached_tokens == 4
    s.postprocess(first, [7])
    assert a.token_ids == [1, 2, 3, 7, PENDING] and a.last_token == PENDING
    s.postprocess(second, [8])
    assert a.completion_token_ids == [7, 8] and a.last_token == 8


def test_eos_is_found_one_step_late_and_the_extra_step_is_dropped():
    s = scheduler()
    a = seq(3)
    s.add(a)
    first = s.launched(s.schedule()[0])
    second = s.launched(s.schedule()[0])       # already on its way when a's eos arrives
    assert s.postprocess(first, [EOS]) == [a]
    assert a.completion_token_ids == [EOS] and not a.block_table and s.is_finished()
    assert s.postprocess(second, [9]) == [] and a.completion_token_ids == [EOS]


def test_a_sequence_at_its_length_limit_is_not_scheduled_past_it():
    s = scheduler()
    a = seq(3, max_tokens=2)
    s.add(a)
    first = s.launched(s.schedule()[0])
    second = s.launched(s.schedule()[0])       # computes the 2nd and last token
    assert a in s.finishing and not s.running and not s.is_finished()
    assert s.schedule() == ([], False)
    assert s.postprocess(first, [7]) == []     # the last token is still to come
    assert s.postprocess(second, [8]) == [a] and a.completion_token_ids == [7, 8] and s.is_finished()


def test_a_sequence_preempted_in_flight_gets_its_token_and_recomputes_it():
    s = scheduler(num_blocks=2)
    a, b = seq(4), seq(4, first=20)
    s.add(a), s.add(b)
    first = s.launched(s.schedule()[0])        # both prefilled: each token starts a second block
    seqs, _ = s.schedule()                     # only one can grow: b is preempted before 7 arrives
    assert seqs == [a] and list(s.waiting) == [b] and b.token_ids[-1] == PENDING
    second = s.launched(seqs)
    s.postprocess(first, [7, 8])
    assert b.token_ids == [20, 21, 22, 23, 8] and b.num_cached_tokens == 0
    s.postprocess(second, [9])
    assert a.completion_token_ids == [7, 9]


def test_a_sequence_preempted_in_flight_can_still_stop_on_eos():
    s = scheduler(num_blocks=2)
    a, b = seq(4), seq(4, first=20)
    s.add(a), s.add(b)
    first = s.launched(s.schedule()[0])
    s.launched(s.schedule()[0])                # b preempted, a goes on
    assert s.postprocess(first, [7, EOS]) == [b]
    assert not s.waiting and b.is_finished and b.completion_token_ids == [EOS]


def test_decode_batch_comes_longest_first_and_preemption_order_is_kept():
    s = scheduler()
    a, b, c = seq(2), seq(9, first=20), seq(5, first=40)
    for x in (a, b, c):
        s.add(x)
    run_step(s)
    seqs, is_prefill = s.schedule()
    assert not is_prefill and seqs == [b, c, a]
    assert list(s.running) == [a, b, c]         # the newest is still the first to be preempted


def test_prompts_scheduled_in_one_step_share_the_prefix_the_first_computes():
    """The first prompt of a prefix registers the blocks its scheduled chunk computes as it is scheduled;
    the others in the same step hit them (a layer stores K/V before its attention reads them)."""
    s = scheduler()
    prefix = list(range(1, 11))                              # two full blocks and a half
    a, b, c = (Sequence(prefix + [50 + i, 60 + i], SamplingParams(), BS) for i in range(3))
    other = seq(9, first=200)
    for x in (a, other, b, c):
        s.add(x)
    seqs, is_prefill = s.schedule()
    assert is_prefill and seqs == [a, other, b, c]
    assert a.num_cached_tokens == other.num_cached_tokens == 0
    assert b.num_cached_tokens == c.num_cached_tokens == 2 * BS
    assert b.block_table[:2] == c.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert s.stats()["num_prefix_cache_hit_tokens"] == 4 * BS


def test_a_prompt_finishing_its_chunks_shares_with_one_scheduled_after_it():
    s = scheduler(max_num_batched_tokens=7)
    a, b = (Sequence(list(range(1, 13)) + [99], SamplingParams(), BS) for _ in range(2))
    s.add(a), s.add(b)
    seqs, _ = s.schedule()                  # a's first 7 tokens: the step's whole budget
    assert seqs == [a] and a.num_scheduled_tokens == 7 and not b.block_table
    s.launched(seqs)
    seqs, _ = s.schedule()                  # a's last 6 tokens, then b hits a's three full blocks
    assert seqs == [a, b] and b.num_cached_tokens == 3 * BS and b.num_scheduled_tokens == 1


def test_an_aborted_step_leaves_no_hit_on_blocks_it_never_wrote():
    s = scheduler()
    prefix = list(range(1, 13))
    a, b = (Sequence(prefix + [50 + i], SamplingParams(), BS) for i in range(2))
    s.add(a), s.add(b)
    s.schedule()                            # both scheduled, b sharing a's blocks; never launched
    assert b.num_cached_tokens == 3 * BS
    s.abort_all()
    c = Sequence(prefix + [70], SamplingParams(), BS)
    s.add(c)
    s.schedule()
    assert c.num_cached_tokens == 0



def test_a_prompt_sharing_part_of_a_block_its_step_writes_starts_next_step_copying_it():
    """With pages of PARTIAL_HIT_MIN_PAGE tokens or more, a prompt that shares at least half a page past its
    last full hit with a block the step being scheduled writes waits a step (what was scheduled before it goes
    on), then gets a copy of that block before its own step and computes only what follows the shared tokens."""
    page = 64
    config = SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024,
                             eos_token_ids=frozenset({EOS}), kvcache_block_size=page, enable_prefix_caching=True,
                             speculative_config=None)
    s = Scheduler(config, 32)
    prefix = list(range(1, 181))                              # two pages and 52 tokens
    a, b, c = (Sequence(prefix + [500 + 100 * i + j for j in range(60)], SamplingParams(), page) for i in range(3))
    other = Sequence(list(range(2000, 2100)), SamplingParams(), page)
    for x in (a, b, other, c):
        s.add(x)
    seqs, is_prefill = s.schedule()
    assert is_prefill and seqs == [a] and s.prefix_copies == [] and not b.block_table   # b waits, other behind it
    s.postprocess(s.launched(seqs), [7])
    seqs, is_prefill = s.schedule()
    assert is_prefill and seqs == [b, other, c]
    assert s.prefix_copies == [(a.block_table[2], b.block_table[2]), (a.block_table[2], c.block_table[2])]
    assert b.num_cached_tokens == c.num_cached_tokens == 180 and b.num_scheduled_tokens == 60
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert s.stats()["num_prefix_cache_hit_tokens"] == 2 * 180
    s.postprocess(s.launched(seqs), [7] * 3)
    seqs, is_prefill = s.schedule()
    assert not is_prefill and s.prefix_copies == []


def test_a_short_partial_hit_on_a_block_its_step_writes_is_computed_again_without_waiting():
    """Less than half a page shared (a short system prompt in a burst of requests): not worth a step's wait."""
    page = 64
    config = SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024,
                             eos_token_ids=frozenset({EOS}), kvcache_block_size=page, enable_prefix_caching=True,
                             speculative_config=None)
    s = Scheduler(config, 32)
    prefix = list(range(1, 151))                              # two pages and 22 tokens
    a, b = (Sequence(prefix + [500 + 100 * i + j for j in range(60)], SamplingParams(), page) for i in range(2))
    s.add(a), s.add(b)
    seqs, _ = s.schedule()
    assert seqs == [a, b] and s.prefix_copies == [] and b.num_cached_tokens == 128

def test_the_prompts_after_a_prefixs_first_all_start_together_copying_the_page_it_wrote():
    """Each of them, once started, fills its own copy of the shared page, which then holds the shared tokens
    too; a page an earlier step wrote is taken over those (else they would start a few at a time)."""
    page = 64
    config = SimpleNamespace(max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=1024,
                             eos_token_ids=frozenset({EOS}), kvcache_block_size=page, enable_prefix_caching=True,
                             speculative_config=None)
    s = Scheduler(config, 64)
    prefix = list(range(1, 181))
    first, *others = (Sequence(prefix + [500 + 100 * i + j for j in range(60)], SamplingParams(), page)
                      for i in range(21))
    for x in (first, *others):
        s.add(x)
    seqs, _ = s.schedule()
    assert seqs == [first]
    s.postprocess(s.launched(seqs), [7])
    seqs, _ = s.schedule()
    assert seqs == others and s.prefix_copies == [(first.block_table[2], x.block_table[2]) for x in others]

# ---- n completions beyond what fits at once ---------------------------------------------------------

def run_to_the_end(s: Scheduler) -> list[Sequence]:
    """Steps until nothing is left, checking the cache's invariants after each; returns what finished."""
    from block_invariants import check_invariants
    finished = []
    while not s.is_finished():
        seqs, _, done = run_step(s)
        assert seqs, "no progress although requests are pending"
        assert len(s.running) <= s.max_num_seqs
        finished += done
        check_invariants(s.block_manager, [*s.waiting, *s.running, *s.finishing])
    return finished


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_above_max_num_seqs_starts_in_waves_sharing_the_prompts_full_blocks(prefix_caching):
    s = scheduler(max_num_seqs=4, prefix_caching=prefix_caching)
    a = seq(6, n=10, max_tokens=2, ignore_eos=True)      # a full block and a tail of 2
    s.add(a)
    seqs, is_prefill = s.schedule()
    assert is_prefill and [x.index for x in seqs] == [0, 1, 2, 3] and len(s.running) == 4
    [rest] = s.waiting                                    # completions 4..9 wait as one sequence
    assert rest.index == 4 and rest.num_forks == 5 and rest.parent_id == a.seq_id
    assert rest.block_table == a.block_table[:1] and rest.num_cached_tokens == BS
    assert s.block_manager.blocks[a.block_table[0]].ref_count == 5
    s.postprocess(s.launched(seqs), [7] * 4)
    finished = run_to_the_end(s)
    assert sorted(x.index for x in finished) == list(range(10))
    assert all(x.parent_id == a.seq_id and x.completion_token_ids == [7, 7] for x in finished)
    assert s.num_prefilled_tokens == 6 + 2 + 2           # two more waves, each computing the tail alone
    assert s.stats()["num_prefix_cache_hit_tokens"] == 0     # shared by reference, not looked up
    assert s.block_manager.num_free_blocks == 64


def test_forks_take_the_free_blocks_there_are_and_the_rest_wait_for_more():
    s = scheduler(num_blocks=5)
    a = seq(6, n=8, max_tokens=1)                         # 2 blocks; each fork copies the partial one
    s.add(a)
    seqs, _ = s.schedule()
    assert len(seqs) == 4 and s.block_manager.num_free_blocks == 0
    assert s.waiting[0].index == 4 and len(s.waiting[0].block_table) == 1
    s.postprocess(s.launched(seqs), [7] * 4)              # all done at once: max_tokens=1
    finished = run_to_the_end(s)
    assert sorted(x.index for x in finished) == list(range(4, 8))


def test_a_lone_sequence_takes_the_blocks_a_waiting_completion_holds_instead_of_preempting_itself():
    """max_num_seqs=1: b runs while a's second completion waits, holding a's 2 full prompt blocks. When b
    can grow only into those, they are given back (recomputed later), and b is not preempted."""
    s = scheduler(num_blocks=5, max_num_seqs=1)
    a, b = seq(9, n=2, max_tokens=1), seq(3, first=50, max_tokens=14, ignore_eos=True)
    s.add(a)
    run_step(s)
    [rest] = s.waiting
    assert len(rest.block_table) == 2 and s.block_manager.num_free_blocks == 3
    s.waiting.appendleft(b)                               # ahead of it, as a preempted sequence sits
    finished = run_to_the_end(s)
    assert finished[0] is b and len(b.completion_token_ids) == 14 and s.num_preemptions == 0
    assert finished[1] is rest and rest.completion_token_ids == [7]


def test_what_waits_at_the_head_takes_the_blocks_completions_behind_it_hold_when_nothing_runs():
    s = scheduler(num_blocks=5, max_num_seqs=1)
    a, b = seq(9, n=2, max_tokens=1), seq(13, first=50, max_tokens=2)   # b needs 4 of the 5 blocks
    s.add(a)
    run_step(s)
    rest = s.waiting[0]
    s.waiting.appendleft(b)
    seqs, is_prefill = s.schedule()
    assert is_prefill and seqs == [b] and not rest.block_table and rest.num_cached_tokens == 0
    s.postprocess(s.launched(seqs), [7])
    assert [x.index for x in run_to_the_end(s)] == [0, 1]          # b, then a's second completion


# ---- abort --------------------------------------------------------------------------------------------

def test_abort_drops_every_completion_of_a_request_wherever_it_is():
    """Pipelined, as the engine runs: a's completions are running, finishing (their last token in
    flight) and waiting to start; aborting a drops them all and frees their blocks at once; the step in
    flight reports nothing for them; b goes on untouched."""
    s = scheduler(max_num_seqs=4)
    a = seq(6, n=9, max_tokens=2, ignore_eos=True)
    b = seq(3, first=40, max_tokens=3, ignore_eos=True)
    s.add(a), s.add(b)
    first = s.launched(s.schedule()[0])                  # a's first wave: 4 rows
    second_seqs, _ = s.schedule()                        # decode: each of them takes its last token
    second = s.launched(second_seqs)
    assert len(s.finishing) == 4 and s.waiting[0].parent_id == a.seq_id and s.waiting[1] is b
    s.postprocess(first, [7] * 4)
    dropped = s.abort([a.seq_id])
    assert sorted(x.index for x in dropped) == [0, 1, 2, 3, 4]     # 4 finishing, and the one holding 5..8
    assert all(x.is_finished and x.finish_reason == "abort" and not x.block_table for x in dropped)
    assert not s.finishing and list(s.waiting) == [b] and s.block_manager.num_free_blocks == 64
    assert s.postprocess(second, [8] * 4) == []
    finished = run_to_the_end(s)
    assert finished == [b] and b.completion_token_ids == [7, 7, 7]
    assert s.abort([a.seq_id]) == []


def test_abort_a_request_partly_prefilled_and_one_running():
    s = scheduler(max_num_batched_tokens=4)
    a, b, c = seq(3), seq(10, first=20, n=3), seq(2, first=40)
    for x in (a, b, c):
        s.add(x)
    run_step(s)                                          # a running, b's first token of 10 in
    assert s.waiting[0] is b and b.block_table
    dropped = s.abort([a.seq_id, b.seq_id])
    assert set(dropped) == {a, b} and list(s.waiting) == [c] and not s.running
    assert s.block_manager.num_free_blocks == 64
    assert run_to_the_end(s) == [c]


def _config(**kw):
    fields = dict(kvcache_block_size=256, attention_backend="triton", num_kvcache_blocks=-1, device="cuda",
                  gpu_memory_utilization=0.9, kv_cache_dtype=torch.bfloat16)
    return SimpleNamespace(**{**fields, **kw})


def test_the_kv_room_hint_names_what_gives_this_config_more_room():
    hint = kv_room_hint(_config(), 500)
    assert "500 blocks of 256 tokens, 128000 tokens" in hint
    assert "kvcache_block_size=16" in hint and "about 128 tokens" in hint
    assert "gpu_memory_utilization (now 0.9)" in hint and "kv_cache_dtype='fp8'" in hint
    assert "num_kvcache_blocks" not in hint
    # pages already small, or flash-attn's multiples of 256: no page size to suggest
    assert "kvcache_block_size" not in kv_room_hint(_config(kvcache_block_size=16), 500)
    assert "kvcache_block_size" not in kv_room_hint(_config(attention_backend="flash_attn"), 500)
    assert "kv_cache_dtype" not in kv_room_hint(_config(kv_cache_dtype=torch.float8_e4m3fn), 500)
    sized = kv_room_hint(_config(num_kvcache_blocks=500), 500)      # the user's own count sizes the cache
    assert "a larger num_kvcache_blocks" in sized and "gpu_memory_utilization" not in sized
    assert "gpu_memory_utilization" not in kv_room_hint(_config(device="cpu"), 500)


def test_the_first_preemption_logs_the_hint_once(caplog):
    s = scheduler(num_blocks=2)
    a, b = seq(4), seq(4, first=100)        # a block each; each needs a second to grow
    s.add(a), s.add(b)
    with caplog.at_level(logging.WARNING, logger="nanovllm.engine.scheduler"):
        for _ in range(6):
            run_step(s)
    assert s.num_preemptions >= 2
    hints = [r for r in caplog.records if "the KV cache is full" in r.getMessage()]
    assert len(hints) == 1 and "2 blocks of 4 tokens" in hints[0].getMessage()
