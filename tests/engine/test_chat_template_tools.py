"""Conversations with tools through the chat template (engine/chat_template.py, which LLM.chat and the
server share): an assistant turn that calls tools may have no content, a tool message answers it, the
calls' arguments reach the template as objects (as vLLM hands them over), and `tools` and
`chat_template_kwargs` are the template's to read; a template's refusal is a ValueError. Also what
every conversation shares: OpenAI text parts as content, continue_final_message, argument checks."""
import pytest

from nanovllm.engine.chat_template import TEXT_PART_SEPARATOR, conversations, message_text, render_chat

pytestmark = pytest.mark.cpu_only     # tokenizers and templates only

# prints what it is given: roles, content, the calls (arguments read as an object), tools and a kwarg
PRINTING_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}|{{ m.content }}{% for c in m.tool_calls or [] %}"
    "|{{ c.function.name }}:{{ c.function.arguments['city'] }}{% endfor %}"
    "{% if m.tool_call_id %}|{{ m.tool_call_id }}{% endif %}]{% endfor %}"
    "{% for t in tools or [] %}<{{ t.function.name }}>{% endfor %}"
    "{% if enable_thinking is defined %}thinking={{ enable_thinking }}{% endif %}"
    "{% if add_generation_prompt %}>{% endif %}")
CALL = {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
TURNS = [{"role": "user", "content": "Weather in Oslo?"},
         {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture
def tokenizer():
    from benchmarks.random_checkpoint import byte_level_tokenizer
    tokenizer = byte_level_tokenizer(512)
    tokenizer.chat_template = PRINTING_TEMPLATE
    return tokenizer


def rendered(tokenizer, messages, **kwargs) -> str:
    return tokenizer.decode(render_chat(tokenizer, "m", messages, **kwargs))


def test_tool_turns_tools_and_kwargs_reach_the_template(tokenizer):
    assert rendered(tokenizer, TURNS, tools=TOOLS, chat_template_kwargs={"enable_thinking": False}) == \
        "[user|Weather in Oslo?][assistant||get_weather:Oslo][tool|sunny|call-1]<get_weather>thinking=False>"
    assert rendered(tokenizer, TURNS[:1], add_generation_prompt=False) == "[user|Weather in Oslo?]"


def test_an_assistant_turn_with_calls_may_leave_content_out(tokenizer):
    turns = [TURNS[0], {"role": "assistant", "tool_calls": [CALL]}]
    assert conversations(turns) == [turns]
    assert rendered(tokenizer, turns) == "[user|Weather in Oslo?][assistant||get_weather:Oslo]>"
    assert turns[1] == {"role": "assistant", "tool_calls": [CALL]}      # the caller's messages are untouched
    assert CALL["function"]["arguments"] == '{"city": "Oslo"}'


def test_arguments_that_are_not_json_reach_the_template_as_text(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}{{ m.tool_calls[0].function.arguments }}{% endfor %}"
    call = {"type": "function", "function": {"name": "f", "arguments": "not json"}}
    assert rendered(tokenizer, [{"role": "assistant", "content": None, "tool_calls": [call]}],
                    add_generation_prompt=False) == "not json"


@pytest.mark.parametrize("messages, error, words", [
    ([{"role": "assistant"}], ValueError, "lacks 'content'"),          # no calls: content is needed
    ([{"role": "assistant", "tool_calls": "get_weather"}], TypeError, "tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"name": "f"}]}], TypeError, "tool_calls"),
])
def test_bad_tool_turns_are_refused(messages, error, words):
    with pytest.raises(error, match=words):
        conversations(messages)


def test_template_arguments_cannot_be_overridden_and_refusals_are_value_errors(tokenizer):
    with pytest.raises(ValueError, match="tokenize"):
        render_chat(tokenizer, "m", TURNS[:1], chat_template_kwargs={"tokenize": True})
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat(tokenizer, "m", TURNS[:1])


def test_smollm2s_template_renders_a_tool_turn():
    """The default model's template concatenates content: a call's turn with null content renders as empty."""
    from transformers import AutoTokenizer

    from nanovllm.utils.gguf_checkpoint import default_model
    tokenizer = AutoTokenizer.from_pretrained(default_model())
    text = tokenizer.decode(render_chat(tokenizer, "smollm2", TURNS, tools=TOOLS))
    assert "<|im_start|>assistant\n<|im_end|>" in text and "<|im_start|>tool\nsunny<|im_end|>" in text
    assert "None" not in text and text.endswith("<|im_start|>assistant\n")


# ---- content parts, continue_final_message, argument checks --------------------------------------------------
QUESTION = "Weather in Oslo?"


def test_text_content_parts_are_joined_as_the_server_joins_them(tokenizer):
    """OpenAI's content parts (vLLM's LLM.chat takes them): the template reads the texts joined, as the
    server's ChatMessage.as_dict joins them; the caller's message is left as it was."""
    parts = [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Oslo?"}]
    message = {"role": "user", "content": parts}
    assert rendered(tokenizer, [message]) == rendered(tokenizer, [{"role": "user", "content": "Weather\nin Oslo?"}])
    assert message["content"] == parts
    assert message_text(parts) == TEXT_PART_SEPARATOR.join(["Weather", "in Oslo?"]) == "Weather\nin Oslo?"   # vLLM's
    assert message_text([]) == "" and message_text(None) is None and message_text("x") == "x"


@pytest.mark.parametrize("content, error, words", [
    ([{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}], ValueError, "part 0 .* type 'image_url'"),
    ([{"type": "text", "text": "a"}, {"type": "input_audio"}], ValueError, "part 1 .* type 'input_audio'"),
    ([{"text": "no type"}], ValueError, "type None"),
    (["a bare string"], TypeError, "part 0 .* must be a dict"),
    ([{"type": "text", "text": 5}], TypeError, "str 'text'"),
    (5, TypeError, "content of message 0 of conversation 0 must be a str or a list of content parts"),
])
def test_content_other_than_text_is_refused_by_name(content, error, words):
    with pytest.raises(error, match=words):
        conversations([{"role": "user", "content": content}])


def test_continue_final_message_ends_the_prompt_inside_the_final_message(tokenizer):
    turns = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "It is"}]
    assert rendered(tokenizer, turns, add_generation_prompt=False) == "[user|Weather in Oslo?][assistant|It is]"
    assert rendered(tokenizer, turns, add_generation_prompt=False, continue_final_message=True) == \
        "[user|Weather in Oslo?][assistant|It is"
    parts = [turns[0], {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}]
    assert rendered(tokenizer, parts, add_generation_prompt=False, continue_final_message=True) == \
        "[user|Weather in Oslo?][assistant|It is"


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(continue_final_message=True), ValueError, "add_generation_prompt=False"),    # the default is True
    (dict(continue_final_message=True, add_generation_prompt=True), ValueError, "not both"),
    (dict(continue_final_message="content", add_generation_prompt=False), TypeError, "continue_final_message"),
    (dict(chat_template_kwargs="x"), TypeError, "chat_template_kwargs must be a dict .* got str"),
    (dict(chat_template_kwargs=[("enable_thinking", False)]), TypeError, "chat_template_kwargs"),
])
def test_bad_template_arguments_are_refused_by_name(tokenizer, kwargs, error, words):
    with pytest.raises(error, match=words):
        render_chat(tokenizer, "m", TURNS[:1], **kwargs)


def test_smollm2_continues_an_assistant_message():
    """The default model's template: the prompt ends in the assistant's text, with no <|im_end|> after it."""
    from transformers import AutoTokenizer

    from nanovllm.utils.gguf_checkpoint import default_model
    tokenizer = AutoTokenizer.from_pretrained(default_model())
    turns = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "The capital is"}]
    closed = tokenizer.decode(render_chat(tokenizer, "smollm2", turns, add_generation_prompt=False))
    text = tokenizer.decode(render_chat(tokenizer, "smollm2", turns, add_generation_prompt=False,
                                        continue_final_message=True))
    assert text.endswith("<|im_start|>assistant\nThe capital is") and closed.startswith(text)
    assert closed[len(text):] == "<|im_end|>\n"
