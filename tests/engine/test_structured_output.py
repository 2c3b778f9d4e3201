"""Structured outputs, on the real default model (SmolLM2-135M-Instruct, byte-level BPE) at temperature
1.0, where only the grammar keeps the output in shape: JSON schemas, JSON objects, regexes, choices and
EBNF grammars always conform and end on the end-of-sequence token; the masks are the grammar library's
own, token by token; they work with n, seeds, stop strings, penalties, log-probs, preemption, chunked
prefill and prefix-cache hits; a malformed constraint is a ValueError before anything runs."""
import functools
import json
import re

import pytest
import torch

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.utils.gguf_checkpoint import default_model

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(600),
              pytest.mark.cpu_only]     # every engine is device="cpu"

PERSON = {      # nested objects, an array, an enum, bounded numbers, strings with lengths; a short answer
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 16},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user"]},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
ASK = [{"role": "user", "content": "Describe a user of a web site."}]


@pytest.fixture(scope="module")
def llm():
    with LLM(default_model(), device="cpu") as engine:
        yield engine


def sampled(structured_outputs, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 120, **kwargs},
                          structured_outputs=structured_outputs)


@functools.lru_cache(maxsize=1)
def xgrammar_compiler(llm: LLM):
    info = xgr.TokenizerInfo.from_huggingface(llm.tokenizer, vocab_size=llm.vocab_size,
                                              stop_token_ids=sorted(llm.config.eos_token_ids))
    return xgr.GrammarCompiler(info)


def replay(llm: LLM, params: StructuredOutputsParams, token_ids: list[int]) -> bool:
    """Feed the output through xgrammar's own matcher: every token must be one its bitmask allows.
    Returns whether the grammar ended (its stop token accepted)."""
    compiler = xgrammar_compiler(llm)
    kind = params.kind
    if kind == "json":
        compiled = compiler.compile_json_schema(json.dumps(params.json),
                                                any_whitespace=not params.disable_any_whitespace)
    elif kind == "json_object":
        compiled = compiler.compile_json_schema('{"type": "object"}', strict_mode=False)
    elif kind == "regex":
        compiled = compiler.compile_regex(params.regex)
    else:
        compiled = compiler.compile_grammar(params.grammar)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, llm.vocab_size)
    for token_id in token_ids:
        matcher.fill_next_token_bitmask(bitmask)
        word = int(bitmask[0, token_id // 32]) & 0xFFFFFFFF
        assert (word >> (token_id % 32)) & 1, f"token {token_id} was not allowed here"
        assert matcher.accept_token(token_id)
    return matcher.is_terminated()


def test_json_schemas_are_always_met_and_the_masks_are_xgrammars(llm):
    params = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    outputs = llm.chat([ASK] * 3, [sampled(params, seed=s) for s in range(3)], use_tqdm=False)
    for output in outputs:
        assert output["finish_reason"] == "stop", output["text"]
        value = json.loads(output["text"])
        jsonschema.validate(value, PERSON)
        assert list(value) == list(PERSON["properties"])        # in the schema's order
        assert replay(llm, params, output["token_ids"])         # eos included, and it ended the grammar
    assert len({output["text"] for output in outputs}) > 1      # sampled, not one forced answer


def test_json_objects_regexes_choices_and_grammars(llm):
    """Each output conforms in full; one that max_tokens cut off is a prefix the grammar accepts."""
    ebnf = 'root ::= "(" num " " op " " num ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"'
    cases = [
        (StructuredOutputsParams(json_object=True), lambda text: isinstance(json.loads(text), dict)),
        (StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} \d{3}-\d{4}"),
         lambda text: re.fullmatch(r"[A-Z][a-z]{2,8} \d{3}-\d{4}", text)),
        (StructuredOutputsParams(choice=["yes", "no", 'maybe "so"', "é\n"]),
         lambda text: text in ("yes", "no", 'maybe "so"', "é\n")),
        (StructuredOutputsParams(grammar=ebnf), lambda text: re.fullmatch(r"\([1-9][0-9]? [+*-] [1-9][0-9]?\)", text)),
    ]
    ask = [{"role": "user", "content": "Answer in JSON: what is your name and age?"}]
    for params, conforms in cases:
        outputs = llm.chat([ask] * 2, [sampled(params, seed=s, max_tokens=40) for s in range(2)], use_tqdm=False)
        for output in outputs:
            ended = replay(llm, params, output["token_ids"]) if params.kind != "choice" else True
            if output["finish_reason"] == "length":
                assert not ended and len(output["token_ids"]) == 40
            else:
                assert output["finish_reason"] == "stop" and ended and conforms(output["text"]), output["text"]
        assert any(output["finish_reason"] == "stop" for output in outputs), params.kind


def test_choices_with_n_seeds_penalties_and_logprobs(llm):
    choices = ["red", "green", "blue", "yellow"]
    params = sampled(StructuredOutputsParams(choice=choices), n=8, seed=7, logprobs=3, repetition_penalty=1.3,
                     presence_penalty=0.5)
    [output] = llm.generate(["My favourite colour is"], params, use_tqdm=False)
    assert len(output["outputs"]) == 8
    for completion in output["outputs"]:
        assert completion["text"] in choices and completion["finish_reason"] == "stop"
        for token_id, top in zip(completion["token_ids"], completion["logprobs"]):
            assert top[token_id] > float("-inf")
            # the mask comes before the log-probs: a forbidden token never looks likely
            assert all(value == float("-inf") or token_id in top for value in top.values())
    again = llm.generate(["My favourite colour is"], params, use_tqdm=False)[0]
    assert [c["text"] for c in again["outputs"]] == [c["text"] for c in output["outputs"]]     # the seed holds
    assert len({c["text"] for c in output["outputs"]}) > 1


def test_a_stop_string_or_max_tokens_ends_a_constrained_output_early(llm):
    params = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    [stopped] = llm.chat(ASK, sampled(params, seed=3, stop=['"age"']), use_tqdm=False)
    assert stopped["finish_reason"] == "stop" and re.match(r'\{"name": ?"', stopped["text"])
    assert '"age"' not in stopped["text"]
    [cut] = llm.chat(ASK, sampled(params, seed=3, max_tokens=5), use_tqdm=False)
    assert cut["finish_reason"] == "length" and len(cut["token_ids"]) == 5 and cut["text"].startswith('{"')


def test_ignore_eos_goes_on_unconstrained_once_the_grammar_is_complete(llm):
    """With ignore_eos the stop token does not end the completion: the constraint's output comes first,
    then tokens run free to max_tokens (the engine died here once: a finished matcher asked for a mask)."""
    params = sampled(StructuredOutputsParams(regex="[a-z]{2}"), seed=1, max_tokens=12, ignore_eos=True)
    [output] = llm.generate(["Code:"], params, use_tqdm=False)
    assert output["finish_reason"] == "length" and len(output["token_ids"]) == 12
    assert re.match("[a-z]{2}", output["text"])
    assert llm.config.eos_token_ids & set(output["token_ids"])      # the grammar's stop token was drawn


def test_malformed_constraints_are_refused_before_anything_runs(llm):
    for params, words in [(StructuredOutputsParams(regex="(ab"), "regex"),
                          (StructuredOutputsParams(grammar="root ::= missing"), "grammar"),
                          (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}), "json")]:
        with pytest.raises(ValueError, match=f"structured_outputs.{words} is not valid"):
            llm.generate(["hello", "world"], [SamplingParams(), SamplingParams(structured_outputs=params)],
                         use_tqdm=False)
        assert llm.is_finished()        # the good request in the same call never started either
    # xgrammar parses this schema yet cannot compile it: still a refusal, and the engine goes on
    uncompilable = StructuredOutputsParams(json={"type": "string", "minLength": -1})
    with pytest.raises(ValueError, match="structured_outputs.json cannot be compiled: .*-1"):
        llm.generate(["hello", "world"], [SamplingParams(), SamplingParams(structured_outputs=uncompilable)],
                     use_tqdm=False)
    assert llm.is_finished()
    [output] = llm.generate(["hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(output["token_ids"]) == 3
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])


def test_structural_tags_in_both_of_vllms_forms_are_checked():
    from nanovllm.engine.structured_output import check_structured_outputs
    legacy = {"type": "structural_tag", "triggers": ["<f"],
              "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}]}
    current = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    for tag in (legacy, current):
        check_structured_outputs(StructuredOutputsParams(structural_tag=json.dumps(tag)))
    for bad in ('{"type": "structural_tag", "format": {"type": "nope"}}', "{"):
        with pytest.raises(ValueError, match="structured_outputs.structural_tag is not valid"):
            check_structured_outputs(StructuredOutputsParams(structural_tag=bad))


def test_constrained_outputs_survive_preemption_chunked_prefill_and_cache_hits(tiny_model):
    """A KV cache too small for the batch (sequences are preempted and recomputed), prompts longer than
    a step's token budget (chunked), and the same prompts again (prefix-cache hits): the seeded outputs
    equal those of an engine with room for everything. (A random tiny model with a byte-level vocabulary:
    only the grammar keeps it in shape, and its steps are fast.)"""
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "tags": {"type": "array", "items": {"enum": ["ab", "cd"]},
                                                        "maxItems": 4}},
              "required": ["id", "tags"]}
    params = [sampled(StructuredOutputsParams(json=schema, disable_any_whitespace=True), seed=s, max_tokens=40, n=2)
              for s in range(6)]
    prompts = [[(7 * i + j) % 500 + 1 for j in range(70 + 9 * i)] for i in range(6)]
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16) as roomy:
        expected = [o["outputs"] for o in roomy.generate(prompts, params, use_tqdm=False)]
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16, num_kvcache_blocks=20,
             max_num_batched_tokens=64, max_model_len=256) as tight:
        first = [o["outputs"] for o in tight.generate(prompts, params, use_tqdm=False)]
        assert tight.stats["num_preemptions"] > 0
        second = [o["outputs"] for o in tight.generate(prompts, params, use_tqdm=False)]
        assert tight.stats["num_prefix_cache_hit_tokens"] > 0
    assert first == expected and second == expected
    completions = [c for outputs in expected for c in outputs]
    for completion in completions:
        if completion["finish_reason"] == "stop":       # else max_tokens cut it: the equality above still holds
            jsonschema.validate(json.loads(completion["text"]), schema)
    assert sum(c["finish_reason"] == "stop" for c in completions) >= 4


def test_a_reasoning_parser_leaves_the_thinking_free_and_constrains_the_answer(llm):
    """With reasoning_parser set, a prompt whose template already closed the thinking (Qwen3 with
    enable_thinking=False writes an empty <think></think>) is constrained from the first token; one
    that opens a thought is not, until the output closes it."""
    from nanovllm.engine.structured_output import StructuredOutputs
    outputs = StructuredOutputs(llm.tokenizer, llm.vocab_size, llm.config.eos_token_ids, ("<think>", "</think>"))
    params = StructuredOutputsParams(choice=["yes", "no"])
    encode = llm.tokenizer.encode
    closed = outputs.new_state(params, encode("Question?<think>\n\n</think>\n\n"))
    assert closed.active
    thinking = outputs.new_state(params, encode("Question?<think>\n"))
    assert not thinking.active
    for token_id in encode("Hmm, let me see. </think>"):
        assert not thinking.active
        thinking.accept(token_id)       # any token while thinking
    assert thinking.active
    for token_id in encode("yes") + [llm.tokenizer.eos_token_id]:
        thinking.accept(token_id)
    assert thinking.matcher.is_terminated() and not thinking.broken


# ---- with speculative decoding -------------------------------------------------------------------------------
RECORD = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                           "tags": {"type": "array", "items": {"enum": ["ab", "cd"]},
                                                    "maxItems": 6}},
          "required": ["id", "tags"]}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}     # speculation on every decode step


def test_a_verifications_masks_are_the_grammars_after_each_draft_and_leave_the_state_as_it_was(llm):
    """Row j of a verification is masked as the grammar stands after draft[:j]; a draft token the grammar
    forbids ends the masked rows there (no later row can be emitted); while the model thinks, and after
    the grammar's stop token, the rows are free; and the state is left as it was (the matcher rolled back)."""
    from nanovllm.engine.structured_output import StructuredOutputs
    outputs = StructuredOutputs(llm.tokenizer, llm.vocab_size, llm.config.eos_token_ids, ("<think>", "</think>"))
    params = StructuredOutputsParams(json=RECORD, disable_any_whitespace=True)
    encode = llm.tokenizer.encode
    words = outputs.num_words

    def masks_fed(prefix_tokens: list[int], state_of) -> torch.Tensor:
        state = state_of()
        for token_id in prefix_tokens:
            state.accept(token_id)
        row = torch.zeros(1, words, dtype=torch.int32)
        state.matcher.fill_next_token_bitmask(row, 0)
        return row[0]

    answer = encode('{"id": 12, "tags": ["ab"')     # json.dumps' separators, as the grammar writes them
    bad = encode("?")                   # no JSON value goes on with it
    state = outputs.new_state(params, encode("Question?<think>\n\n</think>\n\n"))
    before = masks_fed([], lambda: state)
    bitmask = torch.zeros(len(answer) + 3, words, dtype=torch.int32)
    draft = answer + bad + encode("]}")
    rows = state.fill_draft_rows(draft, bitmask, 1)
    assert rows == list(range(len(answer) + 1))     # the rows up to the forbidden token's, none after it
    fresh = lambda: outputs.new_state(params, encode("Question?<think>\n\n</think>\n\n"))    # noqa: E731
    for n, j in enumerate(rows):
        assert torch.equal(bitmask[1 + n], masks_fed(draft[:j], fresh))
    assert torch.equal(masks_fed([], lambda: state), before)     # rolled back: the same next mask
    for token_id in answer:     # and the same path still open
        assert state.matcher.accept_token(token_id)

    ended = outputs.new_state(StructuredOutputsParams(choice=["yes"]), encode("Question?<think>\n\n</think>\n\n"))
    draft = encode("yes") + [llm.tokenizer.eos_token_id] + encode("more")
    rows = ended.fill_draft_rows(draft, bitmask, 0)
    assert rows == list(range(len(draft) - len(encode("more"))))    # free once the grammar has ended
    assert ended.active and not ended.matcher.is_terminated()       # its stop token rolled back too

    thinking = outputs.new_state(params, encode("Question?<think>\n"))
    thought = encode("Hmm. </think>")
    draft = thought + encode('{"id"')
    rows = thinking.fill_draft_rows(draft, bitmask, 0)
    assert rows == list(range(len(thought), len(draft) + 1))    # free until the thinking ends
    assert not thinking.active and not thinking.reasoning.ended    # its gate untouched


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_under_a_schema_gives_plain_decodings_tokens(tiny_model, method):
    """With n-gram drafts or a draft model (the target itself), greedy and seeded requests under a JSON
    schema (n = 2, beside an unconstrained one) give the tokens of the engine without speculation, drafts
    are accepted, and every completion that ends meets the schema."""
    spec = {"ngram": NGRAM,
            "draft_model": {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": 3,
                            "adaptive": False}}[method]
    constraint = StructuredOutputsParams(json=RECORD, disable_any_whitespace=True)
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16) as plain:
        text = '{"id": 31, "tags": ["ab", "cd", "ab"]} ' * 6     # a prompt the lookup finds the record in
        prompts = [plain.tokenizer.encode(text)] * 3 + [plain.tokenizer.encode("free text " * 8)]
        params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constraint),
                  sampled(constraint, seed=11, max_tokens=40, n=2),
                  sampled(constraint, seed=12, max_tokens=40, presence_penalty=0.5, logprobs=2),
                  SamplingParams(temperature=1.0, seed=13, max_tokens=30)]
        if method == "draft_model":     # a sampled draft's law is not plain decoding's draws: greedy only
            params = [params[0], params[0], params[0], SamplingParams(temperature=0.0, max_tokens=30)]
        expected = plain.generate(prompts, params, use_tqdm=False)
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16, speculative_config=spec) as fast:
        outputs = fast.generate(prompts, params, use_tqdm=False)
        assert fast.stats["spec_decode_accepted_tokens"] > 0
        assert fast.is_finished() and not fast.scheduler.block_manager.used_block_ids
    assert [[c["token_ids"] for c in o["outputs"]] for o in outputs] == \
        [[c["token_ids"] for c in o["outputs"]] for o in expected]
    for output in outputs[:3]:
        for completion in output["outputs"]:
            if completion["finish_reason"] == "stop":
                jsonschema.validate(json.loads(completion["text"]), RECORD)


def test_what_users_mix_under_speculation_and_a_tight_cache_ends_as_without(tiny_model):
    """Speculation with a KV cache too small for the batch (preemption, recomputation, chunked prompts):
    seeded n = 2 constrained completions that end at different steps, a greedy constrained request cut by a
    stop string, an unconstrained one, and a constrained request aborted mid-run; every request ends as in a
    roomy engine without speculation, and afterwards no block is held."""
    constraint = StructuredOutputsParams(json=RECORD, disable_any_whitespace=True)
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16) as roomy:
        # a record for the lookup to copy; each prompt its own first block, so no prefix is shared and the
        # ten blocks below really run short
        record = '{"id": 31, "tags": ["ab", "cd", "ab"]} '
        prompts = [roomy.tokenizer.encode(f"q{i} " + record) + [(7 * i + j) % 500 + 1 for j in range(9 * i)]
                   for i in range(4)]
        greedy = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constraint)
        middle = roomy.generate(prompts[:1], greedy, use_tqdm=False)[0]["text"][12:14]    # ends it mid-record
        params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constraint, stop=[middle])] + [
            sampled(constraint, seed=20 + i, max_tokens=16 + 12 * i, n=2) for i in range(2)] + [
            SamplingParams(temperature=1.0, seed=5, max_tokens=30)]
        expected = roomy.generate(prompts, params, use_tqdm=False)
    assert expected[0]["finish_reason"] == "stop"
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16, num_kvcache_blocks=10, max_num_batched_tokens=64,
             max_model_len=256, speculative_config=NGRAM) as tight:
        aborted = tight.add_request(prompts[3], sampled(constraint, seed=1, max_tokens=60))
        for _ in range(4):
            tight.step()
        tight.abort_request(aborted)
        outputs = tight.generate(prompts, params, use_tqdm=False)
        assert tight.stats["num_preemptions"] > 0 and tight.stats["spec_decode_accepted_tokens"] > 0
        assert tight.is_finished() and not tight.scheduler.block_manager.used_block_ids
    assert [[(c["token_ids"], c["finish_reason"]) for c in o["outputs"]] for o in outputs] == \
        [[(c["token_ids"], c["finish_reason"]) for c in o["outputs"]] for o in expected]
    assert len({len(c["token_ids"]) for o in outputs[1:3] for c in o["outputs"]}) > 1     # ended at different steps
