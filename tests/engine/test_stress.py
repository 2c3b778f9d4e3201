"""Heavy load changes nothing but speed: constant preemption and prefix caching keep greedy outputs exact,
with the model's dtype in the KV cache and with fp8 ("fp8" rounds what is stored, the same either way)."""
import random

import pytest

from nanovllm import LLM, SamplingParams
from mixed_batch import assert_mixed_outputs

pytestmark = pytest.mark.cpu_only     # every engine is device="cpu"

BLOCK = 16


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(outputs):
    return [o["token_ids"] for o in outputs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_constant_preemption_changes_nothing(tiny_model, kv_cache_dtype):
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 40))] for _ in range(24)]
    params = [greedy(rng.randint(1, 20)) for _ in prompts]
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=BLOCK, max_model_len=128,
             kv_cache_dtype=kv_cache_dtype) as roomy:
        expected = token_ids(roomy.generate(prompts, params, use_tqdm=False))
        assert roomy.stats["num_preemptions"] == 0
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=BLOCK, max_model_len=128, num_kvcache_blocks=5,
             kv_cache_dtype=kv_cache_dtype) as cramped:
        assert token_ids(cramped.generate(prompts, params, use_tqdm=False)) == expected
        assert cramped.stats["num_preemptions"] >= 10
        assert cramped.scheduler.block_manager.used_block_ids == set()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("prefix_len", [5, 16, 40])
def test_prefix_caching_on_and_off_agree_and_hits_are_what_the_prefix_implies(tiny_model, prefix_len,
                                                                              kv_cache_dtype):
    rng = random.Random(prefix_len)
    prefix = [rng.randrange(512) for _ in range(prefix_len)]
    first = prefix + [1, 2, 3]
    others = [prefix + [rng.randrange(512) for _ in range(rng.randint(1, 10))] for _ in range(12)]
    results = {}
    for caching in (True, False):
        with LLM(str(tiny_model), device="cpu", kvcache_block_size=BLOCK, max_model_len=128,
                 enable_prefix_caching=caching, kv_cache_dtype=kv_cache_dtype) as llm:
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


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_prompts_sharing_a_prefix_in_one_step_hit_it_and_decode_as_without_the_cache(tiny_model, kv_cache_dtype):
    """Nothing cached beforehand, every prompt in the same prefill step: each prefix is computed once (by
    its first prompt), the others read its blocks as that step writes them, and greedy outputs are
    those of an engine without a prefix cache."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(512) for _ in range(40)] for _ in range(3)]      # two full blocks each
    prompts = [p + [rng.randrange(512) for _ in range(rng.randint(1, 9))] for p in prefixes for _ in range(4)]
    rng.shuffle(prompts)
    results = {}
    for caching in (True, False):
        with LLM(str(tiny_model), device="cpu", kvcache_block_size=BLOCK, max_model_len=128,
                 enable_prefix_caching=caching, kv_cache_dtype=kv_cache_dtype) as llm:
            results[caching] = token_ids(llm.generate(prompts, greedy(6), use_tqdm=False))
            expected_hits = (len(prompts) - len(prefixes)) * 2 * BLOCK if caching else 0
            assert llm.stats["num_prefix_cache_hit_tokens"] == expected_hits
            assert llm.stats["num_prefilled_tokens"] == sum(map(len, prompts)) - expected_hits
    assert results[True] == results[False]


PAGE = 64       # partial prefix-cache hits need pages of PARTIAL_HIT_MIN_PAGE tokens or more


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("prefix_len, hit_cached, hit_in_one_step", [(170, 170, 170), (150, 150, 128), (132, 128, 128)])
@pytest.mark.parametrize("in_one_step", [False, True])
def test_partial_hits_copy_a_cached_block_and_decode_as_without_the_cache(tiny_model, prefix_len, hit_cached,
                                                                          hit_in_one_step, in_one_step,
                                                                          kv_cache_dtype):
    """Prompts sharing a prefix that ends inside a page: past its full pages, each finds the rest of the shared
    tokens in the first prompt's next page (full: the first prompt goes on past the prefix), gets a copy of
    it and computes only its own tokens; at least an eighth of a page (8 tokens here) must be shared, else
    they are recomputed. Cached by an earlier call, or computed in the same step: then the others wait a step
    for it if they share at least half a page with it (42 tokens), else compute those tokens again (22).
    Greedy outputs are those of an engine without a prefix cache."""
    hit = hit_in_one_step if in_one_step else hit_cached
    rng = random.Random(prefix_len)
    prefix = [rng.randrange(1, 512) for _ in range(prefix_len)]
    first = prefix + [0] * (3 * PAGE - prefix_len)                  # three full pages
    others = [prefix + [rng.randrange(1, 512) for _ in range(rng.randint(1, 30))] for _ in range(12)]
    results = {}
    for caching in (True, False):
        with LLM(str(tiny_model), device="cpu", kvcache_block_size=PAGE, max_model_len=256,
                 enable_prefix_caching=caching, kv_cache_dtype=kv_cache_dtype) as llm:
            if in_one_step:
                out = token_ids(llm.generate([first] + others, greedy(6), use_tqdm=False))
            else:
                out = token_ids(llm.generate([first], greedy(6), use_tqdm=False))
                out += token_ids(llm.generate(others, greedy(6), use_tqdm=False))
            results[caching] = out
            expected_hits = len(others) * hit if caching else 0
            assert llm.stats["num_prefix_cache_hit_tokens"] == expected_hits
            assert llm.stats["num_prefilled_tokens"] == len(first) + sum(map(len, others)) - expected_hits
    assert results[True] == results[False]


def test_partial_hits_under_what_users_mix(tiny_model):
    """One batch over a 100-token prefix shared inside a 64-token page, in a cache that preempts: greedy
    requests ending on stop strings, seeded n = 3 requests whose completions end at different steps (stop
    token ids over a tenth of the vocabulary, varied max_tokens), and a request aborted mid-run. The greedy
    ones end as without the prefix cache (text, tokens, finish reason), every request ends, partial hits
    happen, and nothing stays held."""
    rng = random.Random(11)
    prefix = [rng.randrange(1, 512) for _ in range(100)]
    prompts = [prefix + [rng.randrange(1, 512) for _ in range(n)] for n in (40, 3, 9, 17, 25)]
    settings = dict(device="cpu", kvcache_block_size=PAGE, max_model_len=256, num_kvcache_blocks=5,
                    max_num_batched_tokens=128)
    with LLM(str(tiny_model), enable_prefix_caching=False, **settings) as llm:
        free = llm.generate(prompts[:3], greedy(30), use_tqdm=False)
        middles = [out["text"][len(out["text"]) // 2:][:2] for out in free]
        stopped = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[m] if m.strip() else None)
                   for m in middles]
        expected = llm.generate(prompts[:3], stopped, use_tqdm=False)
    assert any(out["finish_reason"] == "stop" for out in expected)
    sampled = [SamplingParams(n=3, temperature=1.0, seed=70 + i, max_tokens=8 + 6 * i,
                              stop_token_ids=list(range(7, 512, 10))) for i in range(2)]
    with LLM(str(tiny_model), **settings) as llm:
        llm.generate(prompts[:1], greedy(1), use_tqdm=False)        # its second page holds 36 of the prefix's tokens
        aborted = llm.add_request(prompts[4], SamplingParams(temperature=0.8, max_tokens=100, ignore_eos=True))
        for _ in range(3):
            llm.step()
        llm.abort_request(aborted)
        outputs = llm.generate(prompts[:3] + prompts[3:5], stopped + sampled, use_tqdm=False)
        stats = llm.stats
        assert stats["num_preemptions"] > 0
        assert stats["num_prefix_cache_hit_tokens"] > 4 * PAGE        # more than whole pages would give
        assert llm.is_finished() and llm.scheduler.block_manager.used_block_ids == set()
    assert_mixed_outputs(outputs[:3], expected, outputs[3:], sampled)
