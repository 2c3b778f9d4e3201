"""Speculative decoding with an EAGLE-3 head (issue #40, vLLM's method "eagle3"), as a specification: a
one-layer draft head (models/eagle3.py, engine/eagle3_proposer.py) that reads the target's residual stream
entering three of its layers (eagle_config.eagle_aux_hidden_state_layer_ids) and drafts k tokens a decode
step, which the target verifies in one pass.

What the head computes (EAGLE-3, written out in plain torch below, `HeadReference`): for a sequence
x_0 .. x_T, g_p = fc(cat(h_a, h_b, h_c)) of the target's hidden states entering layers a, b, c at position p
(transformers' output_hidden_states[a], ...); at position p the head reads token p + 1's embedding (the
TARGET's embedding matrix) and g_p: x = cat(rms(embed, input_layernorm), rms(g, hidden_norm)), Llama attention
(q/k/v from x, rotary embedding with the head's own rope_theta, causal GQA over positions <= p), o_proj,
h1 = o + g, h2 = mlp(rms(h1, post_attention_layernorm)) + h1, logits = lm_head(rms(h2, norm)), in the head's
draft vocabulary (target id = draft id + d2t[draft id] when it has one of its own). A sequence of L tokens
drafts its first token from the head's output at position L - 2 (whose input is its last token), and draft
j + 1 from its output at position L + j - 2, which reads draft j with the head's own h2 at the position
before as its hidden state (no fc), attending to the K/V of the target's positions and of the drafts before.

So, at every decode step: a greedy request's drafts are those outputs' argmaxes, and a sampled request's
are drawn from q = softmax(logits / T) mapped onto the target's vocabulary, whatever steps wrote the
head's K/V before (batched prefill, prefix-cache hits on blocks written under speculation, chunked
prefill, preemption and recomputation, n > 1 completions split off a prompt, each reading its own first
token at the prompt's last position, a prefix-cache hit on a block that another token followed when it
was written, steps of constrained requests sampled after the engine went on). The outputs, as for the
draft_model method (test_spec_decode_draft_model.py, whose layout this file follows): greedy requests get
plain decoding's tokens, token for token (CPU float32), with a head of the target's vocabulary and one of a
smaller draft vocabulary; sampled ones keep the target's exact law (Pearson's chi-square at the first drafted
position, drafts accepted at the rate sum min(p, q) gives, q the head's law), and a seeded request draws the
same tokens again. Bad configurations are refused by name."""
import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from speculation import (BLOCK, GREEDY, MAX_TOKENS, REPEATING, VOCAB, assert_a_mixed_batch_ends_as_plain_decoding,
                         assert_idle, assert_seeded_draws_repeat, completions_step_by_step, engine,
                         greedy_drafting_every_step, law_completions, tokens)
from oracle import load_hf_model, random_prompts
from sampling_reference import assert_drafted_position_law, drafted_position_law

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.cpu_only]     # every engine is device="cpu"

TARGET = dict(num_hidden_layers=4)      # the default aux layers (2, L // 2, L - 3) need 4 layers, and repeat there
RANDOM = random_prompts(3, VOCAB, (8, 40), seed=4201)
PROMPTS = REPEATING + RANDOM
# random heads (benchmarks/random_checkpoint.write_random_eagle3_head), each with its aux layers given
# (distinct, in range): one of the target's vocabulary, one of 200 draft tokens (d2t) with a rope_theta of
# its own (the target's is 10000: the head's rotary embedding must be the head's)
HEADS = {
    "full": dict(aux_layer_ids=[0, 2, 3], seed=1),
    "small": dict(draft_vocab_size=200, aux_layer_ids=[1, 2, 3], seed=2, rope_theta=1000.0),
}
DECIDED_GAP = 1e-3          # a reference argmax is decided where its top-2 logits are further apart than this
LAW_TOLERANCE = 1e-5        # |q - reference law| (float32 engine against a float64 reference: ~1e-8 seen)


def eagle3(head, k: int) -> dict:
    """Speculation on every decode step (these tests are about its mechanics)."""
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k, "adaptive": False}


def sequences(prompts: list[list[int]], outputs: list[dict]) -> list[list[int]]:
    """Every completion's whole token list, prompt first."""
    return [prompt + c["token_ids"] for prompt, out in zip(prompts, outputs) for c in out["outputs"]]


# ---- the head in plain torch --------------------------------------------------------------------------------
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class HeadReference:
    """An EAGLE-3 head read from its config.json and model.safetensors, computed in float64 over whole
    sequences (see the module's docstring), on transformers' target."""

    def __init__(self, head_dir, hf_target):
        self.config = json.loads((head_dir / "config.json").read_text())
        tensors = load_file(str(head_dir / "model.safetensors"))
        self.d2t = tensors.pop("d2t", None)
        tensors.pop("t2d", None)
        self.w = {name: t.double() for name, t in tensors.items()}
        self.target = hf_target
        self.embedding = hf_target.get_input_embeddings().weight.detach().double()     # the target's
        self.layer_ids = self.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        self.cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @torch.inference_mode()
    def target_inputs(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, T, hidden] embeddings of tokens 1 .. T, [B, T, hidden] g = fc(the target's hidden states
        entering the aux layers at positions 0 .. T - 1)) of B sequences of T + 1 tokens each."""
        x = torch.tensor(seqs)
        t = x.shape[1] - 1
        entering = self.target(input_ids=x, output_hidden_states=True).hidden_states
        g = torch.cat([entering[i][:, :t].double() for i in self.layer_ids], dim=-1) @ self.w["fc.weight"].T
        return self.embedding[x[:, 1:]], g

    def layer(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head at positions 0 .. T - 1 reading embeds and hidden ([B, T, hidden] each), causal:
        ([B, T, draft vocab] logits, [B, T, hidden] its output before the final norm)."""
        c, w, m = self.config, self.w, "midlayer."
        eps, hd = c["rms_norm_eps"], c["head_dim"]
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        b, t = embeds.shape[:2]
        h = torch.cat([rms(embeds, w[m + "input_layernorm.weight"], eps), rms(hidden, w[m + "hidden_norm.weight"], eps)], -1)

        def heads(name: str, n: int) -> torch.Tensor:
            return (h @ w[f"{m}self_attn.{name}.weight"].T).view(b, t, n, hd).transpose(1, 2)
        q, k, v = heads("q_proj", nh), heads("k_proj", nkv), heads("v_proj", nkv)
        inv_freq = 1.0 / c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        q, k = q * angles.cos() + rotate_half(q) * angles.sin(), k * angles.cos() + rotate_half(k) * angles.sin()
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        scores = (q @ k.transpose(-1, -2)) * hd ** -0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, nh * hd) @ w[m + "self_attn.o_proj.weight"].T
        h1 = o + hidden
        y = rms(h1, w[m + "post_attention_layernorm.weight"], eps)
        h2 = (F.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T)) \
            @ w[m + "mlp.down_proj.weight"].T + h1
        return rms(h2, w["norm.weight"], eps) @ w["lm_head.weight"].T, h2

    def logits(self, seqs: list[list[int]]) -> torch.Tensor:
        """[B, T, draft vocab]: the head's logits at positions 0 .. T - 1 of B sequences of T + 1 tokens."""
        return self.layer(*self.target_inputs(seqs))[0]

    def of(self, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(embeddings, g, logits) of one whole sequence, computed once: a prefix's are their first rows
        (causal)."""
        key = tuple(seq)
        if key not in self.cache:
            embeds, g = self.target_inputs([seq])
            self.cache[key] = embeds[0], g[0], self.layer(embeds, g)[0][0]
        return self.cache[key]

    @torch.inference_mode()
    def draft_logits(self, whole: list[int], length: int, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, draft vocab]: the logits drafts 1, 2, .. of the sequence of whole's first
        `length` tokens are drawn from, given the drafts before each: draft 1 from position length - 2
        (reading the last token), draft j + 1 from position length + j - 2, reading draft j with the head's
        own output at the position before as its hidden state."""
        embeds, hidden, logits = (x[:length - 1] for x in self.of(whole))
        out = [logits[-1]]
        if drafts:
            before_norm = self.layer(embeds[None], hidden[None])[1][0, -1:]
        for draft in drafts:
            embeds = torch.cat([embeds, self.embedding[draft][None]])
            hidden = torch.cat([hidden, before_norm])
            logits, before_norm = self.layer(embeds[None], hidden[None])
            out.append(logits[0, -1])
            before_norm = before_norm[0, -1:]
        return torch.stack(out)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def law(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """softmax(logits / T) over the draft vocabulary, onto the target's ([..., VOCAB])."""
        probs = torch.softmax(logits / temperature, dim=-1)
        ids = self.to_target(torch.arange(probs.size(-1)))
        return probs.new_zeros(*probs.shape[:-1], VOCAB).index_copy_(-1, ids, probs)


# ---- what the engine drafts -----------------------------------------------------------------------------------
class Proposals:
    """Wraps llm.model_runner.propose_drafts: each proposal's drafting sequences, as (their tokens then, their
    temperature, their drafts, the laws q [drafts, VOCAB] they were drawn from: None when the whole batch is
    greedy). q is what the runner keeps for the verification (rows in its order: a sequence's drafts, then
    its bonus row)."""

    def __init__(self, llm: LLM, monkeypatch):
        runner = llm.model_runner
        original = runner.propose_drafts
        self.records: list[tuple[list[int], float, list[int], torch.Tensor | None]] = []

        def propose_drafts(seqs, lengths, first_tokens):
            drafts = original(seqs, lengths, first_tokens)
            q, row = runner._draft_probs, 0
            for seq, n, draft in zip(seqs, lengths, drafts):
                if n:
                    laws = None if q is None else q[row:row + n].double().clone()
                    self.records.append((list(seq.token_ids[:seq.num_tokens]), seq.sampling_params.temperature,
                                         list(draft), laws))
                row += n + 1
            return drafts
        monkeypatch.setattr(runner, "propose_drafts", propose_drafts)

    def take(self) -> list:
        records, self.records = self.records, []
        return records


def whole_sequence(record_tokens: list[int], seqs: list[list[int]]) -> list[int]:
    """A finished sequence that the tokens of a proposal begin (the head's output at a position depends on
    the tokens up to the next one only)."""
    matches = [seq for seq in seqs if seq[:len(record_tokens)] == record_tokens]
    assert matches, f"no output continues the drafting sequence {record_tokens}"
    return matches[0]


def check_greedy_drafts(reference: HeadReference, records: list, seqs: list[list[int]], first_only: bool = True
                        ) -> tuple[int, int]:
    """Each greedy draft (the first only, or all) is the reference's argmax (draft_logits), where decided;
    returns (decided, drafts checked)."""
    decided = total = 0
    for record_tokens, temperature, drafts, _ in records:
        if temperature > 0:
            continue
        checked = drafts[:1] if first_only else drafts
        all_logits = reference.draft_logits(whole_sequence(record_tokens, seqs), len(record_tokens), checked[:-1])
        for j, (draft, logits) in enumerate(zip(checked, all_logits)):
            total += 1
            top = logits.topk(2)
            if top.values[0] - top.values[1] > DECIDED_GAP:
                decided += 1
                assert draft == int(reference.to_target(top.indices[0])), (j + 1, len(record_tokens), record_tokens)
    return decided, total


def law_errors(reference: HeadReference, records: list, seqs: list[list[int]], first_only: bool = True
               ) -> list[list[float]]:
    """Per sampled proposal, max |q - the reference's law| of each of its drafts (the first only, or all)."""
    errors = []
    for record_tokens, temperature, drafts, q in records:
        if temperature > 0:
            checked = drafts[:1] if first_only else drafts
            all_logits = reference.draft_logits(whole_sequence(record_tokens, seqs), len(record_tokens), checked[:-1])
            laws = reference.law(all_logits, temperature)
            assert all(law[draft] > 0 for law, draft in zip(laws, checked))
            errors.append([float(e) for e in (q[:len(checked)] - laws).abs().amax(-1)])
    return errors


def worst(errors: list[list[float]], j: int) -> tuple[float, int, int]:
    """(largest error of draft j + 1, how many are over the tolerance, how many there are)."""
    column = [e[j] for e in errors if len(e) > j]
    return max(column), sum(e >= LAW_TOLERANCE for e in column), len(column)


# ---- fixtures ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(make_checkpoint):
    return make_checkpoint(**TARGET)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    from benchmarks.random_checkpoint import write_random_eagle3_head
    return {name: write_random_eagle3_head(tmp_path_factory.mktemp(f"eagle3-{name}"), target, **shape)
            for name, shape in HEADS.items()}


@pytest.fixture(scope="module")
def hf_target(target):
    return load_hf_model(target)


@pytest.fixture(scope="module")
def references(heads, hf_target):
    return {name: HeadReference(path, hf_target) for name, path in heads.items()}


@pytest.fixture(scope="module")
def plain(target):
    with engine(target) as llm:
        yield llm


@pytest.fixture(scope="module")
def greedy_reference(plain):
    return plain.generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module", params=[("full", 1), ("full", 3), ("small", 1), ("small", 3)],
                ids=lambda p: f"{p[0]}-k={p[1]}")
def spec(target, heads, request):
    """(engine, head name, k)"""
    name, k = request.param
    with engine(target, eagle3(heads[name], k)) as llm:
        yield llm, name, k


# ---- greedy: token for token ------------------------------------------------------------------------------------
def test_greedy_is_token_identical_to_plain_decoding(spec, greedy_reference):
    """Whatever the head proposes, the target's tokens are kept; every decode step with room for a draft
    speculates. A random head's drafts are mostly rejected: the drafts are counted, not accepted."""
    llm, _, k = spec
    num_draft, num_accepted = greedy_drafting_every_step(llm, k, PROMPTS, greedy_reference)
    assert num_accepted < num_draft
    assert_idle(llm)


def test_prefix_cache_hits_and_n_greedy_completions_give_the_greedy_tokens(spec, greedy_reference, plain):
    """The same prompts again hit their cached blocks, prompts that extend a completion hit the blocks its
    verifications filled, and n = 3 greedy completions are all the greedy tokens."""
    llm, _, _ = spec
    hits = llm.stats["num_prefix_cache_hit_tokens"]
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(greedy_reference)
    assert llm.stats["num_prefix_cache_hit_tokens"] > hits
    extended = [p + out["token_ids"][:34] for p, out in zip(PROMPTS, greedy_reference)]
    hits = llm.stats["num_prefix_cache_hit_tokens"]
    assert tokens(llm.generate(extended, GREEDY, use_tqdm=False)) == \
        tokens(plain.generate(extended, GREEDY, use_tqdm=False))
    assert llm.stats["num_prefix_cache_hit_tokens"] - hits >= sum((len(p) // BLOCK + 1) * BLOCK for p in PROMPTS)
    outputs = llm.generate(PROMPTS, SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert tokens(outputs) == [[ref["token_ids"]] * 3 for ref in greedy_reference]
    assert_idle(llm)


@pytest.mark.parametrize("head", list(HEADS))
def test_preemption_and_chunked_prefill_give_the_same_tokens(target, heads, greedy_reference, head):
    """10 blocks for 7 prompts growing to 3-5 blocks each: decode preempts, and a preempted sequence is
    recomputed (the head's K/V with it); a 16-token budget prefills prompts in chunks. The cache stays
    consistent step by step."""
    with engine(target, eagle3(heads[head], 3), num_kvcache_blocks=10, max_num_batched_tokens=16) as llm:
        completions = completions_step_by_step(llm, PROMPTS, GREEDY)
        assert completions == [out["token_ids"] for out in greedy_reference]
        stats = llm.stats
        assert stats["num_preemptions"] > 0
        assert 0 < stats["spec_decode_draft_tokens"]
        assert_idle(llm)


# ---- the head computes what EAGLE-3 defines ---------------------------------------------------------------------
@pytest.mark.parametrize("head", list(HEADS))
def test_each_first_draft_is_the_eagle3_heads_argmax(target, heads, references, monkeypatch, head):
    """At every decode step of greedy requests, the first draft of a sequence of L tokens is the reference
    head's argmax at position L - 2 (where its top two logits are apart): the head's K/V at every earlier
    position hold what EAGLE-3 defines, whichever steps wrote them. Scenarios: a batch of prompts (prefill,
    then decode steps and verifications, k = 2); the same prompts again (prefix-cache hits); prompts that
    extend a completion (hits on blocks whose K/V its verifications wrote); n = 3 (completions split off a
    prompt share its last output); and, in an engine of 10 blocks and a 16-token budget (k = 3), chunked
    prefill and preemption with recomputation."""
    reference = references[head]
    decided = total = 0

    def check(llm, recorder, prompts, params) -> list[dict]:
        nonlocal decided, total
        outputs = llm.generate(prompts, params, use_tqdm=False)
        found = check_greedy_drafts(reference, recorder.take(), sequences(prompts, outputs))
        decided, total = decided + found[0], total + found[1]
        return outputs

    with engine(target, eagle3(heads[head], 2)) as llm:
        recorder = Proposals(llm, monkeypatch)
        first = check(llm, recorder, PROMPTS, GREEDY)
        hits = llm.stats["num_prefix_cache_hit_tokens"]
        check(llm, recorder, PROMPTS, GREEDY)
        check(llm, recorder, [p + out["token_ids"][:34] for p, out in zip(PROMPTS, first)], GREEDY)
        assert llm.stats["num_prefix_cache_hit_tokens"] - hits >= 2 * len(PROMPTS) * BLOCK
        check(llm, recorder, PROMPTS[:3], SamplingParams(n=3, temperature=0.0, max_tokens=20, ignore_eos=True))
        assert_idle(llm)
    with engine(target, eagle3(heads[head], 3), num_kvcache_blocks=10, max_num_batched_tokens=16) as llm:
        recorder = Proposals(llm, monkeypatch)
        check(llm, recorder, PROMPTS, GREEDY)
        assert llm.stats["num_preemptions"] > 0
        assert_idle(llm)
    assert total >= 4 * len(PROMPTS) * (MAX_TOKENS // 2)
    assert decided >= 0.9 * total, (decided, total)


@pytest.fixture(scope="module", params=list(HEADS))
def mixed(target, heads, references, request):
    """(reference head, proposals, whole sequences) of sampled requests (T = 0.8, seeded, one completion
    each) batched with greedy ones, k = 3."""
    params = [GREEDY if i % 2 else SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(len(PROMPTS))]
    with engine(target, eagle3(heads[request.param], 3)) as llm, pytest.MonkeyPatch.context() as patch:
        recorder = Proposals(llm, patch)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert_idle(llm)
    return references[request.param], recorder.take(), sequences(PROMPTS, outputs)


def test_each_sampled_first_draft_is_drawn_from_the_heads_law(mixed):
    """At every decode step the law q a sampled sequence's first draft is drawn from (and verified against)
    is the reference head's softmax(logits / T) at position L - 2, mapped onto the target's vocabulary (zero
    outside a draft vocabulary); the greedy rows batched with them draft the argmax."""
    reference, records, seqs = mixed
    largest, over, count = worst(law_errors(reference, records, seqs), 0)
    assert count >= 4 * 10 and over == 0, (largest, over, count)
    decided, total = check_greedy_drafts(reference, records, seqs)
    assert total >= 3 * 10 and decided >= 0.9 * total


def test_each_later_draft_continues_on_the_heads_own_output(mixed):
    """Draft j + 1 (j >= 1) is drawn from the head at position L + j - 2, reading draft j with the head's own
    output at position L + j - 3 (before its final norm, no fc) as its hidden state, attending to the K/V
    of every position before it: the target's positions through L - 2, then the earlier drafts' (written
    as they were drafted). Sampled rows: q against the reference's law; greedy rows: the argmax."""
    reference, records, seqs = mixed
    errors = law_errors(reference, records, seqs, first_only=False)
    for j in (1, 2):
        largest, over, count = worst(errors, j)
        assert count >= 4 * 5 and over == 0, (f"draft {j + 1}", largest, over, count)
    decided, total = check_greedy_drafts(reference, records, seqs, first_only=False)
    assert total >= 3 * 10 * 3 and decided >= 0.9 * total, (decided, total)


def test_constrained_requests_draft_as_eagle3_defines(target, heads, references, monkeypatch):
    """A step with a request under a structured output is sampled once its token masks are known, after the
    engine has gone on (ModelRunner.sample_deferred): the head's K/V and kept outputs of that step are
    written then, so the first drafts of constrained greedy requests, batched with an unconstrained one, are
    the reference head's argmax as everywhere else (the head drafts unconstrained; the verification masks)."""
    reference = references["full"]
    constraint = StructuredOutputsParams(regex="[a-z]{3}( [a-z]{2,5}){4,9}")
    prompts = PROMPTS[:3]
    params = [SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=constraint)] * 2 + [GREEDY]
    with engine(target, eagle3(heads["full"], 2)) as llm:
        recorder = Proposals(llm, monkeypatch)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        records = recorder.take()
        assert_idle(llm)
    assert all(re.fullmatch("[a-z]{3}( [a-z]{2,5}){4,9}", out["text"]) for out in outputs[:2])
    assert sum(record[0][:len(prompt)] == prompt for record in records for prompt in prompts[:2]) >= 10
    decided, total = check_greedy_drafts(reference, records, sequences(prompts, outputs))
    assert total >= 20 and decided >= 0.9 * total, (decided, total)


# ---- sampling: seeded requests draw the same tokens again -------------------------------------------------------
def test_a_seeded_request_draws_the_same_tokens_again(target, heads):
    """Two engines of the same configuration, the same seeds: the same tokens (the head's draws, the
    acceptance tests and the residual draws are all the request's); other seeds: other tokens."""
    assert_seeded_draws_repeat(target, eagle3(heads["full"], 3), PROMPTS)


def test_a_mixed_batch_with_stop_strings_n_and_an_abort_ends_as_plain_decoding(target, heads):
    assert_a_mixed_batch_ends_as_plain_decoding(target, eagle3(heads["small"], 3), PROMPTS)


# ---- sampling: the law at a drafted position --------------------------------------------------------------------
N_LAW = 4000           # as test_spec_decode_draft_model.py's: a rejected draft redrawn from p fails at 1e-3
LAW_PROMPT = random_prompts(1, VOCAB, (10, 10), seed=4202)[0]


def test_the_first_drafted_position_has_plain_decodings_law(target, heads, references, hf_target):
    """N seeded requests of one prompt (n = 1 each: see the xfail below for n > 1), 3 tokens each: the first
    decode step drafts one token (k = 2, capped by max_tokens) for every request, the next step none. The
    second token t2 is where the draft was verified: its law is plain decoding's, P(t2) = sum over t1 of
    p(t1) p(t2 | t1) (transformers' target at T = 1), and drafts are accepted at the rate
    sum over t1 of p(t1) sum over x of min(p(x | t1), q(x | t1)), q the reference head's law at the
    prompt's last position reading t1. The head of 200 draft tokens: its q, zero on the other 312, is
    mapped onto the target's vocabulary for the rejection sampler (the full vocabulary's q is checked row by
    row above; one head keeps this test near 20 s). Random heads at T = 1 are accepted often enough for the
    rate to say something (about a sixth of this one's drafts, a third of the full head's): no sharpened
    head is needed."""
    head = "small"
    reference = references[head]
    with torch.inference_mode():
        first = torch.softmax(hf_target(input_ids=torch.tensor([LAW_PROMPT])).logits[0, -1].double(), -1)
        contexts = [LAW_PROMPT + [t1] for t1 in range(VOCAB)]
        p = torch.softmax(hf_target(input_ids=torch.tensor(contexts)).logits[:, -1].double(), -1)    # [t1, t2]
    q = reference.law(reference.logits(contexts)[:, -1], 1.0)                                       # [t1, x]
    law, rate = drafted_position_law(first, p, q)
    assert 0.05 < rate < 0.95

    params = [SamplingParams(seed=31 + i, temperature=1.0, max_tokens=3, ignore_eos=True) for i in range(N_LAW)]
    completions, stats = law_completions(target, eagle3(heads[head], 2), LAW_PROMPT, params, N_LAW)
    assert_drafted_position_law(completions, stats, law, rate)


# ---- refusals -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case, words", [
    ("without a model", r"\bmodel\b"),
    ("the target as its head", "EAGLE-3"),
    ("a head of another vocabulary", "vocab"),
    ("an aux layer out of range", "layers"),
    ("the default aux layers of 4 layers repeat", "layers"),
])
def test_a_bad_eagle3_config_is_refused_by_name(target, make_checkpoint, tmp_path, case, words):
    from benchmarks.random_checkpoint import write_random_eagle3_head

    def head(target_dir, **shape) -> dict:
        return eagle3(write_random_eagle3_head(tmp_path / "head", target_dir, **shape), 2)
    spec = {
        "without a model": lambda: {"method": "eagle3", "num_speculative_tokens": 2},
        "the target as its head": lambda: eagle3(target, 2),
        "a head of another vocabulary": lambda: head(make_checkpoint(**TARGET, vocab_size=384), aux_layer_ids=[0, 1, 2]),
        "an aux layer out of range": lambda: head(target, aux_layer_ids=[1, 2, 4]),
        "the default aux layers of 4 layers repeat": lambda: head(target),     # (2, 2, 1)
    }[case]()
    with pytest.raises(ValueError, match=words):
        engine(target, spec).exit()


# ---- a token after a block: completions split off a prompt, prefix-cache hits -----------------------------------
def test_sampled_completions_split_off_a_prompt_draft_from_their_own_first_token(target, heads, references,
                                                                                   monkeypatch):
    """n = 3 sampled completions of a prompt draw different first tokens t1; the head's position P - 1
    reads t1, so each completion's drafts (q at every later step) come from its own t1: each gets a copy of
    the block holding position P - 1, a partial one or (a prompt of two whole blocks) a full one."""
    reference = references["full"]
    prompts = PROMPTS[4:] + random_prompts(1, VOCAB, (2 * BLOCK, 2 * BLOCK), seed=4205)
    with engine(target, eagle3(heads["full"], 3)) as llm:
        recorder = Proposals(llm, monkeypatch)
        outputs = llm.generate(prompts, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)
        records = recorder.take()
        assert_idle(llm)
    assert all(len({c[0] for c in out}) > 1 for out in tokens(outputs))
    largest, over, count = worst(law_errors(reference, records, sequences(prompts, outputs)), 0)
    assert count >= 24 and over == 0, (largest, over, count)


def test_a_prefix_hit_on_a_block_followed_by_another_token(target, heads, references, monkeypatch):
    """Prompts sharing their first block (16 tokens) and differing from token 16 on, one after another: the
    head's K/V at position 15 read token 16, so each later one shares all of the block but that position,
    which it computes again (into a copy) with its own token 16. The first prompt sent again shares its
    blocks whole: each is followed by the token it was written with."""
    reference = references["full"]
    prompts = random_prompts(3, VOCAB, (6, 20), seed=4203, shared_prefix=random_prompts(1, VOCAB, (16, 16), seed=4204)[0])
    assert len({p[BLOCK] for p in prompts}) == len(prompts)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    with engine(target, eagle3(heads["full"], 3)) as llm:
        recorder = Proposals(llm, monkeypatch)
        outputs = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
        assert llm.stats["num_prefix_cache_hit_tokens"] == (len(prompts) - 1) * (BLOCK - 1)
        outputs.append(llm.generate([prompts[0]], params, use_tqdm=False)[0])
        assert llm.stats["num_prefix_cache_hit_tokens"] == (len(prompts) - 1) * (BLOCK - 1) + \
            (len(prompts[0]) - 1) // BLOCK * BLOCK
        records = recorder.take()
        assert_idle(llm)
    assert outputs[-1]["token_ids"] == outputs[0]["token_ids"]     # seeded: the same request draws the same
    largest, over, count = worst(law_errors(reference, records, sequences(prompts + prompts[:1], outputs)), 0)
    assert count >= 16 and over == 0, (largest, over, count)
