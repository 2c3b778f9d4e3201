"""Speculative decoding with n-gram drafts (issue #40), as a specification: the engine with a
speculative_config gives what the engine without one gives, token for token: greedy (on CPU float32), and
seeded sampling too (the verification draws each position with plain decoding's keys and law, see
layers/rejection_sampler.py), through preemption, chunked prefill, prefix-cache hits, n > 1, stop tokens and
max_tokens that end a completion inside an accepted run, penalties, min_tokens and log-probs; drafts are
proposed and accepted where a sequence repeats itself, and rejected elsewhere; the KV cache stays
consistent step by step, and a block computed under speculation serves a later prompt from the prefix
cache; at a drafted position the tokens follow plain decoding's exact law. The proposer and the
configuration: test_spec_decode_ngram.py; with structured outputs: test_structured_output.py."""
import numpy as np
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.ngram_proposer import ngram_draft
from sampling_reference import chi_square_p_value
from speculation import (BLOCK, GREEDY, REPEATING, VOCAB, assert_a_mixed_batch_ends_as_plain_decoding, assert_idle,
                         completions_step_by_step, engine, tokens)
from oracle import random_prompts

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.cpu_only]     # every engine is device="cpu"

RANDOM = random_prompts(3, VOCAB, (8, 40), seed=4001)
PROMPTS = REPEATING + RANDOM


def ngram(k: int, lookup_min: int = 1, lookup_max: int = 3, adaptive: bool = False) -> dict:
    """Speculation on every decode step unless adaptive (these tests are about its mechanics)."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": lookup_max, "adaptive": adaptive,
            "prompt_lookup_min": lookup_min}


@pytest.fixture(scope="module")
def plain(tiny_model):
    with engine(tiny_model) as llm:
        yield llm


@pytest.fixture(scope="module", params=[1, 3, 5, 31], ids=lambda k: f"k={k}")   # 31: the lookup workload's best
def spec(tiny_model, request):
    with engine(tiny_model, ngram(request.param)) as llm:
        yield llm


@pytest.fixture(scope="module")
def spec3(tiny_model):
    with engine(tiny_model, ngram(3)) as llm:
        yield llm


@pytest.fixture(scope="module")
def greedy_reference(plain):
    return plain.generate(PROMPTS, GREEDY, use_tqdm=False)


def drafted(llm: LLM, before: dict) -> tuple[int, int]:
    stats = llm.stats
    return (stats["spec_decode_draft_tokens"] - before["spec_decode_draft_tokens"],
            stats["spec_decode_accepted_tokens"] - before["spec_decode_accepted_tokens"])


# ---- greedy: token for token -----------------------------------------------------------------------------
def test_greedy_is_token_identical_to_plain_decoding(spec, greedy_reference):
    """Repeating prompts get drafts accepted, random ones get drafts rejected; the tokens are the same."""
    before = spec.stats
    outputs = spec.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(outputs) == tokens(greedy_reference)
    num_draft, num_accepted = drafted(spec, before)
    assert 0 < num_accepted < num_draft
    assert spec.stats["spec_decode_num_drafts"] > before["spec_decode_num_drafts"]
    assert_idle(spec)


def test_prefix_cache_hits_on_blocks_computed_under_speculation(spec, greedy_reference, plain):
    """The same prompts again hit their cached blocks; a prompt that extends a completion hits the blocks
    its decode steps filled, which hold the accepted tokens' KV only (else its continuation would differ)."""
    hits = spec.stats["num_prefix_cache_hit_tokens"]
    assert tokens(spec.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(greedy_reference)
    assert spec.stats["num_prefix_cache_hit_tokens"] > hits
    extended = [p + out["token_ids"][:34] for p, out in zip(PROMPTS, greedy_reference)]
    hits = spec.stats["num_prefix_cache_hit_tokens"]
    expected = plain.generate(extended, GREEDY, use_tqdm=False)
    assert tokens(spec.generate(extended, GREEDY, use_tqdm=False)) == tokens(expected)
    # each extended prompt finds at least its prompt's full blocks and one block of decoded tokens
    assert spec.stats["num_prefix_cache_hit_tokens"] - hits >= sum((len(p) // BLOCK + 1) * BLOCK for p in PROMPTS)
    assert_idle(spec)


def test_preemption_and_chunked_prefill_give_the_same_tokens(tiny_model, greedy_reference):
    """10 blocks for 7 prompts growing to 3-5 blocks each: decode preempts (drafts never do, they take
    free blocks only); a 16-token budget prefills prompts in chunks and caps each step's drafts."""
    with engine(tiny_model, ngram(3), num_kvcache_blocks=10, max_num_batched_tokens=16) as llm:
        completions_step_by_step(llm, PROMPTS, GREEDY)
        stats = llm.stats
        assert stats["num_preemptions"] > 0 and stats["spec_decode_accepted_tokens"] > 0
        assert_idle(llm)
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(greedy_reference)


def test_a_mixed_batch_with_stop_strings_n_and_an_abort_ends_as_plain_decoding(tiny_model):
    """The mix the drafters' files run too (speculation.assert_a_mixed_batch_ends_as_plain_decoding), with
    n-gram drafts."""
    stats = assert_a_mixed_batch_ends_as_plain_decoding(tiny_model, ngram(3), REPEATING)
    assert stats["spec_decode_accepted_tokens"] > 0


def test_seeded_n_completions_ending_at_different_steps_under_preemption_are_plain_decodings(tiny_model):
    """Seeded n = 3 requests whose completions end at different steps (stop token ids, varied max_tokens),
    with a stop string, in a cache too small for them all (10 blocks, no prefix caching: decode preempts and
    recomputes): every completion, its text and finish reason, is what plain decoding gives with room."""
    stops = list(range(3, VOCAB, 37))
    params = [SamplingParams(n=3, temperature=0.3, seed=90 + i, max_tokens=24 + 8 * i, stop_token_ids=stops,
                             stop=["zz"] if i == 1 else None, ignore_eos=True) for i in range(4)]
    with engine(tiny_model, ngram(3), num_kvcache_blocks=10, enable_prefix_caching=False) as llm:
        outputs = llm.generate(REPEATING, params, use_tqdm=False)
        stats = llm.stats
        assert_idle(llm)
    with engine(tiny_model) as llm:
        expected = llm.generate(REPEATING, params, use_tqdm=False)
    fields = [[(c["token_ids"], c["text"], c["finish_reason"]) for c in out["outputs"]] for out in outputs]
    assert fields == [[(c["token_ids"], c["text"], c["finish_reason"]) for c in out["outputs"]] for out in expected]
    assert len({len(c["token_ids"]) for out in outputs for c in out["outputs"]}) > 3
    assert stats["num_preemptions"] > 0 and stats["spec_decode_accepted_tokens"] > 0


def test_n_greedy_completions_are_all_the_greedy_tokens(spec, greedy_reference):
    outputs = spec.generate(REPEATING, SamplingParams(n=3, temperature=0.0, max_tokens=40, ignore_eos=True),
                            use_tqdm=False)
    assert tokens(outputs) == [[ref["token_ids"]] * 3 for ref in greedy_reference[:len(REPEATING)]]
    assert_idle(spec)


# ---- where a completion ends ---------------------------------------------------------------------------
def test_max_tokens_ends_inside_an_accepted_run_exactly(spec, plain):
    lengths = list(range(1, 15))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    prompts = [REPEATING[i % len(REPEATING)] for i in range(len(lengths))]
    outputs = spec.generate(prompts, params, use_tqdm=False)
    assert [len(out["token_ids"]) for out in outputs] == lengths
    assert all(out["finish_reason"] == "length" for out in outputs)
    assert tokens(outputs) == tokens(plain.generate(prompts, params, use_tqdm=False))
    assert_idle(spec)
    # max_tokens=None: up to max_model_len (256), whose last place an accepted run may reach too
    unbounded = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    outputs = spec.generate(REPEATING[:2], unbounded, use_tqdm=False)
    assert [len(p) + len(out["token_ids"]) for p, out in zip(REPEATING, outputs)] == [256, 256]
    assert tokens(outputs) == tokens(plain.generate(REPEATING[:2], unbounded, use_tqdm=False))
    assert_idle(spec)


def test_a_stop_token_inside_an_accepted_run_drops_the_tokens_after_it(spec3, plain, greedy_reference, monkeypatch):
    """Prompts that hold the start of their own greedy completion, each stopping on a token its completion
    repeats from it: the stop token comes as an accepted draft (for some of them), ends the completion
    where plain decoding ends it, and the accepted drafts after it are dropped."""
    prompts, params = [], []
    for prompt, ref in zip(REPEATING[1:], greedy_reference[1:]):
        head = prompt + ref["token_ids"][:20]
        for stop in sorted(set(ref["token_ids"][20:]) & set(head)):
            prompts.append(head)
            params.append(SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop]))
    expected = plain.generate(prompts, params, use_tqdm=False)
    assert sum(out["finish_reason"] == "stop" for out in expected) >= 5
    cut = []
    real_accept = spec3.spec_decode.accept

    def accept(seqs, drafts, token_ids, num_accepted, logprobs):
        lengths = [seq.num_tokens for seq in seqs]
        finished = real_accept(seqs, drafts, token_ids, num_accepted, logprobs)
        cut.extend(seq.num_tokens - before < gained + 1 for seq, before, gained in zip(seqs, lengths, num_accepted)
                   if seq in finished and seq.finish_reason == "stop")
        return finished
    monkeypatch.setattr(spec3.spec_decode, "accept", accept)
    outputs = spec3.generate(prompts, params, use_tqdm=False)
    assert [(o["token_ids"], o["finish_reason"], o["stop_reason"]) for o in outputs] == \
        [(o["token_ids"], o["finish_reason"], o["stop_reason"]) for o in expected]
    assert any(cut), "no stop token came inside an accepted run"
    assert_idle(spec3)


def test_a_stop_string_inside_an_accepted_run_cuts_the_text_as_plain_decoding(spec, plain):
    """min_tokens defers stop strings without banning anything: the completion of 64s (one repeated token)
    stops at its 20th, the first past min_tokens, deep inside a run of accepted drafts; the tokens after it
    are dropped."""
    text = spec.tokenizer.decode([64])
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=19, stop=[text], ignore_eos=True)
    out, ref = (llm.generate(REPEATING[:1], params, use_tqdm=False)[0] for llm in (spec, plain))
    assert ref["token_ids"] == [64] * 20 and ref["finish_reason"] == "stop"
    assert (out["token_ids"], out["text"], out["stop_reason"]) == (ref["token_ids"], ref["text"], text)
    assert_idle(spec)


# ---- sampling: the same draws ----------------------------------------------------------------------------
SEEDED = [
    dict(temperature=0.5, seed=1),
    dict(temperature=1.0, top_k=8, top_p=0.9, seed=2),
    dict(temperature=0.3, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.05, presence_penalty=0.05, seed=3),
    dict(temperature=0.9, top_k=5, min_tokens=12, stop_token_ids=[12, 41, 302], seed=4),
    dict(temperature=0.7, allowed_token_ids=list(range(64)) + list(range(300, 320)),
         logit_bias={7: 2.0, 12: 1.5, 41: -1.0, 303: 3.0}, repetition_penalty=1.1, seed=5),
]


@pytest.mark.parametrize("settings", SEEDED, ids=["plain", "filters", "penalties", "min_tokens", "allowed_bias"])
def test_seeded_sampling_draws_the_same_tokens_as_plain_decoding(spec3, plain, settings):
    """Each position is verified by a draw with plain decoding's key (seed, index, position) from plain
    decoding's law given the drafts before it (penalties count them, min_tokens too): a seeded request
    gains the very tokens plain decoding draws, n completions included."""
    params = SamplingParams(n=2, max_tokens=30, ignore_eos=True, **settings)
    before = spec3.stats
    outputs = spec3.generate(REPEATING + RANDOM[:1], params, use_tqdm=False)
    assert tokens(outputs) == tokens(plain.generate(REPEATING + RANDOM[:1], params, use_tqdm=False))
    assert drafted(spec3, before)[1] > 0
    assert_idle(spec3)


def test_logprobs_are_those_of_plain_decoding(spec3, plain):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3)
    outputs, expected = (llm.generate(REPEATING, params, use_tqdm=False) for llm in (spec3, plain))
    for out, ref in zip(outputs, expected):
        assert out["token_ids"] == ref["token_ids"] and len(out["logprobs"]) == 30
        for got, want in zip(out["logprobs"], ref["logprobs"]):
            assert got.keys() == want.keys()
            assert all(abs(got[t] - want[t]) < 1e-4 for t in got)
        assert out["cumulative_logprob"] == pytest.approx(ref["cumulative_logprob"], abs=1e-3)
    assert_idle(spec3)


# ---- sampling: the law at a drafted position -------------------------------------------------------------
LAW = dict(temperature=0.8, top_k=5)
N_LAW = 1000


def top5_probabilities(hf, prompts: list[list[int]]):
    import torch
    from sampling_reference import hf_probabilities
    with torch.inference_mode():
        return hf_probabilities(hf(input_ids=torch.tensor(prompts)).logits[:, -1], **LAW)


@pytest.fixture(scope="module")
def law_prompt(tiny_model):
    """A prompt after which the first token t1 is mostly one the prompt holds (lookup_min=1 then drafts the
    token after its earliest occurrence) and that draft is often likely: pairs (t1, the most likely next
    token) for the likely t1 are put in front, again and again (transformers computes the laws). Returns
    the prompt, the first token's law, and each likely t1's draft (or none) and the next token's law."""
    from oracle import load_hf_model
    hf = load_hf_model(tiny_model)
    prompt, best = [11, 12, 13] * 4, None
    for _ in range(8):
        first = top5_probabilities(hf, [prompt])[0]
        likely = first.nonzero().flatten().tolist()
        second = top5_probabilities(hf, [prompt + [t] for t in likely])
        drafts = [ngram_draft(np.array(prompt + [t]), 1, 1, 1).tolist() for t in likely]
        matched = sum(float(first[t]) for t, d in zip(likely, drafts) if d)
        accepted = sum(float(first[t] * second[i][d[0]]) for i, (t, d) in enumerate(zip(likely, drafts)) if d)
        if matched >= 0.5 and (best is None or accepted > best[0]):
            best = (accepted, prompt, first, dict(zip(likely, zip(drafts, second))))
        pairs = [x for i, t in enumerate(likely) for x in (t, int(second[i].argmax()))]
        prompt = pairs + prompt
    assert best is not None and best[0] > 0.05
    return best[1:]


def test_the_first_drafted_position_has_plain_decodings_law(tiny_model, law_prompt):
    """N seeded completions of one prompt (max_tokens 3: one draft at the first decode step): the second
    token, where t1 had a match and so a draft, follows the exact law of plain decoding there (mixed over
    t1, transformers' probabilities; Pearson's chi-square), drafts are accepted at the rate that law gives
    them and rejected otherwise, and plain decoding draws the very same tokens with the same seed."""
    prompt, first, following = law_prompt
    params = SamplingParams(n=N_LAW, seed=21, max_tokens=3, ignore_eos=True, **LAW)

    with engine(tiny_model, ngram(2, 1, 1), max_num_seqs=N_LAW, num_kvcache_blocks=N_LAW + 16) as llm:
        # three steps: the prefill (left in flight), its collection (the prompt ends in a match, so drafts may
        # follow t1) and the first decode step, verified; then the rest is dropped
        request = llm.add_request(prompt, params)
        finished = llm._step()[0] + llm._step()[0] + llm._step()[0]     # those that gained all 3 tokens end here
        seqs = sorted([*finished, *llm.scheduler.running], key=lambda seq: seq.index)
        assert [seq.index for seq in seqs] == list(range(N_LAW))
        gained = [seq.completion_token_ids[:2] for seq in seqs]
        llm.abort_request(request)
        assert_idle(llm)
        stats = llm.stats
    with engine(tiny_model, max_num_seqs=N_LAW, num_kvcache_blocks=N_LAW + 16) as llm:
        two = SamplingParams(n=N_LAW, seed=21, max_tokens=2, ignore_eos=True, **LAW)
        assert tokens(llm.generate([prompt], two, use_tqdm=False))[0] == gained
    drafted = [(t1, t2) for t1, t2 in gained if following[t1][0]]
    assert stats["spec_decode_num_drafts"] == len(drafted) > N_LAW // 3
    accepted = [following[t1][0][0] == t2 for t1, t2 in drafted]
    assert stats["spec_decode_accepted_tokens"] == sum(accepted) and 0 < sum(accepted) < len(accepted)
    # the law of t2 given that t1 was drafted for: sum over those t1 of p(t1) p(t2 | t1), renormalized
    law = sum(first[t1] * second for t1, (draft, second) in following.items() if draft)
    law = (law / law.sum()).double()
    rate = sum(float(first[t1] * second[draft[0]]) for t1, (draft, second) in following.items() if draft) / float(
        sum(first[t1] for t1, (draft, _) in following.items() if draft))
    assert abs(sum(accepted) / len(accepted) - rate) < 4 * (rate * (1 - rate) / len(accepted)) ** 0.5
    assert chi_square_p_value([t2 for _, t2 in drafted], law) > 1e-3


# ---- the adaptive policy: speculation where it measures faster ----------------------------------------------
def test_the_policy_speculates_where_it_measures_faster_and_retries_the_other_mode():
    from nanovllm.engine.spec_decode import SpeculationPolicy
    policy = SpeculationPolicy(retry_every=4)
    assert policy.speculate(3)                  # nothing measured: speculation first
    policy.record(3, True, tokens=1, seconds=3.0)       # its first step (a kernel compiling): not measured
    assert policy.speculate(3)                  # so speculation again
    policy.record(3, True, tokens=12, seconds=1.0)
    assert not policy.speculate(4)              # batch 4 is bucket 4 too (its 3rd step): plain decoding's turn
    policy.record(4, False, tokens=1, seconds=2.0)      # plain decoding's first step: not measured either
    assert not policy.speculate(4)
    policy.record(4, False, tokens=4, seconds=0.5)      # 8 tokens a second against speculation's 12
    decisions = [policy.speculate(4) for _ in range(8)]
    assert decisions.count(False) == 2 and decisions[3] is False    # the bucket's 8th and 12th steps retry
    policy.record(3, True, tokens=1, seconds=1.0)       # speculation falls to 12 + 0.2 * (1 - 12) = 9.8
    policy.record(3, True, tokens=1, seconds=1.0)       # ... and to 8.04: still ahead of 8
    assert policy.speculate(4) is True
    policy.record(3, True, tokens=1, seconds=1.0)       # 6.63: plain decoding is faster now
    assert [policy.speculate(4) for _ in range(3)] == [False, False, True]     # the 16th step retries
    assert policy.speculate(64) is True         # another bucket: measured on its own
    assert SpeculationPolicy(adaptive=False).speculate(1000)


def test_steps_with_nothing_to_draft_run_pipelined_and_a_match_collects_first(tiny_model):
    """A step without drafts is left in flight; while the known tokens hold no match, the next one launches
    beside it (plain decoding's pipelining, no drafts); where they do, the step in flight is collected first
    (a step that launches nothing) and the next one verifies drafts."""
    with engine(tiny_model, ngram(3), max_model_len=1024) as llm:
        distinct = list(range(100, 120))        # no token repeats: lookup finds nothing in the prompt
        llm.add_request(distinct, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        assert llm._step()[1] == len(distinct) and llm._in_flight is not None      # the prefill, in flight
        assert llm._step()[1] == -1 and llm._in_flight is not None      # a decode step launched beside it
        (seq,) = llm.scheduler.running or llm.scheduler.finishing
        assert seq.num_pending_tokens == 1
        while not llm.is_finished():
            llm._step()
        assert llm.stats["spec_decode_num_drafts"] == 0

        # every token of the vocabulary appears in the prompt, so whatever comes next matches, and so does
        # the prompt's last token
        everything = list(range(VOCAB)) + [5, 6]
        llm.add_request(everything, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert llm._step()[1] == len(everything) and llm._in_flight is not None
        assert llm._step()[1] == 0 and llm._in_flight is None      # a match: the prefill collected, nothing launched
        assert llm._step()[1] == -1 and llm._in_flight is None     # drafts verified and collected at once
        assert llm.stats["spec_decode_num_drafts"] == 1
        while not llm.is_finished():
            llm._step()
        assert_idle(llm)


def test_switching_modes_between_steps_gives_plain_decodings_tokens(tiny_model, greedy_reference, plain):
    """An adaptive engine made to alternate (speculation, plain pipelined steps, speculation after
    collecting the step in flight): greedy and seeded outputs are plain decoding's, nothing left behind."""
    with engine(tiny_model, ngram(3, adaptive=True)) as llm:
        turns = iter([True, True, False, False, False] * 1000)
        llm.spec_decode.policy.speculate = lambda batch_size: next(turns)
        before = llm.stats
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(greedy_reference)
        assert drafted(llm, before)[1] > 0
        params = SamplingParams(n=2, max_tokens=30, ignore_eos=True, temperature=0.9, seed=5)
        assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == tokens(plain.generate(PROMPTS, params,
                                                                                             use_tqdm=False))
        assert_idle(llm)
