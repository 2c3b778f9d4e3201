"""A chat choice's text as the answer's parts: reasoning (the server's reasoning parser), then, in the
content that follows it, tool calls (the request's tool plan: parsed for "auto", read from the forced JSON
for "required" and a named function). Incremental: `feed` each streamed delta's text, then `finish`; the
deltas of a stream add up to what `parse` gives the whole text, so streamed and not, a choice says the same."""
from dataclasses import dataclass, field

from nanovllm.entrypoints.reasoning_parsers import ReasoningParser, reasoning_parser
from nanovllm.entrypoints.tool_parsers import NamedToolCallParser, RequiredToolCallsParser, ToolCallDelta, \
    ToolParser, tool_parser


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCallDelta]     # each whole: id, name and the arguments' full text


class ChatOutputParser:
    """One choice's parser. Without a reasoning parser or tools, the text is all content, unchanged."""

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None):
        self.reasoning, self.tools = reasoning, tools

    @classmethod
    def for_request(cls, reasoning_parser_name: str | None, prompt_text: str, tool_mode: str,
                    tool_call_parser: str | None = None, function: str | None = None) -> "ChatOutputParser":
        """The parser a request's choice needs: `prompt_text` (the prompt, or its end) tells a qwen3 parser
        whether the template opened the thinking; tool_mode is structured_requests.ToolPlan.mode."""
        reasoning = reasoning_parser(reasoning_parser_name)(prompt_text) if reasoning_parser_name else None
        tools = {"none": lambda: None, "auto": lambda: tool_parser(tool_call_parser)(),
                 "required": RequiredToolCallsParser, "named": lambda: NamedToolCallParser(function)}[tool_mode]()
        return cls(reasoning, tools)

    @property
    def passthrough(self) -> bool:
        return self.reasoning is None and self.tools is None

    def feed(self, text: str) -> ParsedDelta:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._tools(reasoning, content, final=False)

    def finish(self) -> ParsedDelta:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._tools(reasoning, content, final=True)

    def _tools(self, reasoning: str, content: str, final: bool) -> ParsedDelta:
        if self.tools is None:
            return ParsedDelta(reasoning, content)
        content, calls = self.tools.feed(content) if content else ("", [])
        if final:
            more, more_calls = self.tools.finish()
            content, calls = content + more, calls + more_calls
        return ParsedDelta(reasoning, content, calls)

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" for a choice that made calls and ended on its own (not at max_tokens)."""
        if reason == "stop" and self.tools is not None and self.tools.calls:
            return "tool_calls"
        return reason

    def parse(self, text: str) -> ParsedMessage:
        """The whole text at once (a fresh parser's): its parts, each None where empty."""
        return collect([self.feed(text), self.finish()], self.passthrough)


def collect(deltas: list[ParsedDelta], passthrough: bool = False) -> ParsedMessage:
    """Deltas added up. Content is "" rather than None for a plain choice (no parsers), as before."""
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    calls: dict[int, ToolCallDelta] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.index not in calls:
                calls[piece.index] = ToolCallDelta(piece.index, piece.id, piece.name, piece.arguments)
            else:
                calls[piece.index].arguments += piece.arguments
    return ParsedMessage(reasoning or None, content if passthrough else (content or None),
                         [calls[i] for i in sorted(calls)])
