"""Tool-call parsers (vLLM's names: hermes, llama3_json) and the forced shapes of tool_choice "required"
and a named function: the calls found in a text, its content, and the same from any split of the text
(a stream's deltas add up to the whole); ids are OpenAI's shape, one per call."""
import json
import random

import pytest

from nanovllm.entrypoints.chat_output import ChatOutputParser, collect
from nanovllm.entrypoints.reasoning_parsers import Qwen3ReasoningParser
from nanovllm.entrypoints.tool_parsers import TOOL_PARSERS, HermesToolParser, Llama3JsonToolParser, \
    NamedToolCallParser, RequiredToolCallsParser, tool_parser

pytestmark = pytest.mark.cpu_only     # text parsing only

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'

CASES = [   # (make parser, text, content, [(name, arguments as an object)])
    (HermesToolParser, "Just text, no calls.", "Just text, no calls.", []),
    (HermesToolParser, f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (HermesToolParser, f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n",
     "Let me check.", [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]),
    (HermesToolParser, f"<tool_call>{WEATHER}</tool_call> Done.", "Done.",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (HermesToolParser, "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    (HermesToolParser, f"<tool_call>\n{WEATHER}", None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (HermesToolParser, '<tool_call>{"name": "f", "arg', '<tool_call>{"name": "f", "arg', []),   # cut off
    (HermesToolParser, "a <tool_ b", "a <tool_ b", []),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", {"x": 1})]),
    (Llama3JsonToolParser, '{"name": "get_time", "parameters": {"zone": "CET"}}', None,
     [("get_time", {"zone": "CET"})]),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": [1]}}',
     None, [("a", {}), ("b", {"k": [1]})]),
    (Llama3JsonToolParser, '  {"name": "a", "parameters": {}} trailing words', '  {"name": "a", "parameters": {}} '
     'trailing words', []),
    (Llama3JsonToolParser, "The answer is {1}.", "The answer is {1}.", []),
    (Llama3JsonToolParser, '{"no_name": 1}', '{"no_name": 1}', []),
    (lambda: NamedToolCallParser("get_weather"), '{"city": "Paris"}', None, [("get_weather", {"city": "Paris"})]),
    (RequiredToolCallsParser, '[{"name": "a", "parameters": {"s": "}]{\\""}}, {"name": "b", "parameters": {}}]',
     None, [("a", {"s": '}]{"'}), ("b", {})]),
    (RequiredToolCallsParser, '[{"name": "a", "parameters": {}}, {"name": "b", "param', None, [("a", {})]),
    (RequiredToolCallsParser, "[not json", "[not json", []),
    # raw control characters inside strings (a grammar let them through): every call still found, its arguments
    # strict JSON (run's json.loads is strict) holding the same characters
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"city": "a\x11b\x00"}}</tool_call>', None,
     [("f", {"city": "a\x11b\x00"})]),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": "{\\"x\\": \\"\x1f\\"}"}</tool_call>', None,
     [("f", {"x": "\x1f"})]),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"s": "\x02!"}}', None, [("f", {"s": "\x02!"})]),
    (lambda: NamedToolCallParser("get_weather"), '{"city": "P\x1fa\\"\x07", "unit": "celsius"}', None,
     [("get_weather", {"city": 'P\x1fa"\x07', "unit": "celsius"})]),
    (RequiredToolCallsParser, '[{"name": "a", "parameters": {"s": "x\x11"}}]', None, [("a", {"s": "x\x11"})]),
]


def run(parser, text: str, rng: random.Random | None = None):
    """(content or None, [(name, arguments)], ids, the call deltas) from feeding `text` whole or in random pieces."""
    cuts = []
    if rng is not None and len(text) > 1:
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
    content, deltas = "", []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        c, calls = parser.feed(text[start:end])
        content, deltas = content + c, deltas + calls
    c, calls = parser.finish()
    content, deltas = content + c, deltas + calls
    merged: dict[int, list] = {}
    for d in deltas:
        if d.index in merged:
            assert d.id is None and d.name is None      # only a call's first piece names it
            merged[d.index][1] += d.arguments
        else:
            merged[d.index] = [d.name, d.arguments, d.id]
    found = [(name, json.loads(arguments)) for name, arguments, _ in (merged[i] for i in sorted(merged))]
    return content or None, found, [merged[i][2] for i in sorted(merged)]


@pytest.mark.parametrize("make, text, content, calls", CASES)
def test_whole_texts(make, text, content, calls):
    found_content, found, ids = run(make(), text)
    assert (found_content, found) == (content, calls)
    assert len(set(ids)) == len(ids) and all(i.startswith("chatcmpl-tool-") for i in ids)


@pytest.mark.parametrize("make, text, content, calls", CASES)
def test_any_split_adds_up_to_the_whole(make, text, content, calls):
    rng = random.Random(text)
    for _ in range(40):
        found_content, found, _ = run(make(), text, rng)
        assert (found_content, found) == (content, calls)


def test_hermes_sends_each_call_when_its_block_closes():
    parser = HermesToolParser()
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    first_end = text.index("</tool_call>") + len("</tool_call>")
    assert parser.feed(text[:first_end - 1]) == ("", [])
    content, calls = parser.feed(text[first_end - 1:first_end])
    assert content == "" and [c.name for c in calls] == ["get_weather"] and calls[0].index == 0
    content, calls = parser.feed(text[first_end:])
    assert [c.name for c in calls] == ["get_time"] and calls[0].index == 1


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    assert tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="llama3_json"):
        tool_parser("mistral")


def test_reasoning_then_tool_calls_in_the_content():
    """With a reasoning parser, calls are parsed in the content after the thinking only."""
    text = f"<think>I should call <tool_call>{TIME}</tool_call>? yes</think>\n<tool_call>{WEATHER}</tool_call>"
    rng = random.Random(0)
    for pieces in range(1, 30):
        parser = ChatOutputParser(Qwen3ReasoningParser(""), HermesToolParser())
        cuts = sorted(rng.sample(range(1, len(text)), pieces - 1))
        deltas = [parser.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])] + [parser.finish()]
        message = collect(deltas)
        assert message.reasoning == f"I should call <tool_call>{TIME}</tool_call>? yes"
        assert message.content is None and [c.name for c in message.tool_calls] == ["get_weather"]
        assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"


def test_a_plain_choice_passes_through():
    parser = ChatOutputParser.for_request(None, "", "none")
    assert parser.passthrough and parser.parse("").content == "" and parser.finish_reason("stop") == "stop"
    assert ChatOutputParser.for_request(None, "", "auto", "hermes").parse("").content is None
