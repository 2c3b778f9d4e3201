"""Randomized runs of the scheduler and block manager with a fake model, checking the invariants
of the paged KV cache after every step."""
import random
from types import SimpleNamespace

import pytest

from nanovllm import SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from block_invariants import check_invariants

EOS = 0


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_the_cache_consistent(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(8, 16) * (8 // block_size)    # room for 64 to 128 tokens: preemptions
    config = SimpleNamespace(max_num_seqs=rng.randint(4, 8), max_num_batched_tokens=rng.randint(4, 40),
                             max_model_len=64, eos_token_ids=frozenset({EOS}), kvcache_block_size=block_size,
                             enable_prefix_caching=rng.random() < 0.8)
    s = Scheduler(config, num_blocks)
    prefixes = [[rng.randint(1, 9) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    live: list[Sequence] = []
    finished = 0
    for step in range(400):
        if rng.random() < 0.4 and len(live) < 16:              # arrivals at random times
            prompt = rng.choice(prefixes) + [rng.randint(1, 9) for _ in range(rng.randint(1, 12))]
            max_tokens = rng.randint(1, 40)
            if (min(len(prompt) + max_tokens, 64) + block_size - 1) // block_size <= num_blocks:
                seq = Sequence(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.5),
                               block_size)
                s.add(seq)
                live.append(seq)
        if s.is_finished():
            continue
        seqs, _ = s.schedule()
        assert seqs, "no progress although requests are pending"
        tokens = [EOS if rng.random() < 0.05 else rng.randint(1, 9) for _ in seqs]
        for seq in s.postprocess(seqs, tokens):
            assert seq.status == SequenceStatus.FINISHED and not seq.block_table
            live.remove(seq)
            finished += 1
        check_invariants(s.block_manager, live)
    assert finished >= 10 and s.num_decoded_tokens > 100
    assert s.num_preemptions > 0

