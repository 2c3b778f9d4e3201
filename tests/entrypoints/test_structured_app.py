"""Structured outputs, tools and reasoning through the OpenAI app over a fake engine (conftest.FakeEngine),
in process: each request field becomes the SamplingParams.structured_outputs vLLM would make of it; bad
ones, conflicting ones and "auto" tools without the server's flags are 400s in OpenAI's shape before
anything runs; a choice's text (the fake engine spells a script) comes back as reasoning, content and tool
calls, and streamed deltas add up to the non-streamed message."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from nanovllm.entrypoints.openai_app import build_app  # noqa: E402
from nanovllm.entrypoints.server_state import ChatOptions  # noqa: E402

pytestmark = [pytest.mark.cpu_only, pytest.mark.timeout(60)]     # a fake engine

CHAT = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time"}}      # no parameters


@pytest.fixture
def fake_engine(fake_engine):
    """conftest's, with room for the scripts these tests spell: a max_tokens of 200 past max_model_len
    would be refused (400)."""
    fake_engine.max_model_len = 512
    return fake_engine


def app_client(fake_engine, **options) -> TestClient:
    return TestClient(build_app(fake_engine, "fake", chat_options=ChatOptions(**options)))


@pytest.fixture
def client(fake_engine):
    with app_client(fake_engine) as client:
        yield client


@pytest.fixture
def hermes(fake_engine):
    with app_client(fake_engine, enable_auto_tool_choice=True, tool_call_parser="hermes") as client:
        yield client


def last_constraint(fake_engine):
    return list(fake_engine.requests.values())[-1].structured_outputs


def assert_400(response, param: str | None = None, match: str = "") -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    assert match in error["message"], error
    return error


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_each_source_becomes_structured_outputs(client, fake_engine, path):
    base = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    post = lambda **fields: client.post(path, json={**base, "max_tokens": 2, **fields})   # noqa: E731
    assert post(response_format={"type": "text"}).status_code == 200
    assert last_constraint(fake_engine) is None
    post(response_format={"type": "json_object"})
    assert last_constraint(fake_engine).json_object is True
    post(response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    assert last_constraint(fake_engine).json == SCHEMA
    post(structured_outputs={"choice": ["yes", "no"]})
    assert last_constraint(fake_engine).choice == ["yes", "no"]
    post(structured_outputs={"regex": "[0-9]+", "disable_any_whitespace": True})
    assert last_constraint(fake_engine).regex == "[0-9]+" and last_constraint(fake_engine).disable_any_whitespace
    post(structured_outputs={"grammar": 'root ::= "a"'})
    assert last_constraint(fake_engine).grammar == 'root ::= "a"'
    tag = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
           "triggers": ["<f>"]}
    post(response_format=tag)               # vLLM's: the whole format, as the engine reads it
    assert json.loads(last_constraint(fake_engine).structural_tag) == tag
    post(guided_json=SCHEMA)                # vLLM's older names
    assert last_constraint(fake_engine).json == SCHEMA
    post(guided_choice=["x"])
    assert last_constraint(fake_engine).choice == ["x"]


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json_schema": {}}}, "structured_outputs"),         # not a field of it
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": "regex"}, "structured_outputs"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_or_conflicting_constraints_are_400s_before_anything_runs(client, fake_engine, path, fields, param):
    base = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    assert_400(client.post(path, json={**base, **fields}), param)
    assert not fake_engine.requests


def test_tool_choice_required_and_named_become_json_schemas(client, fake_engine):
    client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER, TIME], "tool_choice": "required",
                                              "max_tokens": 2})
    schema = last_constraint(fake_engine).json
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == SCHEMA
    assert last_constraint(fake_engine).disable_any_whitespace      # compact calls
    assert "maxItems" not in schema
    client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER, TIME], "tool_choice": "required",
                                              "parallel_tool_calls": False, "max_tokens": 2})
    assert last_constraint(fake_engine).json["maxItems"] == 1       # one call only
    client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER, TIME], "max_tokens": 2,
                                              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert last_constraint(fake_engine).json == SCHEMA
    client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER], "tool_choice": "none",
                                              "max_tokens": 2})
    assert last_constraint(fake_engine) is None


def test_tool_choice_errors(client, fake_engine):
    post = lambda **fields: client.post("/v1/chat/completions", json={"messages": CHAT, **fields})   # noqa: E731
    for auto in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):   # auto is the default
        error = assert_400(post(**auto), "tool_choice")
        assert "--enable-auto-tool-choice" in error["message"] and "--tool-call-parser" in error["message"]
    assert_400(post(tool_choice="required"), "tool_choice", "`tools` must be set")
    assert_400(post(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
               "tool_choice.function.name", "nope")
    assert_400(post(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
               "response_format")
    assert post(tools=[WEATHER], tool_choice="sometimes").status_code == 400
    assert post(tools=[{"type": "function", "function": {"name": ""}}], tool_choice="none").status_code == 400
    assert not fake_engine.requests


def test_the_server_options_are_checked():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ChatOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes"):
        ChatOptions(tool_call_parser="pythonic")
    with pytest.raises(ValueError, match="qwen3"):
        ChatOptions(reasoning_parser="o1")


def events(response) -> list[dict]:
    assert response.status_code == 200, response.text
    data = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def streamed_message(chunks: list[dict], index: int = 0) -> dict:
    """A stream's deltas for one choice, added up into a message, and its finish_reason."""
    content, reasoning, reasoning_content, calls, finish = "", "", "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            reasoning_content += delta.get("reasoning_content") or ""
            for piece in delta.get("tool_calls", []):
                call = calls.setdefault(piece["index"], {"id": piece.get("id"), "type": piece.get("type"),
                                                         "function": {"name": piece["function"].get("name"),
                                                                      "arguments": ""}})
                call["function"]["arguments"] += piece["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    assert reasoning == reasoning_content
    return {"content": content or None, "reasoning": reasoning or None,
            "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def non_streamed(body: dict) -> dict:
    [choice] = body["choices"]
    message = choice["message"]
    return {"content": message["content"], "reasoning": message.get("reasoning"),
            "tool_calls": message.get("tool_calls", []), "finish_reason": choice["finish_reason"]}


def without_ids(message: dict) -> dict:
    return {**message, "tool_calls": [{**call, "id": None} for call in message["tool_calls"]]}


HERMES_SCRIPT = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_auto_tool_calls_parsed_streamed_and_not(hermes, fake_engine):
    fake_engine.script = HERMES_SCRIPT
    body = {"messages": CHAT, "tools": [WEATHER, TIME], "max_tokens": 200}
    whole = hermes.post("/v1/chat/completions", json=body).json()
    message = non_streamed(whole)
    assert message["content"] == "I will look." and message["finish_reason"] == "tool_calls"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
        == [("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in message["tool_calls"])
    streamed = streamed_message(events(hermes.post("/v1/chat/completions", json={**body, "stream": True})))
    assert without_ids(streamed) == without_ids(message)
    # cut off by max_tokens inside the second block: one call, finish_reason stays "length"
    cut = non_streamed(hermes.post("/v1/chat/completions", json={**body, "max_tokens": 100}).json())
    assert [c["function"]["name"] for c in cut["tool_calls"]] == ["get_weather"] and cut["finish_reason"] == "length"
    # tool_choice "none": the same text is plain content
    plain = non_streamed(hermes.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json())
    assert plain["content"] == HERMES_SCRIPT and plain["tool_calls"] == [] and plain["finish_reason"] == "stop"
    # no tools: no tool_calls field at all, as before
    bare = hermes.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 200}).json()
    assert bare["choices"][0]["message"] == {"role": "assistant", "content": HERMES_SCRIPT}


@pytest.mark.parametrize("choice, script, expected", [
    ("required", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]',
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Rome"}',
     [("get_weather", {"city": "Rome"})]),
])
def test_forced_tool_calls_streamed_and_not(client, fake_engine, choice, script, expected):
    fake_engine.script = script
    body = {"messages": CHAT, "tools": [WEATHER, TIME], "tool_choice": choice, "max_tokens": 200, "n": 2}
    whole = client.post("/v1/chat/completions", json=body).json()
    chunks = events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    for index in range(2):
        message = non_streamed({"choices": [whole["choices"][index]]})
        assert message["content"] is None and message["finish_reason"] == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
            == expected
        assert without_ids(streamed_message(chunks, index)) == without_ids(message)


@pytest.mark.parametrize("script, prompt_has_think, reasoning, content", [
    ("<think>\nThe user greets.\n</think>\n\nHello!", False, "\nThe user greets.\n", "\n\nHello!"),
    ("Hello!", False, None, "Hello!"),
    ("Some thought</think>Hello!", True, "Some thought", "Hello!"),      # the template opened the thinking
])
def test_reasoning_split_streamed_and_not(fake_engine, script, prompt_has_think, reasoning, content):
    fake_engine.script = script
    if prompt_has_think:
        fake_engine.tokenizer.chat_template += "{% if add_generation_prompt %}<think>\n{% endif %}"
    with app_client(fake_engine, reasoning_parser="qwen3") as client:
        body = {"messages": CHAT, "max_tokens": 200}
        whole = client.post("/v1/chat/completions", json=body).json()
        message = whole["choices"][0]["message"]
        assert (message["reasoning"], message["reasoning_content"]) == (reasoning, reasoning)
        assert message["content"] == content
        assert "tool_calls" not in message
        streamed = streamed_message(events(client.post("/v1/chat/completions", json={**body, "stream": True})))
        assert streamed == non_streamed(whole)


# an earlier assistant turn sent back with its thinking: the prompt's last reasoning marker is "</think>",
# more than a few tokens before its end
CLOSED_THINKING_CHAT = [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "<think>greet back</think>Hello!"},
                        {"role": "user", "content": "What is the weather in Oslo today, and tomorrow?"}]
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}


@pytest.mark.parametrize("fields, expected", [
    ({"tools": [WEATHER], "tool_choice": NAMED_WEATHER},
     {"content": None, "reasoning": None, "finish_reason": "tool_calls", "tool_calls": [
         {"id": None, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}),
    ({"response_format": JSON_FORMAT},
     {"content": '{"city": "Oslo"}', "reasoning": None, "finish_reason": "stop", "tool_calls": []}),
])
def test_deepseek_r1_prompt_that_closed_the_thinking_gets_the_answer_as_content(fake_engine, fields, expected):
    """deepseek_r1: a prompt whose last marker is "</think>" has ended the thinking; the engine then
    constrains the output from its first token (ReasoningGate), so that output is the answer: a forced call's
    arguments, a JSON content; not reasoning_content."""
    fake_engine.script = '{"city": "Oslo"}'
    with app_client(fake_engine, reasoning_parser="deepseek_r1") as client:
        body = {"messages": CLOSED_THINKING_CHAT, "max_tokens": 40, **fields}
        whole = client.post("/v1/chat/completions", json=body).json()
        message = non_streamed(whole)
        assert without_ids(message) == expected
        streamed = streamed_message(events(client.post("/v1/chat/completions", json={**body, "stream": True})))
        assert without_ids(streamed) == expected


def test_deepseek_r1_output_is_reasoning_until_the_end_marker_otherwise(fake_engine):
    """No marker in the prompt (R1's template may leave the opening <think> to the model): reasoning first."""
    fake_engine.script = "Oslo, so rain.</think>Rain."
    with app_client(fake_engine, reasoning_parser="deepseek_r1") as client:
        body = {"messages": CLOSED_THINKING_CHAT[-1:], "max_tokens": 40}
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Oslo, so rain.", "Rain.")


def test_tool_messages_and_template_kwargs_reach_the_template(hermes, fake_engine):
    """An assistant turn with tool_calls (content null) and the tool's answer render; tools and
    chat_template_kwargs are the template's to read (here a template that prints them)."""
    fake_engine.tokenizer.chat_template = (
        "{% for m in messages %}[{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}{{ m.tool_call_id or '' }}]{% endfor %}"
        "{% for t in tools or [] %}<{{ t.function.name }}>{% endfor %}{{ flavour or '' }}")
    conversation = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}]
    body = {"messages": conversation, "tools": [WEATHER], "tool_choice": "none", "chat_template_kwargs":
            {"flavour": "mint"}}
    tokens = hermes.post("/tokenize", json=body).json()["tokens"]
    assert fake_engine.tokenizer.decode(tokens) == \
        "[user:hi][assistant:get_weather(Oslo)][tool:sunnycall-1]<get_weather>mint"
    fake_engine.max_model_len = 256     # the prompt is longer than the fake engine's usual room
    assert hermes.post("/v1/chat/completions", json={**body, "max_tokens": 2}).status_code == 200
    assert_400(hermes.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"tokenize": True}}),
               "messages", "tokenize")
