"""Structured outputs, tools and reasoning through `nanovllm serve` on the real default model (SmolLM2-135M),
sampled at temperature 1.0, where only the grammar keeps its output in shape: every JSON-schema output
validates, choices and regexes match exactly, forced tool calls carry arguments that validate against
their function's parameters, a hermes block the model writes becomes tool_calls, a tool turn goes back
through the template, a thought and its answer come back apart, streams say what the non-streamed
response says (seeded: the same tokens), and what the engine cannot compile is a 400 in OpenAI's shape.

Two servers: one with --enable-auto-tool-choice --tool-call-parser hermes, one with --reasoning-parser qwen3."""
import json
import re

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.cpu_only]     # the servers run ENGINE_ARGS (--device cpu)

ENGINE_ARGS = ["--device", "cpu", "--enforce-eager", "--max-model-len", "1024", "--kvcache-block-size", "16",
               "--num-kvcache-blocks", "256"]
SAMPLED = dict(temperature=1.0, top_p=1.0, seed=1234)
PERSON = {      # nested objects, an array of enums, integers with bounds, strings with lengths
    "type": "object", "additionalProperties": False, "required": ["name", "age", "pet", "tags"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"type": "object", "additionalProperties": False, "required": ["kind", "legs"],
                "properties": {"kind": {"enum": ["cat", "dog", "bird"]},
                               "legs": {"type": "integer", "minimum": 0, "maximum": 4}}},
        "tags": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "string", "maxLength": 6}}}}
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "rank", "sunny"],
        "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 10},
                       "rank": {"type": "integer", "minimum": 1, "maximum": 5}, "sunny": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}}}}}
TOOLS = [WEATHER, CLOCK]
UNCOMPILABLE = {"type": "string", "minLength": -1}
UNCOMPILABLE_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": UNCOMPILABLE}, "required": ["a"]}}}
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


def default_model() -> str:
    from nanovllm.utils.gguf_checkpoint import default_model
    return default_model()


# one torch thread each: two on two busy cores spin against each other (conftest's one_torch_thread)
@pytest.fixture(scope="module")
def tools_server(start_module_server):
    return start_module_server(default_model(), ENGINE_ARGS + ["--enable-auto-tool-choice", "--tool-call-parser",
                                                               "hermes"], threads=1)


@pytest.fixture(scope="module")
def reasoning_server(start_module_server):
    return start_module_server(default_model(), ENGINE_ARGS + ["--reasoning-parser", "qwen3"], threads=1)


class Client:
    """The official client, with the served model's name filled in."""

    def __init__(self, server):
        self.api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=180)
        self.model = self.api.models.list().data[0].id

    def chat(self, **request):
        return self.api.chat.completions.create(model=self.model, **request)


def client(server) -> Client:
    return Client(server)


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def streamed(api, **request) -> dict:
    """A streamed chat's one choice added up: content, reasoning, tool calls (by index) and finish_reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in api.chat(stream=True, **request):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            assert (getattr(delta, "reasoning", None) or "") == (getattr(delta, "reasoning_content", None) or "")
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"name": None, "arguments": ""})
                call["name"] = call["name"] or piece.function.name
                call["arguments"] += piece.function.arguments or ""
                assert piece.id is None or piece.id.startswith("chatcmpl-tool-")
            finish = choice.finish_reason or finish
    return {"content": content or None, "reasoning": reasoning or None, "finish_reason": finish,
            "tool_calls": [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]}


def summary(choice) -> dict:
    message = choice.message
    return {"content": message.content, "reasoning": getattr(message, "reasoning_content", None),
            "finish_reason": choice.finish_reason,
            "tool_calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or []]}


# ---- JSON schemas, json_object, choice, regex, grammar ------------------------------------------------
def test_json_schema_outputs_validate(tools_server):
    api = client(tools_server)
    response = api.chat(
        messages=ask("Give me a city as JSON."), n=1, max_tokens=120, **SAMPLED,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), CITY)
    request = dict(messages=ask("Describe a person as JSON."), max_tokens=120, **SAMPLED,
                   extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}})
    whole = api.chat(n=1, **request)
    for choice in whole.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert streamed(api, **request) == summary(whole.choices[0])      # seeded: choice 0's tokens again


def test_json_object_choice_regex_and_grammar(tools_server):
    api = client(tools_server)
    objects = api.chat(messages=ask("A JSON object with a name and an age."), n=2, max_tokens=60,
                       response_format={"type": "json_object"}, **SAMPLED)
    finished = [c.message.content for c in objects.choices if c.finish_reason == "stop"]
    assert finished, "no object closed within max_tokens"
    assert all(isinstance(json.loads(text), dict) for text in finished)
    assert all(c.message.content.lstrip().startswith("{") for c in objects.choices)
    cities = ["Paris", "London", "Tokyo"]
    chosen = api.chat(messages=ask("Pick a city."), n=4, max_tokens=10, **SAMPLED,
                      extra_body={"structured_outputs": {"choice": cities}})
    assert all(c.message.content in cities and c.finish_reason == "stop" for c in chosen.choices)
    # raw HTTP on /v1/completions: a regex and an EBNF grammar
    pattern = r"[A-Z][a-z]{2,6}-[0-9]{2}"
    body = {"prompt": "A product code:", "n": 3, "max_tokens": 20, **SAMPLED}
    codes = httpx.post(f"{tools_server.url}/v1/completions", timeout=180,
                       json={**body, "structured_outputs": {"regex": pattern}}).json()
    assert all(re.fullmatch(pattern, c["text"]) and c["finish_reason"] == "stop" for c in codes["choices"]), codes
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9] [0-9]?'
    answers = httpx.post(f"{tools_server.url}/v1/completions", timeout=180,
                         json={**body, "structured_outputs": {"grammar": grammar}}).json()
    assert all(re.fullmatch(r"yes|no|maybe [0-9]{1,2}", c["text"]) for c in answers["choices"]), answers


@pytest.mark.parametrize("path, field", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}}),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "[a-"}}),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= "}}),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "string", "minLength": "three"}}}),
    # xgrammar parses these, then cannot compile them (in the engine's process, which once died of it)
    ("/v1/completions", {"structured_outputs": {"json": {"type": "array", "items": UNCOMPILABLE}}}),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": UNCOMPILABLE}}}),
    ("/v1/chat/completions", {"tools": [UNCOMPILABLE_TOOL], "tool_choice": "required"}),
    ("/v1/chat/completions", {"tools": [UNCOMPILABLE_TOOL],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}}),
])
def test_what_the_engine_cannot_compile_is_a_400(tools_server, path, field):
    base = {"messages": ask("hi")} if "chat" in path else {"prompt": "hi"}
    response = httpx.post(f"{tools_server.url}{path}", json={**base, "max_tokens": 4, **field}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert httpx.get(f"{tools_server.url}/health", timeout=10).status_code == 200
    after = httpx.post(f"{tools_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2, after.text


# ---- tools ------------------------------------------------------------------------------------------
def test_tool_choice_required_and_named(tools_server):
    api = client(tools_server)
    request = dict(messages=ask("What is the weather in Oslo?"), tools=TOOLS, tool_choice="required",
                   parallel_tool_calls=False, max_tokens=60, **SAMPLED)     # one call (else it may go on)
    whole = api.chat(n=1, **request)
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    assert streamed(api, **request) == summary(whole.choices[0])
    named = api.chat(
        messages=ask("Weather in Rome?"), tools=TOOLS, max_tokens=60, n=2, **SAMPLED,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in named.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_weather"])


HERMES_BLOCK = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET|JST)"\}\}</tool_call>'


def test_auto_parses_a_hermes_block_and_the_next_turn_goes_through_the_template(tools_server):
    """SmolLM2 never learned tools: a regex makes it write a hermes block, which "auto" finds."""
    api = client(tools_server)
    messages = ask("What time is it in Paris?")
    request = dict(messages=messages, tools=TOOLS, max_tokens=100, **SAMPLED,     # ~1 token a character:
                   extra_body={"structured_outputs": {"regex": HERMES_BLOCK}})  # grammars pick odd splits
    response = api.chat(**request)
    [choice] = response.choices
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET", "JST")
    assert streamed(api, **request) == summary(choice)

    turn = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_time", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "10:42"}]
    tokens = httpx.post(f"{tools_server.url}/tokenize", json={"messages": turn, "tools": TOOLS}, timeout=30).json()
    rendered = httpx.post(f"{tools_server.url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()
    assert "<|im_start|>tool\n10:42<|im_end|>" in rendered["prompt"]
    answer = api.chat(messages=turn, tools=TOOLS, max_tokens=8, **SAMPLED)     # "auto" again: a plain answer
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls == []
    assert answer.usage.prompt_tokens == tokens["count"]


# ---- reasoning --------------------------------------------------------------------------------------
# The engine constrains the answer only once the thinking has ended; a prompt that already closes a
# thought (as Qwen3's template does with enable_thinking=False) ends it before the output starts, so here
# the grammar shapes the whole output and makes SmolLM2, which never thinks, write a thought and an answer.
CLOSED_THOUGHT = "Think inside <think></think>, then answer yes or no. Is the sea salty?"
THOUGHT_THEN_ANSWER = r"<think>[a-z ]{4,40}</think>(yes|no)"


def test_reasoning_is_split_from_the_answer(reasoning_server):
    api = client(reasoning_server)
    request = dict(messages=ask(CLOSED_THOUGHT), max_tokens=40, **SAMPLED,
                   extra_body={"structured_outputs": {"regex": THOUGHT_THEN_ANSWER}})
    response = api.chat(n=3, **request)
    for choice in response.choices:
        message = choice.message
        assert re.fullmatch(r"[a-z ]{4,40}", message.reasoning_content), message
        assert message.reasoning == message.reasoning_content and message.content in ("yes", "no")
        assert choice.finish_reason == "stop"
    assert streamed(api, **request) == summary(response.choices[0])
    plain = api.chat(messages=ask("Say hi."), max_tokens=6, **SAMPLED).choices[0].message
    assert plain.reasoning_content is None and plain.content      # no thought: all content
    # this server has no tool-call parser: "auto" (the default with tools) is refused, naming the flags
    refused = httpx.post(f"{reasoning_server.url}/v1/chat/completions", json={"messages": ask("hi"), "tools": TOOLS})
    assert refused.status_code == 400 and "--enable-auto-tool-choice" in refused.json()["error"]["message"]
