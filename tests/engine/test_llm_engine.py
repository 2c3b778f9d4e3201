"""The engine's edge: bad requests get clear errors and change nothing; shutdown is clean."""
import gc
import weakref

import pytest

from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.cpu_only     # every engine is device="cpu"

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=40) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(llm):
    """What a clean engine answers for two fixed prompts; every test below must still get it."""
    return llm.generate([[1, 2, 3], "hello there"], GREEDY, use_tqdm=False)


def assert_still_correct(llm, reference):
    assert llm.generate([[1, 2, 3], "hello there"], GREEDY, use_tqdm=False) == reference
    assert llm.scheduler.is_finished()
    assert llm.scheduler.block_manager.used_block_ids == set()


def test_outputs_come_back_in_input_order(llm, reference):
    prompts = [[5] * n for n in (30, 1, 17, 4)]
    outputs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                                     for m in (3, 9, 1, 5)], use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [3, 9, 1, 5]
    alone = llm.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                         use_tqdm=False)
    assert outputs[2] == alone[0]
    assert isinstance(outputs[0]["text"], str)


def test_empty_prompt_list_returns_empty(llm):
    assert llm.generate([], GREEDY) == []


GOOD = [9, 9, 9]   # a valid prompt ahead of the bad one: it must not be queued either


@pytest.mark.parametrize("prompts, params, error, words", [
    (("a tuple", "of strings"), GREEDY, TypeError, "list"),     # one string alone is one prompt (as vLLM)
    ([GOOD, ""], GREEDY, ValueError, "empty"),
    ([GOOD, []], GREEDY, ValueError, "no tokens"),
    ([GOOD, [1, 2, 512]], GREEDY, ValueError, "512"),
    ([GOOD, [1, -1]], GREEDY, ValueError, "-1"),
    ([GOOD, [1, 2.0]], GREEDY, TypeError, "ints"),
    ([GOOD, [1, True]], GREEDY, TypeError, "ints"),
    ([GOOD, 7], GREEDY, TypeError, "prompt"),
    ([GOOD, [1] * 128], GREEDY, ValueError, "max_model_len"),
    ([GOOD, [2]], [GREEDY], ValueError, "1 sampling params for 2 prompts"),
    ([GOOD], {"temperature": 0}, TypeError, "SamplingParams"),
])
def test_bad_requests_raise_and_leave_no_state(llm, reference, prompts, params, error, words):
    with pytest.raises(error, match=words):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.is_finished()
    assert_still_correct(llm, reference)


def test_add_request_validates_before_queueing(llm, reference):
    with pytest.raises(ValueError):
        llm.add_request([], GREEDY)
    assert llm.scheduler.is_finished()
    assert_still_correct(llm, reference)


def test_a_request_that_can_never_fit_is_refused(tiny_model):
    """3 blocks hold 48 tokens: 40 + 20 could only ever preempt itself forever; 40 + 8 fits."""
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=3) as small:
        with pytest.raises(ValueError, match="never fit"):
            small.generate([[1] * 40], SamplingParams(max_tokens=20), use_tqdm=False)
        fits = SamplingParams(max_tokens=8, ignore_eos=True)       # a sampled eos must not end it early
        assert len(small.generate([[1] * 40], fits, use_tqdm=False)[0]["token_ids"]) == 8


def test_an_exception_inside_a_step_frees_everything(llm, reference, monkeypatch):
    calls = {"n": 0}
    real_run = llm.model_runner.run

    def failing_run(seqs, is_prefill, *args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return real_run(seqs, is_prefill, *args)

    monkeypatch.setattr(llm.model_runner, "run", failing_run)
    with pytest.raises(RuntimeError, match="fell over"):
        llm.generate([[4] * 20, [5] * 3], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert llm.scheduler.is_finished() and llm.scheduler.block_manager.used_block_ids == set()
    assert_still_correct(llm, reference)


def test_unknown_engine_argument_is_named(tiny_model):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(tiny_model), device="cpu", max_num_seq=4)


def test_stats_count_the_work(tiny_model):
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16, max_model_len=128) as engine:
        engine.generate([[3] * 40], GREEDY, use_tqdm=False)
        engine.generate([[3] * 40], GREEDY, use_tqdm=False)
        stats = engine.stats
    assert stats["num_prefilled_tokens"] == 40 + (40 - 32)    # two full blocks came from the cache
    assert stats["num_decoded_tokens"] == 2 * 7
    assert stats["num_prefix_cache_hit_tokens"] == 32
    assert stats["prefix_cache_hit_rate"] == pytest.approx(32 / 80)
    assert stats["num_preemptions"] == 0


def test_exit_is_idempotent_and_the_engine_then_refuses_work(tiny_model):
    engine = LLM(str(tiny_model), device="cpu", kvcache_block_size=16, max_model_len=64)
    engine.exit()
    engine.exit()
    with pytest.raises(RuntimeError, match="exited"):
        engine.generate([[1]], GREEDY)


def test_exit_releases_the_kv_cache_even_if_the_runner_is_still_referenced(tiny_model):
    engine = LLM(str(tiny_model), device="cpu", kvcache_block_size=16, max_model_len=64)
    runner = engine.model_runner
    kv_cache = weakref.ref(runner.kv_cache)
    engine.exit()
    gc.collect()
    assert kv_cache() is None
