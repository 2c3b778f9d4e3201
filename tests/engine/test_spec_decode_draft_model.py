"""Speculative decoding with a draft model (issue #40, vLLM's method "draft_model"), as a specification: a
smaller checkpoint of the target's vocabulary, with a paged KV cache of its own under the target's block ids
and slots, proposes k tokens a decode step, one after another, and the target verifies them in one pass.

Greedy requests get plain decoding's tokens, token for token (CPU float32), whatever the draft: the target
itself (nearly every draft accepted: which also says that the draft's cache holds the right keys and values
after prefix-cache hits, preemption and chunked prefill, where a wrong one would only cost acceptance),
another random model (drafts mostly rejected) and a narrower one (a cache of another shape); through
preemption, chunked prefill, prefix-cache hits, n > 1, batches mixed with sampled requests, and max_tokens
or a stop token that ends a completion inside an accepted run. With "adaptive": False every decode step
speculates. Sampled requests: the draft draws d ~ q (its softmax at the request's temperature), the target
keeps it with probability min(1, p(d) / q(d)) and else draws from max(p - q, 0) renormalized: other tokens
than plain decoding draws, but its law (Pearson's chi-square against transformers' probabilities at the
first drafted position, accepted at the rate sum min(p, q) gives), and a seeded request draws the same
tokens again. Bad configurations are refused by name. The n-gram method:
test_spec_decode.py, whose layout this file follows."""
import itertools

import pytest
import torch

from nanovllm import SamplingParams
from speculation import (BLOCK, GREEDY, MAX_TOKENS, REPEATING, VOCAB, assert_a_mixed_batch_ends_as_plain_decoding,
                         assert_idle, assert_seeded_draws_repeat, completions_step_by_step, drafted, engine,
                         greedy_drafting_every_step, law_completions, tokens)
from oracle import load_hf_model, random_prompts
from sampling_reference import assert_drafted_position_law, drafted_position_law

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.cpu_only]     # every engine is device="cpu"

RANDOM = random_prompts(3, VOCAB, (8, 40), seed=4101)
PROMPTS = REPEATING + RANDOM
# the drafts beside the target itself ("self"): random models of its vocabulary (make_checkpoint's shapes)
DRAFT_SHAPES = {
    "other": dict(num_hidden_layers=1, seed=3),       # agrees with the target now and then
    "narrow": dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                   num_key_value_heads=1, seed=5),    # half the target's KV heads: a cache of its own shape
}
HIGH_ACCEPTANCE = 0.8                   # the target as its own draft: only float ties may tell them apart


def draft_model(model, k: int) -> dict:
    """Speculation on every decode step (these tests are about its mechanics)."""
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, "adaptive": False}


def draft_dir(name: str, target, make_checkpoint):
    return target if name == "self" else make_checkpoint(**DRAFT_SHAPES[name])


def assert_acceptance(draft: str, num_draft: int, num_accepted: int) -> None:
    """The target as its own draft: nearly all accepted; another model: some rejected."""
    assert num_draft > 0
    if draft == "self":
        assert num_accepted / num_draft > HIGH_ACCEPTANCE, (num_accepted, num_draft)
    else:
        assert num_accepted < num_draft


@pytest.fixture(scope="module")
def plain(tiny_model):
    with engine(tiny_model) as llm:
        yield llm


@pytest.fixture(scope="module", params=[("self", 1), ("self", 3), ("other", 1), ("other", 3), ("narrow", 2)],
                ids=lambda p: f"{p[0]}-k={p[1]}")
def spec(tiny_model, make_checkpoint, request):
    """(engine, draft name, k)"""
    name, k = request.param
    with engine(tiny_model, draft_model(draft_dir(name, tiny_model, make_checkpoint), k)) as llm:
        yield llm, name, k


@pytest.fixture(scope="module")
def self3(tiny_model):
    """The target as its own draft, 3 tokens a step: long accepted runs."""
    with engine(tiny_model, draft_model(tiny_model, 3)) as llm:
        yield llm


@pytest.fixture(scope="module")
def greedy_reference(plain):
    return plain.generate(PROMPTS, GREEDY, use_tqdm=False)


# ---- greedy: token for token -----------------------------------------------------------------------------
def test_greedy_is_token_identical_to_plain_decoding(spec, greedy_reference):
    """Whatever the draft proposes, the target's tokens are kept; every decode step with room for a draft
    speculates (a sequence gains at most k + 1 tokens a step, and has room while it lacks 2 or more)."""
    llm, draft, k = spec
    num_draft, num_accepted = greedy_drafting_every_step(llm, k, PROMPTS, greedy_reference)
    assert_acceptance(draft, num_draft, num_accepted)
    assert_idle(llm)


def test_prefix_cache_hits_on_blocks_computed_under_speculation(spec, greedy_reference, plain):
    """The same prompts again hit their cached blocks; a prompt that extends a completion hits the blocks
    its decode steps filled. The target's cache there holds the accepted tokens' KV only (else the
    continuation would differ), and so does the draft's (else the target itself, as the draft, would see
    its drafts rejected)."""
    llm, draft, _ = spec
    hits = llm.stats["num_prefix_cache_hit_tokens"]
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(greedy_reference)
    assert llm.stats["num_prefix_cache_hit_tokens"] > hits
    extended = [p + out["token_ids"][:34] for p, out in zip(PROMPTS, greedy_reference)]
    before = llm.stats
    expected = plain.generate(extended, GREEDY, use_tqdm=False)
    assert tokens(llm.generate(extended, GREEDY, use_tqdm=False)) == tokens(expected)
    # each extended prompt finds at least its prompt's full blocks and one block of decoded tokens
    gained = llm.stats["num_prefix_cache_hit_tokens"] - before["num_prefix_cache_hit_tokens"]
    assert gained >= sum((len(p) // BLOCK + 1) * BLOCK for p in PROMPTS)
    assert_acceptance(draft, *drafted(llm, before)[1:])
    assert_idle(llm)


def test_a_published_block_holds_the_drafts_kv_at_every_position(tiny_model):
    """When a verification accepts all k drafts, the draft never computed the last one's K/V (its next
    proposal does): the prefix cache publishes no block from the one with that position on until then, also
    where the sequence ends first or plain steps come between. With the target as its own draft, every
    published block's draft K/V equal the target's, slot for slot (a hole would hold an older block's)."""
    prompts = random_prompts(24, VOCAB, (5, 60), seed=4105)
    with engine(tiny_model, draft_model(tiny_model, 3), num_kvcache_blocks=200) as llm:
        for max_tokens, prompt in enumerate(prompts, 20):      # ending at every offset of an accepted run
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                         use_tqdm=False)
        assert_acceptance("self", llm.stats["spec_decode_draft_tokens"], llm.stats["spec_decode_accepted_tokens"])
        published = list(llm.scheduler.block_manager.hash_to_block_id.values())
        target, draft = llm.model_runner.kv_cache, llm.model_runner.draft.kv_cache
        assert len(published) >= 60
        torch.testing.assert_close(draft[:, :, published], target[:, :, published], atol=1e-3, rtol=0)
        assert_idle(llm)


def test_plain_steps_between_verifications_leave_the_draft_no_hole(tiny_model, greedy_reference):
    """The adaptive policy may decode plainly right after a verification that accepted all k drafts (whose
    last one's draft K/V is not yet computed): the next proposal then computes the draft's K/V from that
    position on, also for the plain steps' tokens, which attended to it. Speculating every other step, the
    target as its own draft keeps nearly every draft (the hole once cost half of them: 103 of 211), its tokens
    are plain decoding's, and every published block's draft K/V equal the target's."""
    with engine(tiny_model, draft_model(tiny_model, 3), num_kvcache_blocks=200) as llm:
        steps = itertools.count()
        llm.spec_decode.policy.speculate = lambda batch_size: next(steps) % 2 == 0
        got = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        assert got == tokens(greedy_reference)
        num_draft, num_accepted = llm.stats["spec_decode_draft_tokens"], llm.stats["spec_decode_accepted_tokens"]
        assert num_draft > 0 and num_accepted >= 0.95 * num_draft, (num_accepted, num_draft)    # (0.76 with it)
        published = list(llm.scheduler.block_manager.hash_to_block_id.values())
        target, draft = llm.model_runner.kv_cache, llm.model_runner.draft.kv_cache
        assert len(published) >= 20
        torch.testing.assert_close(draft[:, :, published], target[:, :, published], atol=1e-3, rtol=0)
        assert_idle(llm)


@pytest.mark.parametrize("in_one_step", [False, True])
def test_partial_prefix_hits_copy_the_drafts_cache_too(tiny_model, in_one_step):
    """In 64-token pages, prompts sharing a 100-token prefix copy the first prompt's second page (36 shared
    tokens) into a page of their own before their step, in the target's cache and the draft's: greedy tokens
    are plain decoding's, and the target as its own draft keeps nearly every draft (a wrong copy in the
    draft's cache would only cost acceptance)."""
    prefix = random_prompts(1, VOCAB, (100, 100), seed=4102)[0]
    first = prefix + random_prompts(1, VOCAB, (40, 40), seed=4103)[0]         # fills its second page
    others = [prefix + p for p in random_prompts(4, VOCAB, (3, 20), seed=4104)]
    pages = dict(kvcache_block_size=64, num_kvcache_blocks=24)
    with engine(tiny_model, **pages, enable_prefix_caching=False) as reference:
        expected = tokens(reference.generate([first] + others, GREEDY, use_tqdm=False))
    with engine(tiny_model, draft_model(tiny_model, 3), **pages) as llm:
        if in_one_step:
            got = tokens(llm.generate([first] + others, GREEDY, use_tqdm=False))
        else:
            got = tokens(llm.generate([first], GREEDY, use_tqdm=False))
            got += tokens(llm.generate(others, GREEDY, use_tqdm=False))
        assert got == expected
        shared = [next(i for i, (a, b) in enumerate(zip(o, first)) if a != b) for o in others]
        assert min(shared) >= 100 and llm.stats["num_prefix_cache_hit_tokens"] == sum(shared)
        assert_acceptance("self", llm.stats["spec_decode_draft_tokens"], llm.stats["spec_decode_accepted_tokens"])
        assert_idle(llm)

@pytest.mark.parametrize("draft", ["self", "other"])
def test_preemption_and_chunked_prefill_give_the_same_tokens(tiny_model, make_checkpoint, greedy_reference, draft):
    """10 blocks for 7 prompts growing to 3-5 blocks each: decode preempts (drafts never do, they take
    free blocks only), and a preempted sequence is recomputed in both caches; a 16-token budget prefills
    prompts in chunks and caps each step's drafts. The cache stays consistent step by step."""
    spec = draft_model(draft_dir(draft, tiny_model, make_checkpoint), 3)
    with engine(tiny_model, spec, num_kvcache_blocks=10, max_num_batched_tokens=16) as llm:
        completions = completions_step_by_step(llm, PROMPTS, GREEDY)
        assert completions == [out["token_ids"] for out in greedy_reference]
        stats = llm.stats
        assert stats["num_preemptions"] > 0
        assert_acceptance(draft, stats["spec_decode_draft_tokens"], stats["spec_decode_accepted_tokens"])
        assert_idle(llm)


def test_n_greedy_completions_are_all_the_greedy_tokens(spec, greedy_reference):
    llm, _, _ = spec
    outputs = llm.generate(PROMPTS, SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert tokens(outputs) == [[ref["token_ids"]] * 3 for ref in greedy_reference]
    assert_idle(llm)


def test_greedy_requests_batched_with_sampled_ones_keep_their_tokens(spec, greedy_reference):
    """Sampled requests (the draft draws, the target accepts or draws the residual) beside greedy ones
    change nothing for the greedy ones."""
    llm, _, _ = spec
    params = [GREEDY if i % 2 == 0 else
              SamplingParams(n=2, temperature=0.9, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True)
              for i in range(len(PROMPTS))]
    outputs = tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    assert outputs[::2] == tokens(greedy_reference)[::2]
    assert all(len(out) == 2 and all(len(c) == MAX_TOKENS for c in out) for out in outputs[1::2])
    assert_idle(llm)


# ---- where a completion ends ---------------------------------------------------------------------------
def test_max_tokens_ends_inside_an_accepted_run_exactly(self3, plain):
    """Up to 4 tokens a step (3 accepted drafts and the target's next): max_tokens 1 to 14 end every
    completion where plain decoding ends it, never past it."""
    lengths = list(range(1, 15))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(lengths))]
    before = self3.stats
    outputs = self3.generate(prompts, params, use_tqdm=False)
    assert [len(out["token_ids"]) for out in outputs] == lengths
    assert all(out["finish_reason"] == "length" for out in outputs)
    assert tokens(outputs) == tokens(plain.generate(prompts, params, use_tqdm=False))
    assert_acceptance("self", *drafted(self3, before)[1:])
    assert_idle(self3)


def test_the_figures_count_accepted_drafts_as_decoded_tokens(self3, plain):
    """llm.stats' num_decoded_tokens counts the tokens decode steps gave, accepted drafts included: under
    speculation as much as without (each completion's first token is its prefill's)."""
    def decoded(llm) -> int:
        before = llm.stats["num_decoded_tokens"]
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert all(len(out["token_ids"]) == MAX_TOKENS for out in outputs)
        return llm.stats["num_decoded_tokens"] - before
    assert decoded(self3) == decoded(plain) == len(PROMPTS) * (MAX_TOKENS - 1)
    assert self3.stats["spec_decode_accepted_tokens"] > 0


def test_a_stop_token_inside_an_accepted_run_drops_the_tokens_after_it(self3, plain, greedy_reference):
    """Each prompt stops on tokens of its greedy completion at positions 2 to 13 (their first occurrence
    there): with nearly every draft accepted, most come as accepted drafts inside a run; the completion
    ends where plain decoding ends it and the accepted tokens after the stop token are dropped."""
    prompts, params = [], []
    for prompt, ref in zip(PROMPTS, greedy_reference):
        completion = ref["token_ids"]
        firsts = [j for j in range(2, 14) if completion[j] not in completion[:j]]
        for j in firsts[:4]:
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[completion[j]]))
    expected = plain.generate(prompts, params, use_tqdm=False)
    assert sum(out["finish_reason"] == "stop" for out in expected) >= 8
    assert len({len(out["token_ids"]) % 4 for out in expected}) >= 3     # at every place of a 4-token run
    before = self3.stats
    outputs = self3.generate(prompts, params, use_tqdm=False)
    assert [(o["token_ids"], o["finish_reason"], o["stop_reason"]) for o in outputs] == \
        [(o["token_ids"], o["finish_reason"], o["stop_reason"]) for o in expected]
    assert_acceptance("self", *drafted(self3, before)[1:])
    assert_idle(self3)


# ---- sampling: seeded requests draw the same tokens again -------------------------------------------------
def test_a_seeded_request_draws_the_same_tokens_again(tiny_model, make_checkpoint):
    """Two engines of the same configuration, the same seeds: the same tokens (the draft's draws, the
    acceptance tests and the residual draws are all the request's); other seeds: other tokens."""
    assert_seeded_draws_repeat(tiny_model, draft_model(make_checkpoint(**DRAFT_SHAPES["other"]), 3), PROMPTS)


def test_a_mixed_batch_with_stop_strings_n_and_an_abort_ends_as_plain_decoding(tiny_model, make_checkpoint):
    assert_a_mixed_batch_ends_as_plain_decoding(tiny_model, draft_model(make_checkpoint(**DRAFT_SHAPES["other"]), 3),
                                                PROMPTS)


# ---- sampling: the law at a drafted position -------------------------------------------------------------
N_LAW = 4000           # enough to tell the residual from p: a rejected draft redrawn from p fails at 1e-3
LAW_PROMPT = random_prompts(1, VOCAB, (10, 10), seed=4102)[0]


@pytest.fixture(scope="module")
def law_models(tiny_model, make_checkpoint):
    """transformers' target and "other" draft: the exact laws of the first two positions."""
    return load_hf_model(tiny_model), load_hf_model(make_checkpoint(**DRAFT_SHAPES["other"]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_first_drafted_position_has_plain_decodings_law(tiny_model, make_checkpoint, law_models, temperature):
    """N seeded completions of one prompt, 3 tokens each: the first decode step drafts one token (k = 2,
    capped by max_tokens) for every completion, the next step none. The second token t2 is where the draft
    was verified: its law is plain decoding's, P(t2) = sum over t1 of p(t1) p(t2 | t1) (the target's
    softmax at the temperature; transformers' probabilities), and drafts are accepted at the rate
    sum over t1 of p(t1) sum over x of min(p(x | t1), q(x | t1)) (q: the draft's softmax), that is, also
    rejected, with the residual drawn."""
    target, draft = law_models
    with torch.inference_mode():
        first = torch.softmax(target(input_ids=torch.tensor([LAW_PROMPT])).logits[0, -1].double() / temperature, -1)
        contexts = torch.tensor([LAW_PROMPT + [t1] for t1 in range(VOCAB)])
        p = torch.softmax(target(input_ids=contexts).logits[:, -1].double() / temperature, -1)    # [t1, t2]
        q = torch.softmax(draft(input_ids=contexts).logits[:, -1].double() / temperature, -1)
    law, rate = drafted_position_law(first, p, q)

    spec = draft_model(make_checkpoint(**DRAFT_SHAPES["other"]), 2)
    params = SamplingParams(n=N_LAW, seed=31, temperature=temperature, max_tokens=3, ignore_eos=True)
    completions, stats = law_completions(tiny_model, spec, LAW_PROMPT, [params], N_LAW)
    assert_drafted_position_law(completions, stats, law, rate)


# ---- refusals -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case, words", [
    ("without a model", r"\bmodel\b"),
    ("a model that does not exist", "no-such-draft"),
    ("another vocabulary", "vocab"),
    ("a model for the n-gram method", r"\bmodel\b"),
])
def test_a_bad_draft_model_config_is_refused_by_name(tiny_model, make_checkpoint, tmp_path, case, words):
    spec = {
        "without a model": {"method": "draft_model", "num_speculative_tokens": 2},
        "a model that does not exist": draft_model(tmp_path / "no-such-draft", 2),
        "another vocabulary": draft_model(make_checkpoint(num_hidden_layers=1, vocab_size=384), 2),
        "a model for the n-gram method": {"method": "ngram", "num_speculative_tokens": 2, "model": str(tiny_model)},
    }[case]
    with pytest.raises(ValueError, match=words):
        engine(tiny_model, spec).exit()
