"""LLM's conveniences over the engine: chat() through the tokenizer's chat template, the checkpoint's
default sampling parameters from generation_config.json, and the prompt forms vLLM's generate() takes."""
import json
import shutil

import pytest

from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.cpu_only     # every engine is device="cpu"

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
HAIKU = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a haiku about the sea."}]


def core(output: dict) -> tuple[str, list[int]]:
    return output["text"], output["token_ids"]


@pytest.fixture(scope="module")
def smollm2():
    from nanovllm.utils.gguf_checkpoint import default_model
    with LLM(default_model(), device="cpu", kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def tiny(tiny_model):
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=40) as llm:
        yield llm


def rendered_ids(llm: LLM, conversation: list[dict], add_generation_prompt: bool = True) -> list[int]:
    text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    return llm.tokenizer.encode(text, add_special_tokens=False)


# ---- chat ---------------------------------------------------------------------------------------------
def test_chat_is_generate_on_the_rendered_template(smollm2):
    ids = rendered_ids(smollm2, FRANCE)
    assert ids[0] == smollm2.tokenizer.convert_tokens_to_ids("<|im_start|>")      # no BOS added in front
    assert ids.count(ids[0]) == 3                                                 # system, user, assistant
    outputs = smollm2.chat(FRANCE, GREEDY, use_tqdm=False)
    assert outputs == smollm2.generate([ids], GREEDY, use_tqdm=False)
    assert len(outputs) == 1 and len(outputs[0]["token_ids"]) == GREEDY.max_tokens
    assert "Paris" in outputs[0]["text"]


def test_a_list_of_conversations_gives_one_output_each(smollm2):
    single = smollm2.chat(FRANCE, GREEDY, use_tqdm=False)
    both = smollm2.chat([FRANCE, HAIKU], GREEDY, use_tqdm=False)
    assert len(both) == 2
    assert core(both[0]) == core(single[0])
    assert core(both[1]) == core(smollm2.generate([rendered_ids(smollm2, HAIKU)], GREEDY, use_tqdm=False)[0])
    # and one SamplingParams per conversation
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    per = smollm2.chat([FRANCE, HAIKU], [short, GREEDY], use_tqdm=False)
    assert [len(o["token_ids"]) for o in per] == [2, GREEDY.max_tokens]
    assert per[0]["token_ids"] == single[0]["token_ids"][:2]


def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened(smollm2):
    with_prompt, without = rendered_ids(smollm2, FRANCE), rendered_ids(smollm2, FRANCE, add_generation_prompt=False)
    assert without != with_prompt and with_prompt[:len(without)] == without
    assert smollm2.tokenizer.decode(with_prompt[len(without):]).startswith("<|im_start|>assistant")
    outputs = smollm2.chat(FRANCE, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert outputs == smollm2.generate([without], GREEDY, use_tqdm=False)


def test_no_sampling_params_means_the_defaults(tiny, monkeypatch):
    monkeypatch.setattr(tiny, "get_default_sampling_params",
                        lambda: SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    outputs = tiny.chat(FRANCE, use_tqdm=False)
    assert len(outputs[0]["token_ids"]) == 3


def test_generate_without_sampling_params_takes_the_defaults(tiny, monkeypatch):
    monkeypatch.setattr(tiny, "get_default_sampling_params",
                        lambda: SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    [out] = tiny.generate([[5, 6, 7]], use_tqdm=False)
    assert len(out["token_ids"]) == 4


def test_generate_takes_vllms_prompt_forms(tiny):
    """One prompt alone (text or dict), {"prompt": text} and {"prompt_token_ids": ids} dicts, mixed in a list:
    each the same request as its plain form."""
    ids = tiny.tokenizer.encode("hello there")
    plain = [core(o) for o in tiny.generate(["hello there", ids], GREEDY, use_tqdm=False)]
    forms = [core(o) for o in tiny.generate([{"prompt": "hello there"}, {"prompt_token_ids": ids}], GREEDY,
                                            use_tqdm=False)]
    assert forms == plain
    assert [core(o) for o in tiny.generate("hello there", GREEDY, use_tqdm=False)] == plain[:1]
    assert [core(o) for o in tiny.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)] == plain[1:]
    assert tiny.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]["prompt_token_ids"] == ids


@pytest.mark.parametrize("prompts, error, words", [
    ([{"prompt": "a", "prompt_token_ids": [1]}], ValueError, "exactly one of"),
    ([{"prompt": "a", "multi_modal_data": {}}], ValueError, "multi_modal_data"),
    ([{}], ValueError, "exactly one of"),
    ([{"prompt": 3}], TypeError, "must be a str"),
    ([{"prompt_token_ids": "abc"}], TypeError, "list of ints"),
    ([{"prompt_token_ids": [1, 10 ** 6]}], ValueError, "outside the vocabulary"),
    ([5, 6, 7], TypeError, "flat list of ints"),
    (("a", "b"), TypeError, "prompts must be a list"),
])
def test_bad_prompt_forms_raise_before_any_work(tiny, prompts, error, words):
    with pytest.raises(error, match=words):
        tiny.generate(prompts, GREEDY, use_tqdm=False)
    assert tiny.is_finished()


GOOD = {"role": "user", "content": "hi"}


@pytest.fixture
def no_work(tiny, monkeypatch):
    """Neither generation nor the template may start: the check comes before both."""
    def started(*args, **kwargs):
        raise AssertionError("work started")
    monkeypatch.setattr(tiny, "generate", started)
    monkeypatch.setattr(tiny.tokenizer, "apply_chat_template", started)


@pytest.mark.parametrize("messages, error, words", [
    ("hello", TypeError, "messages must be a list"),
    (({"role": "user", "content": "hi"},), TypeError, "messages must be a list"),
    ([], ValueError, "messages is empty"),
    ([[]], ValueError, "conversation 0 is empty"),
    ([[GOOD], []], ValueError, "conversation 1 is empty"),
    (["hello"], TypeError, "conversation 0 must be a list"),
    ([[GOOD], GOOD], TypeError, "conversation 1 must be a list"),
    ([GOOD, "hello"], TypeError, "message 1 of conversation 0 must be a dict"),
    ([{"role": "user"}], ValueError, "lacks 'content'"),
    ([[GOOD], [GOOD, {"content": "x"}]], ValueError, "message 1 of conversation 1 lacks 'role'"),
    ([{}], ValueError, "lacks 'role' and 'content'"),
    ([{"role": 1, "content": "hi"}], TypeError, "role .* must be a str"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], ValueError, "'image_url'"),
])
def test_bad_messages_raise_before_any_work(tiny, no_work, messages, error, words):
    with pytest.raises(error, match=words):
        tiny.chat(messages, GREEDY, use_tqdm=False)
    assert tiny.scheduler.is_finished()


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(chat_template_kwargs="x"), TypeError, "chat_template_kwargs must be a dict"),
    (dict(continue_final_message=True), ValueError, "add_generation_prompt=False"),     # vLLM refuses both too
])
def test_bad_template_arguments_raise_before_any_work(tiny, no_work, kwargs, error, words):
    with pytest.raises(error, match=words):
        tiny.chat(FRANCE, GREEDY, use_tqdm=False, **kwargs)
    with pytest.raises(error, match=words):
        tiny.chat_prompt(FRANCE, **kwargs)
    assert tiny.scheduler.is_finished()


def test_chat_takes_openai_text_parts(tiny):
    """vLLM's LLM.chat takes content as a list of text parts: the same request as their text joined."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Answer briefly."},
                                          {"type": "text", "text": "What is the capital of France?"}]}]
    joined = [{"role": "user", "content": "Answer briefly.\nWhat is the capital of France?"}]    # vLLM's "\n"
    assert tiny.chat_prompt(parts) == tiny.chat_prompt(joined)
    assert core(tiny.chat(parts, GREEDY, use_tqdm=False)[0]) == core(tiny.chat(joined, GREEDY, use_tqdm=False)[0])


def test_continue_final_message_goes_on_with_the_assistant_turn(smollm2):
    """vLLM's continue_final_message: the prompt is the conversation up to the final message's last
    character (no end of turn, no new turn), and the model continues that message."""
    started = FRANCE + [{"role": "assistant", "content": "The capital of France is"}]
    closed = rendered_ids(smollm2, started, add_generation_prompt=False)
    ids = smollm2.chat_prompt(started, add_generation_prompt=False, continue_final_message=True)
    assert smollm2.tokenizer.decode(ids).endswith("<|im_start|>assistant\nThe capital of France is")
    assert closed[:len(ids)] == ids and smollm2.tokenizer.decode(closed[len(ids):]) == "<|im_end|>\n"
    outputs = smollm2.chat(started, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert outputs == smollm2.generate([ids], GREEDY, use_tqdm=False)
    assert "Paris" in outputs[0]["text"]


def test_a_tokenizer_without_a_chat_template_is_refused(tiny, monkeypatch):
    monkeypatch.setattr(tiny.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        tiny.chat(FRANCE, GREEDY, use_tqdm=False)
    assert tiny.scheduler.is_finished()


# ---- get_default_sampling_params ------------------------------------------------------------------------
def copy_checkpoint(source, destination, generation_config: dict | None):
    """A private copy of the session-shared checkpoint, with this generation_config.json (None: none)."""
    shutil.copytree(source, destination)
    path = destination / "generation_config.json"
    path.unlink(missing_ok=True)
    if generation_config is not None:
        path.write_text(json.dumps(generation_config))
    return destination


def test_generation_config_values_override_the_defaults(tiny_model, tmp_path):
    config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 5,
              "do_sample": True, "min_p": None, "eos_token_id": 509}
    path = copy_checkpoint(tiny_model, tmp_path / "checkpoint", config)
    with LLM(str(path), device="cpu", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=8) as llm:
        params = llm.get_default_sampling_params()
    assert isinstance(params, SamplingParams)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.6, 0.95, 20, 1.1)
    assert params.min_p == 0.0 and params.max_tokens == SamplingParams().max_tokens
    assert params == SamplingParams(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1)


def test_no_generation_config_gives_plain_sampling_params(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model, tmp_path / "checkpoint", None)
    with LLM(str(path), device="cpu", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=8) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_a_generation_config_without_sampling_keys_changes_nothing(tiny):
    assert tiny.get_default_sampling_params() == SamplingParams()     # transformers' own: token ids only


def test_smollm2_defaults(smollm2):
    params = smollm2.get_default_sampling_params()
    assert isinstance(params, SamplingParams)
