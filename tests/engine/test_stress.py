"""Heavy load changes nothing but speed: constant preemption and prefix caching keep greedy outputs exact."""
import random

import pytest

from nanovllm import LLM, SamplingParams

BLOCK = 16


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(outputs):
    return [o["token_ids"] for o in outputs]


def test_constant_preemption_changes_nothing(tiny_model):
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 40))] for _ in range(24)]
    params = [greedy(rng.randint(1, 20)) for _ in prompts]
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=BLOCK, max_model_len=128) as roomy:
        expected = token_ids(roomy.generate(prompts, params, use_tqdm=False))
        assert roomy.stats["num_preemptions"] == 0
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=BLOCK, max_model_len=128, num_kvcache_blocks=5) as cramped:
        assert token_ids(cramped.generate(prompts, params, use_tqdm=False)) == expected
        assert cramped.stats["num_preemptions"] >= 10
        assert cramped.scheduler.block_manager.used_block_ids == set()


@pytest.mark.parametrize("prefix_len", [5, 16, 40])
def test_prefix_caching_on_and_off_agree_and_hits_are_what_the_prefix_implies(tiny_model, prefix_len):
    rng = random.Random(prefix_len)
    prefix = [rng.randrange(512) for _ in range(prefix_len)]
    first = prefix + [1, 2, 3]
    others = [prefix + [rng.randrange(512) for _ in range(rng.randint(1, 10))] for _ in range(12)]
    results = {}
    for caching in (True, False):
        with LLM(str(tiny_model), device="cpu", kvcache_block_size=BLOCK, max_model_len=128,
                 enable_prefix_caching=caching) as llm:
            out_first = token_ids(llm.generate([first], greedy(6), use_tqdm=False))
            before = llm.stats
            out_others = token_ids(llm.generate(others, greedy(6), use_tqdm=False))
            after = llm.stats
            results[caching] = out_first + out_others
            hit_tokens = after["num_prefix_cache_hit_tokens"] - before["num_prefix_cache_hit_tokens"]
            expected_hits = len(others) * (prefix_len // BLOCK) * BLOCK if caching else 0
            assert hit_tokens == expected_hits
            assert after["num_prefilled_tokens"] - before["num_prefilled_tokens"] == \
                sum(map(len, others)) - expected_hits
    assert results[True] == results[False]
