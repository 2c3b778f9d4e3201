"""What a request's SamplingParams promise, seen through LLM.generate() on CPU (vLLM's names and meanings).

Specified here:
  * seeds: a seeded request draws the same tokens alone, anywhere in any batch, and across preemption;
    another seed draws other tokens; n completions of one seeded request differ and repeat as a whole;
  * logprobs: log_softmax of the RAW logits (before penalties, bans and temperature), as transformers
    computes them by teacher forcing: the sampled token and the k most likely, and their running sum;
  * stop strings (on the real SmolLM2 tokenizer): matched in the growing text, across token boundaries,
    the earliest one wins, include_stop_str_in_output, min_tokens defers them;
  * stop_token_ids end a request like eos; min_tokens bans them (and eos) until that many tokens exist;
  * n: completions share the prompt's prefill and its full KV blocks (BlockManager.fork);
  * penalties: repetition as transformers' generate(), presence / frequency as a hand-written reference;
  * allowed_token_ids and logit_bias edit the logits before the penalties (greedy too), never the log-probs;
  * batching, chunked prefill and preemption change no seeded or greedy output (log-probs included);
  * the output dict: finish_reason, stop_reason, prompt_token_ids, outputs[0] on top;
  * SamplingParams rejects bad values, naming the field.
"""
import pytest
import torch
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from oracle import hf_greedy, load_hf_model, random_prompts
from sampling_reference import greedy_with_penalties, hf_generate_greedy, teacher_forced_logprobs

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.cpu_only]     # every engine is device="cpu"

BLOCK = 16
VOCAB = 512            # the tiny checkpoint's
COMPLETION_FIELDS = ("text", "token_ids", "finish_reason", "stop_reason", "logprobs", "cumulative_logprob")


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def sampled(max_tokens, **kw):
    return SamplingParams(temperature=kw.pop("temperature", 1.0), max_tokens=max_tokens, ignore_eos=True, **kw)


def ids(outputs):
    return [o["token_ids"] for o in outputs]


# ---- fixtures: each engine is built once for the module --------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=BLOCK, max_model_len=128,
             num_kvcache_blocks=64) as engine:
        yield engine


@pytest.fixture(scope="module")
def cramped(tiny_model):
    """5 blocks of 16 tokens for many requests: decode keeps preempting."""
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=BLOCK, max_model_len=128,
             num_kvcache_blocks=5) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf(tiny_model):
    return load_hf_model(tiny_model)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def chunked(tiny_model):
    """Prompts prefilled in chunks of at most 20 tokens, several requests per step."""
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=BLOCK, max_model_len=128,
             num_kvcache_blocks=64, max_num_batched_tokens=20) as engine:
        yield engine


@pytest.fixture(scope="module")
def eos_prompt(hf, llm):
    """A prompt whose greedy next token is eos (searched among random 6-token prompts)."""
    eos = llm.tokenizer.eos_token_id
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(8):
            candidates = torch.randint(0, eos, (1000, 6), generator=generator)
            hits = (hf(input_ids=candidates).logits[:, -1].argmax(-1) == eos).nonzero()
            if len(hits):
                return candidates[int(hits[0])].tolist()
    raise AssertionError("no prompt makes eos the greedy choice")


def assert_idle(engine):
    assert engine.is_finished()
    assert engine.scheduler.block_manager.used_block_ids == set()


# ---- 1. seeds ------------------------------------------------------------------------------------------
SEEDED = sampled(12, seed=1234)
SEEDED_FILTERED = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=77, max_tokens=12,
                                 ignore_eos=True)
PROMPT = random_prompts(1, VOCAB, (21, 21), seed=101)[0]
OTHERS = random_prompts(6, VOCAB, (3, 30), seed=102)


@pytest.mark.parametrize("params", [SEEDED, SEEDED_FILTERED], ids=["plain", "top_p_top_k_min_p"])
def test_a_seeded_request_draws_the_same_tokens_alone_and_anywhere_in_any_batch(llm, params):
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0]["token_ids"]
    assert len(alone) == 12
    assert llm.generate([PROMPT], params, use_tqdm=False)[0]["token_ids"] == alone
    noise = [sampled(m) for m in (5, 9, 14, 3, 12, 7)]      # unseeded neighbours, different lengths
    for position in (0, 2, 6):
        for size in (2, 4, 7):
            if position >= size:
                continue
            prompts, params_list = OTHERS[:size - 1], noise[:size - 1]
            prompts = prompts[:position] + [PROMPT] + prompts[position:]
            params_list = params_list[:position] + [params] + params_list[position:]
            got = llm.generate(prompts, params_list, use_tqdm=False)
            assert got[position]["token_ids"] == alone, (position, size)
    # among other seeded requests, and with a different seed next to it
    other_seed = SamplingParams(**{**vars(params), "seed": params.seed + 1})
    got = llm.generate([OTHERS[0], PROMPT, PROMPT], [other_seed, params, other_seed], use_tqdm=False)
    assert got[1]["token_ids"] == alone
    assert got[2]["token_ids"] != alone            # another seed: other tokens
    assert_idle(llm)


def test_different_seeds_draw_different_tokens_and_unseeded_requests_vary(llm):
    runs = [llm.generate([PROMPT], sampled(12, seed=s), use_tqdm=False)[0]["token_ids"] for s in (1, 2, 3)]
    assert len({tuple(r) for r in runs}) == 3
    unseeded = [llm.generate([PROMPT], sampled(12), use_tqdm=False)[0]["token_ids"] for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_seeded_requests_repeat_through_preemption(llm, cramped, monkeypatch):
    """Every seeded request of a crowded batch draws what it draws alone in a roomy engine, although the
    5-block engine preempts (and recomputes) them again and again."""
    prompts = random_prompts(12, VOCAB, (8, 30), seed=103)
    params = []
    for i in range(12):
        if i % 4 == 3:
            params.append(sampled(15))                                          # unseeded
        elif i % 4 == 2:
            params.append(SamplingParams(temperature=0.9, top_k=30, top_p=0.8, seed=500 + i, max_tokens=18,
                                         ignore_eos=True))
        else:
            params.append(sampled(18, seed=500 + i))
    expected = [llm.generate([p], sp, use_tqdm=False)[0]["token_ids"] for p, sp in zip(prompts, params)]
    preempted_seeds = set()
    real_preempt = cramped.scheduler.preempt

    def recording_preempt(seq):
        preempted_seeds.add(seq.sampling_params.seed)
        real_preempt(seq)
    monkeypatch.setattr(cramped.scheduler, "preempt", recording_preempt)
    before = cramped.stats["num_preemptions"]
    got = cramped.generate(prompts, params, use_tqdm=False)
    assert cramped.stats["num_preemptions"] > before
    assert preempted_seeds - {None}, "no seeded request was preempted: the test proves nothing"
    for i, (out, exp) in enumerate(zip(got, expected)):
        if params[i].seed is not None:
            assert out["token_ids"] == exp, i
        assert len(out["token_ids"]) == params[i].max_tokens
    assert_idle(cramped)


def test_n_seeded_completions_differ_and_the_request_repeats(llm):
    params = sampled(10, n=3, seed=42)
    first = llm.generate([PROMPT], params, use_tqdm=False)[0]
    completions = [c["token_ids"] for c in first["outputs"]]
    assert len(completions) == 3 and all(len(c) == 10 for c in completions)
    assert len({tuple(c) for c in completions}) == 3
    again = llm.generate([OTHERS[1], PROMPT, OTHERS[2]], [sampled(6), params, sampled(9, n=2)], use_tqdm=False)[1]
    assert [c["token_ids"] for c in again["outputs"]] == completions
    assert again["token_ids"] == completions[0]


# ---- 2. logprobs ---------------------------------------------------------------------------------------
def assert_logprobs_match(output, prompt, k, hf):
    """Every dict holds the sampled token and the k most likely, valued as transformers' raw log_softmax."""
    tokens, entries = output["token_ids"], output["logprobs"]
    assert isinstance(entries, list) and len(entries) == len(tokens)
    reference = teacher_forced_logprobs(hf, prompt, tokens)
    for i, (entry, token) in enumerate(zip(entries, tokens)):
        top = set(torch.topk(reference[i], k).indices.tolist()) if k else set()
        assert set(entry) == top | {token}, i
        for token_id, value in entry.items():
            assert value == pytest.approx(float(reference[i, token_id]), abs=1e-4), (i, token_id)
    assert output["cumulative_logprob"] == pytest.approx(sum(e[t] for e, t in zip(entries, tokens)), abs=1e-5)
    return reference


def test_greedy_logprobs_are_transformers_log_softmax(llm, hf):
    prompt = random_prompts(1, VOCAB, (19, 19), seed=201)[0]
    out = llm.generate([prompt], greedy(10, logprobs=5), use_tqdm=False)[0]
    reference = assert_logprobs_match(out, prompt, 5, hf)
    assert out["token_ids"] == reference.argmax(-1).tolist()
    for entry, token in zip(out["logprobs"], out["token_ids"]):
        assert len(entry) == 5 and entry[token] == max(entry.values())
    assert out["outputs"][0]["logprobs"] == out["logprobs"]


def test_sampled_logprobs_are_transformers_log_softmax(llm, hf):
    prompt = random_prompts(1, VOCAB, (26, 26), seed=202)[0]
    out = llm.generate([prompt], sampled(12, seed=9, logprobs=5), use_tqdm=False)[0]
    reference = assert_logprobs_match(out, prompt, 5, hf)
    assert out["token_ids"] != reference.argmax(-1).tolist()      # it did sample


def test_logprobs_are_raw_under_temperature_penalties_and_bans(llm, hf):
    """temperature, the penalties and min_tokens' eos ban change the draw, never the reported log-probs."""
    prompt = random_prompts(1, VOCAB, (17, 17), seed=203)[0]
    edited = [SamplingParams(temperature=0.5, repetition_penalty=1.3, seed=3, max_tokens=12, logprobs=4,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.3,
                             max_tokens=12, min_tokens=12, logprobs=3)]      # eos banned all along
    outs = llm.generate([prompt, prompt], edited, use_tqdm=False)
    for out, params in zip(outs, edited):
        assert_logprobs_match(out, prompt, params.logprobs, hf)
    # the greedy penalized request did not take the raw argmax everywhere: the log-probs are not its scores
    raw_argmax = teacher_forced_logprobs(hf, prompt, outs[1]["token_ids"]).argmax(-1).tolist()
    assert outs[1]["token_ids"] != raw_argmax


def test_logprobs_zero_holds_just_the_sampled_token_and_none_means_none(llm, hf):
    prompt = random_prompts(1, VOCAB, (9, 9), seed=204)[0]
    zero, none = llm.generate([prompt, prompt], [sampled(8, seed=1, logprobs=0), sampled(8, seed=1)],
                              use_tqdm=False)
    assert [list(e) for e in zero["logprobs"]] == [[t] for t in zero["token_ids"]]
    assert_logprobs_match(zero, prompt, 0, hf)
    assert none["token_ids"] == zero["token_ids"]
    assert none["logprobs"] is None and none["cumulative_logprob"] is None


def test_logprobs_of_n_completions_each_follow_their_own_tokens(llm, hf):
    """n=3 over a prompt of 2 full blocks + 3 tokens: every completion, including the two split off the
    parent (which got a copy of its partial last block), scores its own tokens as transformers does."""
    prompt = random_prompts(1, VOCAB, (2 * BLOCK + 3, 2 * BLOCK + 3), seed=205)[0]
    out = llm.generate([prompt], sampled(14, n=3, seed=11, logprobs=2), use_tqdm=False)[0]
    assert len(out["outputs"]) == 3
    for completion in out["outputs"]:
        assert_logprobs_match(completion, prompt, 2, hf)


# ---- 3. stop strings (SmolLM2: real text) --------------------------------------------------------------
SMOL_MAX_TOKENS = 30
NEVER = "this stop string is far too long to ever show up in a haiku"


@pytest.fixture(scope="module")
def smol():
    """The real SmolLM2-135M-Instruct (converted once and cached, as tests/models use it)."""
    from nanovllm.utils.gguf_checkpoint import default_model
    with LLM(default_model(), device="cpu", kvcache_block_size=BLOCK, max_model_len=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def smol_greedy(smol):
    """The greedy answer without stops: prompt, token ids, text, and offsets[k] = len(text of the first k tokens)."""
    tokenizer = smol.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}],
                                           tokenize=False, add_generation_prompt=True)
    out = smol.generate([prompt], SamplingParams(temperature=0.0, max_tokens=SMOL_MAX_TOKENS), use_tqdm=False)[0]
    tokens, text = out["token_ids"], out["text"]
    assert out["finish_reason"] == "length" and len(tokens) == SMOL_MAX_TOKENS
    offsets = [len(tokenizer.decode(tokens[:k], skip_special_tokens=True)) for k in range(len(tokens) + 1)]
    assert all(text.startswith(tokenizer.decode(tokens[:k], skip_special_tokens=True)) for k in range(len(tokens)))
    return prompt, tokens, text, offsets


def tokens_to_reach(offsets, end):
    """How many tokens it takes for the text to reach `end` characters."""
    return next(k for k, length in enumerate(offsets) if length >= end)


def boundary_stop(text, offsets):
    """A 4-character stop string made of the last 2 characters of token i and the first 2 of token i+1
    (its first occurrence in the text), and i + 2: the number of tokens that complete it."""
    for i in range(2, len(offsets) - 2):
        cut = offsets[i + 1]
        if cut - offsets[i] >= 2 and offsets[i + 2] - cut >= 2:
            stop = text[cut - 2:cut + 2]
            if text.find(stop) == cut - 2 and stop.strip() == stop:
                return stop, i + 2
    raise AssertionError("no token boundary to stop at")


def expected_stop(text, offsets, stop, min_tokens=0):
    """(text, number of tokens) where the first occurrence of `stop` completed past the first min_tokens
    tokens ends the greedy answer (vLLM's rule); None when no occurrence qualifies."""
    start = text.find(stop)
    while start >= 0:
        needed = tokens_to_reach(offsets, start + len(stop))
        if needed > min_tokens:
            return text[:start], needed
        start = text.find(stop, start + 1)
    return None


def test_stop_strings_cut_the_text_at_their_first_occurrence(smol, smol_greedy):
    prompt, tokens, text, offsets = smol_greedy
    stop, num = boundary_stop(text, offsets)
    cut = text.find(stop)
    # a later stop string, listed first: the earliest in the text wins, not the first listed
    later = next(w for w in text[cut + len(stop):].split() if len(w) >= 4 and text.find(w) > cut)
    # min_tokens past the stop string's first occurrence: it is not matched there
    min_tokens = num + 2
    deferred = expected_stop(text, offsets, stop, min_tokens)
    # min_tokens exactly the tokens that complete its first occurrence: too early still (vLLM's rule)
    deferred_at = expected_stop(text, offsets, stop, num)
    cases = {
        "one": SamplingParams(temperature=0.0, max_tokens=SMOL_MAX_TOKENS, stop=stop),
        "included": SamplingParams(temperature=0.0, max_tokens=SMOL_MAX_TOKENS, stop=[stop],
                                   include_stop_str_in_output=True),
        "earliest": SamplingParams(temperature=0.0, max_tokens=SMOL_MAX_TOKENS, stop=[later, stop]),
        "never": SamplingParams(temperature=0.0, max_tokens=SMOL_MAX_TOKENS, stop=["zebra", NEVER]),
        "min_tokens": SamplingParams(temperature=0.0, max_tokens=SMOL_MAX_TOKENS, stop=[stop], min_tokens=min_tokens),
        "min_tokens_at": SamplingParams(temperature=0.0, max_tokens=SMOL_MAX_TOKENS, stop=[stop], min_tokens=num),
        "at_the_limit": SamplingParams(temperature=0.0, max_tokens=num, stop=stop),     # the stop string wins
    }
    outs = dict(zip(cases, smol.generate([prompt] * len(cases), list(cases.values()), use_tqdm=False)))

    for name in ("one", "earliest", "at_the_limit"):
        out = outs[name]
        assert out["text"] == text[:cut], name
        assert out["token_ids"] == tokens[:num], name          # up to the token that completed it
        assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop), name
    assert outs["included"]["text"] == text[:cut + len(stop)]
    assert outs["included"]["token_ids"] == tokens[:num]
    assert (outs["included"]["finish_reason"], outs["included"]["stop_reason"]) == ("stop", stop)

    never = outs["never"]
    assert (never["finish_reason"], never["stop_reason"]) == ("length", None)
    assert never["token_ids"] == tokens and never["text"] == text

    for name, at_least, expected in (("min_tokens", min_tokens, deferred), ("min_tokens_at", num, deferred_at)):
        late = outs[name]
        assert len(late["token_ids"]) > at_least, name
        if expected is None:
            assert (late["finish_reason"], late["stop_reason"], late["token_ids"]) == ("length", None, tokens), name
        else:
            assert (late["text"], late["token_ids"]) == (expected[0], tokens[:expected[1]]), name
            assert (late["finish_reason"], late["stop_reason"]) == ("stop", stop), name


def test_min_tokens_defers_a_short_stop_string_listed_with_a_long_one(smol, smol_greedy):
    """A stop string completed before min_tokens is not matched, whatever other stop strings are listed:
    a long one must not make the search look back over text that appeared before min_tokens."""
    prompt, tokens, text, offsets = smol_greedy
    stop, num = boundary_stop(text, offsets)
    min_tokens = num + 2
    alone, with_long = smol.generate(
        [prompt, prompt],
        [SamplingParams(temperature=0.0, max_tokens=SMOL_MAX_TOKENS, stop=[stop], min_tokens=min_tokens),
         SamplingParams(temperature=0.0, max_tokens=SMOL_MAX_TOKENS, stop=[stop, NEVER], min_tokens=min_tokens)],
        use_tqdm=False)
    assert len(alone["token_ids"]) >= min_tokens
    assert (with_long["text"], with_long["token_ids"], with_long["finish_reason"], with_long["stop_reason"]) == \
        (alone["text"], alone["token_ids"], alone["finish_reason"], alone["stop_reason"])


def test_greedy_twins_stop_at_the_same_string(smol, smol_greedy):
    prompt, tokens, text, offsets = smol_greedy
    stop, num = boundary_stop(text, offsets)
    out = smol.generate([prompt], SamplingParams(temperature=0.0, max_tokens=SMOL_MAX_TOKENS, stop=stop, n=2),
                        use_tqdm=False)[0]
    for completion in out["outputs"]:
        assert (completion["text"], completion["token_ids"], completion["stop_reason"]) == \
            (text[:text.find(stop)], tokens[:num], stop)


# ---- 4. stop_token_ids and min_tokens -----------------------------------------------------------------
def first_new_token_at_or_after(tokens, start):
    return next(j for j in range(start, len(tokens)) if tokens[j] not in tokens[:j])


def test_a_stop_token_ends_the_request_like_eos(llm, tiny_tokenizer):
    prompt = random_prompts(1, VOCAB, (12, 12), seed=301)[0]
    g = llm.generate([prompt], greedy(16), use_tqdm=False)[0]["token_ids"]
    j = first_new_token_at_or_after(g, 3)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[g[j]]),
                       use_tqdm=False)[0]
    assert out["token_ids"] == g[:j + 1]
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", g[j])
    assert out["text"] == tiny_tokenizer.decode(g[:j])          # the stop token is not shown


def test_min_tokens_bans_stop_tokens_until_then(llm):
    prompt = random_prompts(1, VOCAB, (12, 12), seed=302)[0]
    g = llm.generate([prompt], greedy(16), use_tqdm=False)[0]["token_ids"]
    j = first_new_token_at_or_after(g, 1)
    assert j < 5
    stop_token = g[j]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, min_tokens=5,
                                                stop_token_ids=[stop_token]), use_tqdm=False)[0]
    tokens = out["token_ids"]
    assert tokens[:j] == g[:j] and tokens[j] != stop_token        # greedy took the next best there
    assert stop_token not in tokens[:5] and len(tokens) > 5
    if out["finish_reason"] == "stop":
        assert tokens.index(stop_token) == len(tokens) - 1 and out["stop_reason"] == stop_token
    else:
        assert stop_token not in tokens and len(tokens) == 16


def test_min_tokens_with_most_of_the_vocabulary_as_stop_tokens(llm):
    """400 of the 512 ids stop the request: the first 6 tokens avoid them all, then it stops at the first."""
    stops = list(range(0, 400))
    prompts = random_prompts(4, VOCAB, (5, 20), seed=303)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, min_tokens=6, stop_token_ids=stops)
              for s in range(4)]
    for out in llm.generate(prompts, params, use_tqdm=False):
        tokens = out["token_ids"]
        assert not set(tokens[:6]) & set(stops), tokens
        assert len(tokens) >= 7 and out["finish_reason"] == "stop", tokens
        assert tokens[-1] in stops and not set(tokens[6:-1]) & set(stops)
        assert out["stop_reason"] == tokens[-1]


def test_min_tokens_bans_eos_too(llm):
    """Every id but eos and two others is a stop token: before min_tokens only those two may come (eos,
    otherwise a third of the choices, is banned); right after, the request ends at once."""
    eos = llm.tokenizer.eos_token_id
    allowed = {100, 200}
    stops = [t for t in range(VOCAB) if t != eos and t not in allowed]
    prompts = random_prompts(4, VOCAB, (5, 10), seed=304)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, min_tokens=6, stop_token_ids=stops)
              for s in range(4)]
    for out in llm.generate(prompts, params, use_tqdm=False):
        tokens = out["token_ids"]
        assert set(tokens[:6]) <= allowed, tokens
        assert set(tokens[6:-1]) <= allowed and out["finish_reason"] == "stop", tokens
        assert out["stop_reason"] == (None if tokens[-1] == eos else tokens[-1])


def test_eos_stops_with_no_stop_reason_unless_ignored_or_banned(llm, hf, eos_prompt):
    eos = llm.tokenizer.eos_token_id
    stopped, ignored, banned = llm.generate(
        [eos_prompt] * 3, [SamplingParams(temperature=0.0, max_tokens=5), greedy(5),
                           SamplingParams(temperature=0.0, max_tokens=5, min_tokens=1)], use_tqdm=False)
    assert stopped["token_ids"] == [eos] and stopped["text"] == ""
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", None)
    assert ignored["token_ids"][0] == eos and len(ignored["token_ids"]) == 5 and ignored["finish_reason"] == "length"
    runner_up = int(teacher_forced_logprobs(hf, eos_prompt, [eos])[0].topk(2).indices[1])
    assert banned["token_ids"][0] == runner_up


def test_eos_listed_as_a_stop_token_still_stops_with_no_stop_reason(llm, eos_prompt):
    """As vLLM checks them: eos first (no stop_reason), then stop_token_ids; with ignore_eos, eos listed as
    a stop token is only that, and is the stop_reason."""
    eos = llm.tokenizer.eos_token_id
    listed, ignored = llm.generate([eos_prompt] * 2, [SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[eos]),
                                                      greedy(5, stop_token_ids=[eos])], use_tqdm=False)
    assert listed["token_ids"] == ignored["token_ids"] == [eos]
    assert (listed["finish_reason"], listed["stop_reason"]) == ("stop", None)
    assert (ignored["finish_reason"], ignored["stop_reason"]) == ("stop", eos)


@pytest.mark.parametrize("options", [dict(allowed_token_ids=[5], stop_token_ids=[5], min_tokens=1),
                                     dict(allowed_token_ids=["eos"], min_tokens=2),
                                     dict(allowed_token_ids=["eos", 7], stop_token_ids=[7], min_tokens=3)])
def test_min_tokens_that_leave_no_allowed_token_are_refused_up_front(llm, options):
    """min_tokens bans the stop tokens and eos; where allowed_token_ids allows nothing else, no token could
    be sampled: a ValueError naming it, nothing queued (not a row of -inf logits drawing token 0)."""
    eos = llm.tokenizer.eos_token_id
    options = dict(options, allowed_token_ids=[eos if t == "eos" else t for t in options["allowed_token_ids"]])
    with pytest.raises(ValueError, match="allowed_token_ids allows"):
        llm.generate([[9, 9, 9], [1, 2, 3]], [greedy(4), SamplingParams(max_tokens=6, **options)], use_tqdm=False)
    assert_idle(llm)


def test_min_tokens_with_one_allowed_token_left_samples_it(llm):
    """The refusal's edges: one allowed token that is not a stop token is enough, and eos is not banned
    where it is ignored."""
    eos = llm.tokenizer.eos_token_id
    left, ignored = llm.generate([[9, 9, 9]] * 2, [
        SamplingParams(temperature=1.0, seed=0, max_tokens=6, min_tokens=3, allowed_token_ids=[5, 6], stop_token_ids=[5]),
        SamplingParams(temperature=1.0, seed=0, max_tokens=4, min_tokens=2, allowed_token_ids=[eos], ignore_eos=True)],
        use_tqdm=False)
    assert left["token_ids"][:3] == [6, 6, 6] and set(left["token_ids"]) <= {5, 6}
    assert ignored["token_ids"] == [eos] * 4 and ignored["finish_reason"] == "length"


def test_out_of_vocabulary_stop_token_ids_are_refused_up_front(llm):
    """A stop token id the model cannot produce is harmless until min_tokens has to ban it; then the
    engine must refuse the request like an out-of-vocabulary prompt id (ValueError, nothing queued),
    not fail inside a step and abort every other request of the batch."""
    good = [9, 9, 9]
    bad = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[VOCAB + 88])
    with pytest.raises(ValueError, match=f"stop_token_ids|{VOCAB + 88}"):
        llm.generate([good, [1, 2, 3]], [greedy(4), bad], use_tqdm=False)
    assert_idle(llm)


# ---- 5. n completions ----------------------------------------------------------------------------------
def test_n_greedy_completions_are_identical_and_correct(llm, hf):
    prompt = random_prompts(1, VOCAB, (2 * BLOCK + 3, 2 * BLOCK + 3), seed=401)[0]
    out = llm.generate([prompt], greedy(20, n=4), use_tqdm=False)[0]
    assert len(out["outputs"]) == 4
    expected = hf_greedy(hf, prompt, 20)
    assert all(c["token_ids"] == expected for c in out["outputs"])
    assert all(c["text"] == out["text"] for c in out["outputs"])


def test_n_sampled_completions_are_prefilled_once(llm):
    prompt = random_prompts(1, VOCAB, (27, 27), seed=402)[0]
    before = llm.stats
    out = llm.generate([prompt], sampled(7, n=3), use_tqdm=False)[0]
    after = llm.stats
    assert [len(c["token_ids"]) for c in out["outputs"]] == [7, 7, 7]
    assert all(c["finish_reason"] == "length" for c in out["outputs"])
    assert after["num_preemptions"] == before["num_preemptions"]
    assert after["num_prefix_cache_hit_tokens"] == before["num_prefix_cache_hit_tokens"]
    assert after["num_prefilled_tokens"] - before["num_prefilled_tokens"] == len(prompt)
    for key in COMPLETION_FIELDS:
        assert out[key] == out["outputs"][0][key]


def test_n_completions_share_the_prompts_full_blocks_in_the_engine(llm):
    """After the prefill step: the 2 full prompt blocks are shared by all 3 (ref_count 3); each has its
    own copy of the partial third block."""
    prompt = random_prompts(1, VOCAB, (2 * BLOCK + 3, 2 * BLOCK + 3), seed=403)[0]
    manager = llm.scheduler.block_manager
    assert_idle(llm)
    llm.add_request(prompt, sampled(4, n=3))
    llm.step()
    seqs = list(llm.scheduler.running)
    assert len(seqs) == 3
    tables = [seq.block_table for seq in seqs]
    assert all(len(t) == 3 for t in tables)
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert [manager.blocks[b].ref_count for b in tables[0][:2]] == [3, 3]
    lasts = [t[2] for t in tables]
    assert len(set(lasts)) == 3 and all(manager.blocks[b].ref_count == 1 for b in lasts)
    assert manager.used_block_ids == set(tables[0][:2]) | set(lasts)
    parent_last = tables[[s.index for s in seqs].index(0)][2]
    assert sorted(llm.scheduler.block_copies) == sorted((parent_last, b) for b in lasts if b != parent_last)
    while not llm.is_finished():
        llm.step()
    assert_idle(llm)


def test_block_manager_fork_shares_full_blocks_and_copies_a_partial_one():
    manager = BlockManager(6, BLOCK)
    parent = Sequence(list(range(2 * BLOCK + 3)), SamplingParams(n=2), BLOCK)
    manager.allocate(parent)
    assert manager.can_fork(parent, 3)          # 3 free blocks for 3 partial copies
    assert not manager.can_fork(parent, 4)
    child = parent.fork(1)
    copy = manager.fork(parent, child)
    assert child.block_table[:2] == parent.block_table[:2]
    assert [manager.blocks[b].ref_count for b in parent.block_table] == [2, 2, 1]
    assert child.block_table[2] != parent.block_table[2] and manager.blocks[child.block_table[2]].ref_count == 1
    assert copy == (parent.block_table[2], child.block_table[2])
    assert manager.used_block_ids == set(parent.block_table) | set(child.block_table)
    manager.deallocate(child)
    assert [manager.blocks[b].ref_count for b in parent.block_table] == [1, 1, 1]
    manager.deallocate(parent)
    assert manager.used_block_ids == set() and manager.num_free_blocks == 6


def test_block_manager_fork_of_whole_blocks_copies_nothing():
    manager = BlockManager(2, BLOCK)
    parent = Sequence(list(range(2 * BLOCK)), SamplingParams(n=3), BLOCK)
    manager.allocate(parent)
    assert manager.num_free_blocks == 0 and manager.can_fork(parent, 2)
    children = [parent.fork(i) for i in (1, 2)]
    assert [manager.fork(parent, c) for c in children] == [None, None]
    assert all(c.block_table == parent.block_table for c in children)
    assert [manager.blocks[b].ref_count for b in parent.block_table] == [3, 3]


# ---- 6. penalties --------------------------------------------------------------------------------------
PENALTY_PROMPTS = random_prompts(3, VOCAB, (6, 25), seed=501)


def test_repetition_penalty_matches_transformers_generate(llm, hf):
    outs = llm.generate(PENALTY_PROMPTS, greedy(16, repetition_penalty=1.3), use_tqdm=False)
    for prompt, out in zip(PENALTY_PROMPTS, outs):
        assert out["token_ids"] == hf_generate_greedy(hf, prompt, 16, repetition_penalty=1.3)
    plain = llm.generate(PENALTY_PROMPTS, greedy(16), use_tqdm=False)
    assert ids(plain) != ids(outs)                 # the penalty mattered


@pytest.mark.parametrize("penalties", [dict(presence_penalty=0.7, frequency_penalty=0.4),
                                       dict(presence_penalty=-0.5, frequency_penalty=1.5),
                                       dict(presence_penalty=-1.0, frequency_penalty=-0.2, repetition_penalty=1.5)])
def test_presence_and_frequency_penalties_match_the_reference(llm, hf, penalties):
    outs = llm.generate(PENALTY_PROMPTS, greedy(16, **penalties), use_tqdm=False)
    for prompt, out in zip(PENALTY_PROMPTS, outs):
        expected = greedy_with_penalties(hf, prompt, 16, repetition=penalties.get("repetition_penalty", 1.0),
                                         presence=penalties["presence_penalty"],
                                         frequency=penalties["frequency_penalty"])
        assert out["token_ids"] == expected


def test_penalties_hold_in_a_crowded_batch_through_preemption(cramped, hf):
    """Penalized greedy requests among sampled ones in the 5-block engine: the output counts that the
    penalties read must survive preemption and recomputation, and never mix rows."""
    prompts = random_prompts(10, VOCAB, (5, 28), seed=502)
    params = [greedy(18, presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.1) if i % 2 == 0
              else sampled(18, frequency_penalty=1.0) for i in range(10)]
    before = cramped.stats["num_preemptions"]
    outs = cramped.generate(prompts, params, use_tqdm=False)
    assert cramped.stats["num_preemptions"] > before
    for i in range(0, 10, 2):
        assert outs[i]["token_ids"] == greedy_with_penalties(hf, prompts[i], 18, repetition=1.1, presence=0.7,
                                                             frequency=0.4), i
    assert_idle(cramped)


def test_penalized_greedy_twins_each_follow_the_reference(llm, hf):
    prompt = PENALTY_PROMPTS[0]
    out = llm.generate([prompt], greedy(14, n=2, presence_penalty=0.6, frequency_penalty=0.6), use_tqdm=False)[0]
    expected = greedy_with_penalties(hf, prompt, 14, presence=0.6, frequency=0.6)
    assert [c["token_ids"] for c in out["outputs"]] == [expected, expected]


# ---- 6b. allowed_token_ids and logit_bias -----------------------------------------------------------------
ALLOWED = list(range(100, 140))
BIAS = {101: 2.5, 117: -3.0, 139: 4.0, 400: 1.0}


@torch.inference_mode()
def greedy_with_edits(model, prompt_ids, max_tokens, allowed=None, bias=None, repetition=1.0):
    """Argmax decoding, the whole context recomputed every step, the last logits edited as vLLM orders
    it: every token outside `allowed` -inf, then `bias` added, then the repetition penalty."""
    output = []
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([prompt_ids + output])).logits[0, -1].float()
        if allowed is not None:
            keep = torch.full_like(logits, float("-inf"))
            keep[allowed] = 0.0
            logits = logits + keep
        for token, value in (bias or {}).items():
            logits[token] += value
        seen = torch.tensor(sorted(set(prompt_ids + output)))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / repetition, logits[seen] * repetition)
        output.append(int(logits.argmax()))
    return output


def test_allowed_token_ids_and_logit_bias_steer_greedy_as_the_reference(llm, hf):
    outs = llm.generate(PENALTY_PROMPTS, [greedy(12, allowed_token_ids=ALLOWED), greedy(12, logit_bias=BIAS),
                                          greedy(12, allowed_token_ids=ALLOWED, logit_bias=BIAS,
                                                 repetition_penalty=1.4)], use_tqdm=False)
    expected = [greedy_with_edits(hf, PENALTY_PROMPTS[0], 12, allowed=ALLOWED),
                greedy_with_edits(hf, PENALTY_PROMPTS[1], 12, bias=BIAS),
                greedy_with_edits(hf, PENALTY_PROMPTS[2], 12, allowed=ALLOWED, bias=BIAS, repetition=1.4)]
    assert ids(outs) == expected
    assert set(expected[0]) <= set(ALLOWED) and set(expected[2]) <= set(ALLOWED)
    assert expected[1] != ids(llm.generate(PENALTY_PROMPTS[1:2], greedy(12), use_tqdm=False))[0]   # it mattered


def test_sampled_tokens_stay_in_allowed_token_ids_and_logprobs_stay_raw(llm, hf):
    """Sampled with filters, n completions: every token is an allowed one, a +100 bias makes its token
    all but certain, and the log-probs are still those of the raw logits (teacher-forced)."""
    prompt = PENALTY_PROMPTS[0]
    params = sampled(16, n=3, top_p=0.95, top_k=30, allowed_token_ids=ALLOWED, logit_bias={123: 100.0},
                     logprobs=2, seed=31)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    for completion in out["outputs"]:
        assert set(completion["token_ids"]) == {123}
        assert_logprobs_match(completion, prompt, 2, hf)
    many, other = llm.generate([prompt, prompt], [sampled(40, n=2, allowed_token_ids=[7, 300, 450], seed=32),
                                                  sampled(30, allowed_token_ids=[8, 9], seed=33)], use_tqdm=False)
    tokens = [t for c in many["outputs"] for t in c["token_ids"]]
    assert set(tokens) == {7, 300, 450}
    assert set(other["token_ids"]) == {8, 9}           # another set in the same steps


def test_out_of_vocabulary_logit_bias_or_allowed_token_ids_are_refused_up_front(llm):
    for params in (greedy(4, logit_bias={VOCAB: 1.0}), greedy(4, allowed_token_ids=[3, VOCAB + 5])):
        with pytest.raises(ValueError, match="logit_bias|allowed_token_ids"):
            llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert len(llm.generate([[1, 2, 3]], greedy(4), use_tqdm=False)[0]["token_ids"]) == 4   # still usable
    assert_idle(llm)


# ---- everything at once: batching, chunked prefill and preemption change no deterministic output ------
MIXED_PROMPTS = random_prompts(7, VOCAB, (10, 30), seed=601)
MIXED_PARAMS = [
    sampled(14, seed=21, logprobs=3),
    greedy(14, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, logprobs=2),
    SamplingParams(temperature=0.9, top_k=50, seed=22, n=3, max_tokens=8, ignore_eos=True, logprobs=1),
    SamplingParams(temperature=1.0, seed=23, max_tokens=14, min_tokens=5, stop_token_ids=list(range(200))),
    sampled(12, seed=24, repetition_penalty=1.5, presence_penalty=1.0, top_p=0.8),
    sampled(12, frequency_penalty=0.3),         # unseeded: only its length is checked
    sampled(12, seed=25, allowed_token_ids=list(range(60, 200)), logit_bias={70: 2.0, 150: -4.0}, logprobs=2),
]


def assert_same_completion(got, expected, where):
    for key in ("token_ids", "finish_reason", "stop_reason", "text"):
        assert got[key] == expected[key], (where, key)
    if expected["logprobs"] is not None:
        assert [set(e) for e in got["logprobs"]] == [set(e) for e in expected["logprobs"]], where
        for g, e in zip(got["logprobs"], expected["logprobs"]):
            assert all(g[t] == pytest.approx(e[t], abs=1e-4) for t in e), where


@pytest.mark.parametrize("engine_name", ["chunked", "cramped"])
def test_a_mixed_batch_gives_each_request_what_it_gets_alone(request, llm, engine_name):
    engine = request.getfixturevalue(engine_name)
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(MIXED_PROMPTS, MIXED_PARAMS)]
    before = engine.stats["num_preemptions"]
    together = engine.generate(MIXED_PROMPTS, MIXED_PARAMS, use_tqdm=False)
    if engine_name == "cramped":
        assert engine.stats["num_preemptions"] > before
    for i, (got, expected) in enumerate(zip(together, alone)):
        assert len(got["outputs"]) == MIXED_PARAMS[i].n
        if MIXED_PARAMS[i].seed is None and not MIXED_PARAMS[i].greedy:
            assert len(got["token_ids"]) == MIXED_PARAMS[i].max_tokens
            continue
        for j, (g, e) in enumerate(zip(got["outputs"], expected["outputs"])):
            assert_same_completion(g, e, (engine_name, i, j))
    assert_idle(engine)


@pytest.mark.parametrize("engine_name", ["llm", "cramped"])
def test_greedy_rows_beside_sampled_ones_take_the_argmax_once_alone(request, llm, engine_name, monkeypatch):
    """A step whose rows are all plain greedy takes the argmax without sampling inputs (model_runner.run);
    a step with any other row builds them. Greedy requests ending at different steps (a stop token, lengths,
    min_tokens, n = 2) beside a short seeded one, under preemption too: each gets what it gets alone, and both
    kinds of step ran."""
    import nanovllm.engine.model_runner as model_runner
    engine = request.getfixturevalue(engine_name)
    prompts = random_prompts(5, VOCAB, (4, 14), seed=811)
    probe, early = (llm.generate([prompts[i]], greedy(13), use_tqdm=False)[0]["token_ids"] for i in (1, 4))
    # the last request's stop token comes second unbanned; min_tokens bans it for the first four tokens
    params = [greedy(6), greedy(13, stop_token_ids=[probe[5]]), greedy(11, n=2), sampled(4, seed=31),
              greedy(9, stop_token_ids=[early[1]], min_tokens=4)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    assert alone[1]["finish_reason"] == "stop" and len(alone[1]["token_ids"]) <= 6
    assert len(alone[4]["token_ids"]) >= 4 and alone[4]["token_ids"][1] != early[1]
    decisions, decide = [], model_runner.argmax_suffices

    def recorded(seqs):
        decisions.append(decide(seqs))
        return decisions[-1]
    monkeypatch.setattr(model_runner, "argmax_suffices", recorded)
    before = engine.stats["num_preemptions"]
    together = engine.generate(prompts, params, use_tqdm=False)
    if engine_name == "cramped":
        assert engine.stats["num_preemptions"] > before
    assert True in decisions and False in decisions
    for i, (got, expected) in enumerate(zip(together, alone)):
        assert len(got["outputs"]) == params[i].n
        for j, (g, e) in enumerate(zip(got["outputs"], expected["outputs"])):
            assert_same_completion(g, e, (engine_name, i, j))
    assert_idle(engine)


# ---- 7. the output dict --------------------------------------------------------------------------------
def test_length_finish_and_the_output_fields(llm, tiny_tokenizer):
    outs = llm.generate(["hello there", [7, 8, 9]], [greedy(5), sampled(3, n=2)], use_tqdm=False)
    text_out, list_out = outs
    assert text_out["prompt_token_ids"] == tiny_tokenizer.encode("hello there")
    assert list_out["prompt_token_ids"] == [7, 8, 9]
    assert [len(o["outputs"]) for o in outs] == [1, 2]
    for out in outs:
        for completion in out["outputs"]:
            assert (completion["finish_reason"], completion["stop_reason"]) == ("length", None)
            assert completion["logprobs"] is None and completion["cumulative_logprob"] is None
            # the text ends at its last whole character (tests/engine/test_output_text.py)
            assert completion["text"] == tiny_tokenizer.decode(completion["token_ids"]).rstrip("\ufffd")
        for key in COMPLETION_FIELDS:
            assert out[key] == out["outputs"][0][key], key
    assert len(text_out["token_ids"]) == 5 and len(list_out["token_ids"]) == 3
    # vLLM's attribute reads work on the same dicts: out.outputs[0].text, out.prompt_token_ids
    assert list_out.outputs[1].token_ids == list_out["outputs"][1]["token_ids"]
    assert text_out.text == text_out.outputs[0].text and text_out.prompt_token_ids == text_out["prompt_token_ids"]
    with pytest.raises(AttributeError, match="no 'request_id'"):
        text_out.request_id


def test_max_tokens_none_generates_up_to_max_model_len(llm, cramped):
    """As vLLM: max_tokens=None lets a request run until it stops or fills max_model_len (128 here), whatever
    its prompt's length, n completions included; a cache that could never hold a whole max_model_len sequence
    refuses it up front (the 5-block engine: 80 tokens)."""
    prompts = random_prompts(3, VOCAB, (5, 60), seed=701)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=None, min_tokens=3, ignore_eos=True, n=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        for completion in out["outputs"]:
            assert len(prompt) + len(completion["token_ids"]) == 128
            assert completion["finish_reason"] == "length"
    assert_idle(llm)
    with pytest.raises(ValueError, match="never fit"):
        cramped.generate([prompts[0]], SamplingParams(max_tokens=None), use_tqdm=False)
    assert_idle(cramped)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    """As vLLM: the last k prompt tokens, as if they were the prompt (prompt_token_ids too); -1 keeps
    max_model_len of them, which leaves no room and is refused; a shorter prompt is left whole."""
    prompt = random_prompts(1, VOCAB, (150, 150), seed=801)[0]          # longer than max_model_len (128)
    out = llm.generate([prompt], greedy(6, truncate_prompt_tokens=40), use_tqdm=False)[0]
    assert out["prompt_token_ids"] == prompt[-40:]
    assert out["token_ids"] == llm.generate([prompt[-40:]], greedy(6), use_tqdm=False)[0]["token_ids"]
    assert llm.generate([prompt[:10]], greedy(3, truncate_prompt_tokens=40), use_tqdm=False)[0][
        "prompt_token_ids"] == prompt[:10]
    with pytest.raises(ValueError, match="no room"):
        llm.generate([prompt], greedy(6, truncate_prompt_tokens=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="no room"):
        llm.generate([prompt], greedy(6), use_tqdm=False)
    assert_idle(llm)


# ---- 8. bad values -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(stop=[1]), "stop"), (dict(stop=""), "stop"), (dict(stop_token_ids=["a"]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(seed=1.5), "seed"), (dict(seed=True), "seed"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2.0), "max_tokens"), (dict(n=1.0), "n"),
    (dict(logprobs=True), "logprobs"),
    (dict(logit_bias={"a": 1.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={1: float("inf")}), "logit_bias"), (dict(logit_bias={1: "x"}), "logit_bias"),
    (dict(logit_bias=[1]), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-2]), "allowed_token_ids"), (dict(allowed_token_ids=[1.5]), "allowed_token_ids"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=2.5), "truncate_prompt_tokens"),
])
def test_bad_sampling_params_are_refused_naming_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):
        SamplingParams(**kwargs)


def test_good_edge_values_are_accepted():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop == ["x"]
    params = SamplingParams(top_p=1.0, min_p=1.0, logprobs=20, presence_penalty=-2.0, frequency_penalty=2.0,
                            seed=0, min_tokens=64, max_tokens=64, stop_token_ids=(3, 4))
    assert params.stop_token_ids == [3, 4]
