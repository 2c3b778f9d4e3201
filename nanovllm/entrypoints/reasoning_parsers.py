"""Reasoning parsers: a chat completion's text split into the model's thinking (`<think>...</think>`) and
its answer, as vLLM's `--reasoning-parser` does (the names are vLLM's). Each parser is incremental: feed it
the text as it streams, get (reasoning, content) deltas; the deltas of any split of a text add up to what
the whole text at once gives, so a stream adds up to the non-streamed response.

    deepseek_r1  the template opens the thinking: the output is reasoning until `</think>` (an opening
                 `<think>` the model writes itself is dropped), then content; no `</think>`: all reasoning.
                 A prompt whose last marker is `</think>` (an earlier turn's thinking kept, an empty
                 thought closed by the template) has closed it: the output is content from its start, as
                 the engine's structured-output gate (ReasoningGate) reads that prompt.
    qwen3        the model opens the thinking itself: an output that starts with `<think>` is reasoning
                 until `</think>`, then content; any other output is content. A prompt that ends inside
                 a `<think>` (Qwen3 thinking-only templates append one) makes it read as deepseek_r1.
                 Unlike vLLM's non-streamed qwen3 parser, an unclosed `<think>...` (thinking cut off by
                 max_tokens) stays reasoning, as vLLM streams it: the split is decided by what came
                 first, so a stream never has to take back what it sent.
"""
from nanovllm.config import REASONING_MARKERS


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (and so must wait for more text)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    """Splits one completion's text; `feed` per delta, then `finish` once."""
    name = ""
    # the prompt text opens_in_reasoning is given: its last few tokens (chat_completions.PROMPT_TAIL_TOKENS),
    # or with reads_whole_prompt all of it
    reads_whole_prompt = False

    def __init__(self, prompt_text: str = ""):
        self.start, self.end = REASONING_MARKERS[self.name]
        # where an output that does not open with the start marker begins
        self.otherwise = "reasoning" if self.opens_in_reasoning(prompt_text) else "content"
        self.state = "start"        # undecided: does the output open with the start marker?
        self.buffer = ""

    def opens_in_reasoning(self, prompt_text: str) -> bool:
        return True

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text`, appended to what came before, makes certain."""
        self.buffer += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                if self.buffer.startswith(self.start):      # the model's own opening marker: dropped
                    self.buffer, self.state = self.buffer[len(self.start):], "reasoning"
                elif self.start.startswith(self.buffer):
                    return reasoning, content               # nothing yet, or part of the marker
                else:
                    self.state = self.otherwise
            elif self.state == "reasoning":
                index = self.buffer.find(self.end)
                if index < 0:
                    keep = held_prefix(self.buffer, self.end)
                    reasoning += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return reasoning, content
                reasoning += self.buffer[:index]
                self.buffer, self.state = self.buffer[index + len(self.end):], "content"
            else:
                content, self.buffer = content + self.buffer, ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back at the end: a partial marker is plain text."""
        text, self.buffer = self.buffer, ""
        if (self.otherwise if self.state == "start" else self.state) == "reasoning":
            return text, ""
        return "", text

    @classmethod
    def parse(cls, text: str, prompt_text: str = "") -> tuple[str | None, str | None]:
        """The whole text's (reasoning, content); None for an empty part."""
        parser = cls(prompt_text)
        (r1, c1), (r2, c2) = parser.feed(text), parser.finish()
        return (r1 + r2) or None, (c1 + c2) or None


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    reads_whole_prompt = True       # the closing marker may be turns back, far from the prompt's end

    def opens_in_reasoning(self, prompt_text: str) -> bool:
        """Unless the prompt's last marker is `</think>`: the engine's ReasoningGate then constrains the
        output (structured outputs, forced tool calls) from its first token, so that output is the answer.
        No marker in the prompt: reasoning, R1's way (its template may open the thinking or not)."""
        return prompt_text.rfind(self.end) <= prompt_text.rfind(self.start)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def opens_in_reasoning(self, prompt_text: str) -> bool:
        """The prompt ends inside a thinking block the template opened (`<think>\\n` with no `</think>` after)."""
        opened = prompt_text.rfind(self.start)
        return opened >= 0 and self.end not in prompt_text[opened:]


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered under `name` (ValueError naming the known ones otherwise)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
