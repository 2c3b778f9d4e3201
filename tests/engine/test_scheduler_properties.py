"""Randomized runs of the scheduler and block manager with a fake model, checking the invariants
of the paged KV cache after every step, and that what each completion generates depends on its prompt
and its index alone: not on when it arrived, on preemption, on the wave its request's n completions
started it in, or on whether steps are pipelined. Some requests ask for more completions than the
running set or the cache can hold at once; some are aborted midway. A simulated paged cache follows what
each step writes where and the block copies, and every step's reads must find each sequence's own tokens."""
import random
from types import SimpleNamespace

import pytest

from nanovllm import SamplingParams
from nanovllm.engine import block_manager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING, Sequence, SequenceStatus
from block_invariants import check_invariants

pytestmark = pytest.mark.cpu_only     # host bookkeeping only

EOS = 0


def fake_model(seq: Sequence | None) -> int:
    """The token a deterministic 'model' samples after seq's known tokens for completion seq.index (EOS
    about one time in ten). The oldest placeholder is the one this step's token fills, so every token
    before it is known."""
    if seq is None or seq.is_finished:
        return 1                                   # a row nobody reads
    prefix = seq.token_ids[:seq.num_tokens - seq.num_pending_tokens]
    assert PENDING not in prefix
    return hash((seq.index, *prefix)) % 10


def token_at(seq: Sequence, position: int) -> int:
    """seq's token at position, PENDING where not known (yet, or ever: a finished sequence drops its
    placeholders)."""
    return seq.token_ids[position] if position < len(seq.token_ids) else PENDING


class PagedKV:
    """What each KV slot holds, as (the sequence that wrote it, the position): a step copies the blocks its
    partial prefix-cache hits need, writes the K/V of every token it computes, then each layer's attention
    reads every position up to the last one a sequence computes, then the step's n > 1 copies are made.

    With `head` (an EAGLE-3 head beside the target), a slot's K/V also read the writer's token after its
    position, so a read must find the reader's token there too; and a completion split off a prompt
    writes the prompt's last position again, into its copy, after the copies."""

    def __init__(self, block_size: int, head: bool = False):
        self.block_size = block_size
        self.head = head
        self.slots: dict[int, tuple[Sequence, int]] = {}
        self.num_prefix_copies = 0

    def _slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _copy(self, copies: list[tuple[int, int]]) -> None:
        for source, destination in copies:
            for j in range(self.block_size):
                held = self.slots.get(source * self.block_size + j)
                if held is None:
                    self.slots.pop(destination * self.block_size + j, None)
                else:
                    self.slots[destination * self.block_size + j] = held

    def step(self, seqs: list[Sequence], prefix_copies, block_copies) -> None:
        """The scheduled step, before launched() counts its tokens as computed."""
        self._copy(prefix_copies)
        self.num_prefix_copies += len(prefix_copies)
        spans = [(seq, seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens)
                 for seq in seqs if seq.num_scheduled_tokens]
        for seq, start, end in spans:
            for position in range(start, end):
                self.slots[self._slot(seq, position)] = (seq, position)
        for seq, _, end in spans:
            for position in range(end):
                writer, written = self.slots[self._slot(seq, position)]
                assert written == position, "a slot holds another position's K/V"
                theirs, ours = writer.token_ids[position], seq.token_ids[position]
                assert PENDING in (theirs, ours) or theirs == ours, "a slot holds another token's K/V"
                if self.head and position < end - 1:
                    theirs, ours = token_at(writer, position + 1), token_at(seq, position + 1)
                    assert PENDING in (theirs, ours) or theirs == ours, "a head's K/V read another next token"
        self._copy(block_copies)
        if self.head and spans:             # a prefill: completions split off compute nothing of their own
            for seq in seqs:
                if not seq.num_scheduled_tokens:
                    self.slots[self._slot(seq, seq.num_tokens - 1)] = (seq, seq.num_tokens - 1)


def run_workload(seed: int, pipelined: bool, head: bool = False
                 ) -> tuple[Scheduler, dict[int, dict[int, list[int]] | None]]:
    """Requests arrive at random steps; with `pipelined`, each step is scheduled and launched before the
    previous one's tokens are postprocessed, as the engine does. A few requests are aborted at random
    steps. `head`: an EAGLE-3 head's speculative config (its K/V read the token after each position).
    Returns the completions of the requests not aborted (None for those aborted) by (arrival index,
    completion index)."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(8, 16) * (8 // block_size)    # room for 64 to 128 tokens: preemptions
    config = SimpleNamespace(max_num_seqs=rng.randint(4, 8), max_num_batched_tokens=rng.randint(4, 40),
                             max_model_len=64, eos_token_ids=frozenset({EOS}), kvcache_block_size=block_size,
                             enable_prefix_caching=rng.random() < 0.8,
                             speculative_config={"method": "eagle3"} if head else None)
    prefixes = [[rng.randint(1, 9) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    arrivals: dict[int, list[Sequence]] = {}
    for _ in range(60):
        prompt = rng.choice(prefixes) + [rng.randint(1, 9) for _ in range(rng.randint(1, 12))]
        max_tokens = rng.randint(1, 40)
        n = 1 if rng.random() < 0.8 else rng.choice([2, 3, 9, 40])    # 9 and 40: more than fit at once
        if (min(len(prompt) + max_tokens, 64) + block_size - 1) // block_size <= num_blocks:
            params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=rng.random() < 0.3)
            arrivals.setdefault(rng.randint(0, 300), []).append(Sequence(prompt, params, block_size))
    requests = [seq for step in sorted(arrivals) for seq in arrivals[step]]
    aborts = {rng.randint(0, 300): rng.randrange(len(requests)) for _ in range(3)}    # step: request

    s = Scheduler(config, num_blocks)
    kv = PagedKV(block_size, head)
    finished: dict[int, list[Sequence]] = {seq.seq_id: [] for seq in requests}
    aborted: set[int] = set()
    in_flight = None
    step = 0
    while step <= 300 or not s.is_finished() or in_flight is not None:
        for seq in arrivals.get(step, []):
            s.add(seq)
        if step in aborts:                          # between steps, as a server would
            request = requests[aborts[step]]
            dropped = s.abort([request.seq_id])
            assert all(seq.parent_id == request.seq_id and seq.is_finished and not seq.block_table
                       for seq in dropped)
            if dropped:                             # else not arrived yet, or done already
                aborted.add(request.seq_id)
        step += 1
        seqs, _ = s.schedule()
        kv.step(seqs, s.prefix_copies, s.block_copies)
        launched = s.launched(seqs) if seqs else None
        assert seqs or in_flight is not None or s.is_finished(), "no progress although requests are pending"
        assert len(s.running) <= config.max_num_seqs
        previous, in_flight = (in_flight, launched) if pipelined else (launched, None)
        if previous is not None:
            for seq in s.postprocess(previous, [fake_model(seq) for seq in previous]):
                assert seq.status == SequenceStatus.FINISHED and not seq.block_table
                assert seq.num_completion_tokens <= seq.max_tokens and PENDING not in seq.token_ids
                assert seq.num_completion_tokens == seq.max_tokens or len(seq) == 64 or (
                    not seq.ignore_eos and seq.last_token == EOS)
                assert seq.parent_id not in aborted
                finished[seq.parent_id].append(seq)
        # every sequence that holds blocks is one the scheduler knows: waiting, running or finishing
        check_invariants(s.block_manager, [*s.waiting, *s.running, *s.finishing])
    assert not s.block_manager.used_block_ids and s.block_manager.num_free_blocks == num_blocks
    outputs = {}
    for i, request in enumerate(requests):
        group = finished[request.seq_id]
        if request.seq_id in aborted:
            assert len(group) < request.sampling_params.n
            outputs[i] = None
            continue
        assert sorted(seq.index for seq in group) == list(range(request.sampling_params.n))
        outputs[i] = {seq.index: seq.completion_token_ids for seq in group}
    s.num_prefix_copies = kv.num_prefix_copies
    return s, outputs


@pytest.mark.parametrize("head", [False, True], ids=["target", "eagle3-head"])
@pytest.mark.parametrize("partial_hits", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_the_cache_consistent_and_pipelining_changes_no_output(seed, partial_hits, head,
                                                                                     monkeypatch):
    if partial_hits:        # the small pages here take partial prefix-cache hits of one token and more
        monkeypatch.setattr(block_manager, "PARTIAL_HIT_MIN_PAGE", 2)
    sync, sync_outputs = run_workload(seed, pipelined=False, head=head)
    piped, piped_outputs = run_workload(seed, pipelined=True, head=head)
    # an abort may catch a request in one run and find it not yet arrived, or done, in the other
    both = [i for i in sync_outputs if sync_outputs[i] is not None and piped_outputs[i] is not None]
    assert [piped_outputs[i] for i in both] == [sync_outputs[i] for i in both]
    assert len(both) >= 40 and sync.num_decoded_tokens > 300
    assert any(len(sync_outputs[i]) > sync.max_num_seqs for i in both)
    assert sync.num_preemptions > 0 and piped.num_preemptions > 0
    caching = sync.block_manager.enable_prefix_caching
    takes_partial_hits = sync.block_manager.min_partial > 0 and caching
    if head:        # a cached block followed by another token than the prompt's is copied: a partial hit too
        assert (sync.num_prefix_copies > 0) == caching
    else:
        assert (sync.num_prefix_copies > 0) == (partial_hits and takes_partial_hits)
