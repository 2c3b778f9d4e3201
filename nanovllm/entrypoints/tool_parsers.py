"""Tool-call parsers for tool_choice "auto": the calls a model writes in its own format, taken out of its
text (`nanovllm serve --enable-auto-tool-choice --tool-call-parser NAME`, vLLM's names):

    hermes       Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks;
                 the text outside them is content (whitespace around a call dropped). A block whose JSON is
                 not a call stays in the content as written.
    llama3_json  Llama 3.x: the whole output is a JSON object {"name", "parameters" (or "arguments")},
                 or several separated by ";", optionally after `<|python_tag|>`; anything else is content.

Calls' arguments come back as strict JSON text: raw control characters a grammar let into a string are
escaped (JsonStrings). Each parser is incremental: `feed` the text as it streams, get (content delta, tool-call deltas), then
`finish`; a stream's deltas add up to what the whole text gives at once. A call is sent whole, in one
delta, once its block is closed (llama3_json: once the output ends, since a later object may spoil it).
"""
import json
import uuid
from dataclasses import dataclass

from nanovllm.entrypoints.reasoning_parsers import held_prefix


@dataclass
class ToolCallDelta:
    """A piece of tool call `index`: its first piece carries the id and the function's name; the
    arguments' JSON text is the concatenation of every piece's `arguments`."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class JsonStrings:
    """Whether a JSON text read character by character is inside a string (escapes followed), and the text
    as strict JSON has it: a raw control character (U+0000-U+001F) inside a string escaped as \\u00XX. A
    grammar may let a model write them raw (xgrammar 0.2.8's strings with maxLength do), and strict parsers
    (json.loads, JavaScript's JSON.parse) refuse that; escaped, the text means what a lenient parse of it means."""

    def __init__(self):
        self.in_string = self.escaped = False

    def step(self, char: str) -> str:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
            elif char < " ":
                return f"\\u{ord(char):04x}"
        elif char == '"':
            self.in_string = True
        return char

    def escape(self, text: str) -> str:
        return "".join(map(self.step, text))


def loads(text: str):
    """JSON that may hold raw control characters in its strings (see JsonStrings)."""
    return json.loads(text, strict=False)


def arguments_text(arguments) -> str:
    """A call's arguments as strict JSON text (a model may write them as an object or as its text)."""
    if isinstance(arguments, str):
        return JsonStrings().escape(arguments)
    return json.dumps(arguments, ensure_ascii=False)


def as_call(value, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments text) of a parsed JSON call {"name", <arguments key>: ...}, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = next((value[key] for key in arguments_keys if key in value), {})
    if not isinstance(arguments, (dict, str)):
        return None
    return value["name"], arguments_text(arguments)


class ToolParser:
    """Finds the tool calls in one completion's text. `calls`: how many it has sent."""
    name = ""

    def __init__(self):
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def call(self, name: str, arguments: str) -> ToolCallDelta:
        self.calls += 1
        return ToolCallDelta(self.calls - 1, new_tool_call_id(), name, arguments)


class _Content:
    """Content text with the whitespace around tool calls dropped: trailing whitespace is held until more
    text shows it is inside the content; a call, or the end after a call, drops it."""

    def __init__(self):
        self.pending = ""
        self.after_call = False

    def add(self, text: str) -> str:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return ""
            self.after_call = False
        text = self.pending + text
        kept = text.rstrip()
        self.pending = text[len(kept):]
        return kept

    def call(self) -> None:
        self.pending, self.after_call = "", True

    def end(self, had_calls: bool) -> str:
        text, self.pending = ("" if had_calls else self.pending), ""
        return text


class HermesToolParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self.buffer, self.in_call, self.content = "", False, _Content()

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += text
        content, calls = "", []
        while True:
            if not self.in_call:
                index = self.buffer.find(self.OPEN)
                if index < 0:
                    keep = held_prefix(self.buffer, self.OPEN)
                    content += self.content.add(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return content, calls
                content += self.content.add(self.buffer[:index])
                self.buffer, self.in_call = self.buffer[index + len(self.OPEN):], True
            else:
                index = self.buffer.find(self.CLOSE)
                if index < 0:
                    return content, calls
                body, self.buffer, self.in_call = self.buffer[:index], self.buffer[index + len(self.CLOSE):], False
                content += self._block(body, self.OPEN + body + self.CLOSE, calls)

    def _block(self, body: str, written: str, calls: list[ToolCallDelta]) -> str:
        """A block's call appended to `calls`; a block that is not a call is content as written."""
        try:
            found = as_call(loads(body), ("arguments", "parameters"))
        except ValueError:
            found = None
        if found is None:
            return self.content.add(written)
        self.content.call()
        calls.append(self.call(*found))
        return ""

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        calls = []
        if self.in_call:        # an unclosed block at the end (max_tokens, or a model that stops there)
            content = self._block(self.buffer, self.OPEN + self.buffer, calls)
        else:
            content = self.content.add(self.buffer)
        self.buffer = ""
        return content + self.content.end(self.calls > 0), calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self):
        super().__init__()
        self.buffer, self.state = "", "start"      # start (undecided), calls (held to the end), content

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += text
        if self.state == "start":
            head = self.buffer.lstrip()
            if self.buffer.startswith(self.PYTHON_TAG) or head.startswith("{"):
                self.state = "calls"
            elif not head or (self.PYTHON_TAG.startswith(self.buffer)):
                return "", []
            else:
                self.state = "content"
        if self.state == "content":
            content, self.buffer = self.buffer, ""
            return content, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        text, self.buffer = self.buffer, ""
        if self.state != "calls":
            return text, []
        found = self._calls(text.removeprefix(self.PYTHON_TAG))
        if not found:
            return text, []
        return "", [self.call(name, arguments) for name, arguments in found]

    @staticmethod
    def _calls(text: str) -> list[tuple[str, str]] | None:
        """Every call of `obj; obj; ...`, or None if the text is anything else."""
        decoder, found, at = json.JSONDecoder(strict=False), [], 0
        while True:
            while at < len(text) and (text[at].isspace() or (found and text[at] == ";")):
                at += 1
            if at == len(text):
                return found or None
            try:
                value, at = decoder.raw_decode(text, at)
            except ValueError:
                return None
            call = as_call(value, ("parameters", "arguments"))
            if call is None:
                return None
            found.append(call)


class NamedToolCallParser(ToolParser):
    """tool_choice {"type": "function", "function": {"name": NAME}}: the grammar made the whole output the
    function's arguments object, so the text streams as that one call's arguments."""

    def __init__(self, function_name: str):
        super().__init__()
        self.function_name = function_name
        self.strings = JsonStrings()      # the arguments streamed as strict JSON

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        text = self.strings.escape(text)
        if not text:
            return "", []
        if self.calls == 0:
            return "", [self.call(self.function_name, text)]
        return "", [ToolCallDelta(0, arguments=text)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", ([] if self.calls else [self.call(self.function_name, "")])


class RequiredToolCallsParser(ToolParser):
    """tool_choice "required": the grammar made the output a JSON array of {"name", "parameters"} (vLLM's
    shape); each element is sent as a call once it closes. Text that holds no call at all (the grammar
    cut short by max_tokens before one closed) is content at the end; an unclosed last element is dropped."""

    def __init__(self):
        super().__init__()
        self.text, self.scanned, self.depth = "", 0, 0
        self.strings = JsonStrings()
        self.element_start = -1

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.text += text
        calls = []
        for at in range(self.scanned, len(self.text)):      # a JSON scanner: strings, then nesting
            char = self.text[at]
            in_string = self.strings.in_string
            self.strings.step(char)
            if in_string or self.strings.in_string:         # in a string, or its opening quote
                continue
            if char in "[{":
                self.depth += 1
                if self.depth == 2 and char == "{":
                    self.element_start = at
            elif char in "]}":
                self.depth -= 1
                if self.depth == 1 and char == "}" and self.element_start >= 0:
                    calls.extend(self._element(self.text[self.element_start:at + 1]))
                    self.element_start = -1
        self.scanned = len(self.text)
        return "", calls

    def _element(self, text: str) -> list[ToolCallDelta]:
        try:
            found = as_call(loads(text), ("parameters", "arguments"))
        except ValueError:
            found = None
        return [] if found is None else [self.call(*found)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return ("" if self.calls else self.text), []


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)}


def tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under `name` (ValueError naming the known ones otherwise)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
