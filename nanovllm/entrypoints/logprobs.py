"""The engine's log-probs ({token id: log-prob} per token: the chosen token and the k most likely) in
the two shapes of the OpenAI API: the legacy completions format and the chat format."""
from nanovllm.entrypoints.protocol import CompletionLogprobs, TokenLogprob, TopLogprob

MIN_LOGPROB = -9999.0    # JSON has no -inf: a token the model rules out reads as this, as in vLLM


class TokenTexts:
    """Each token id's own text (decoded alone, special tokens shown), cached for one response."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])


def append_completion_logprobs(out: CompletionLogprobs, texts: TokenTexts, token_ids: list[int],
                               logprobs: list[dict[int, float] | None], offset: int) -> int:
    """Add tokens to the legacy format, their text starting at character `offset` of the choice's
    text; returns the offset after them. An entry of None (a prompt's first token) has no log-prob."""
    for token_id, entry in zip(token_ids, logprobs):
        text = texts(token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(_finite(entry[token_id]))
            top: dict[str, float] = {}
            for t, lp in _ranked(entry):     # tokens of the same text (partial UTF-8 bytes): the likeliest
                top.setdefault(texts(t), _finite(lp))
            out.top_logprobs.append(top)
    return offset


def chat_logprobs(texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]],
                  top_logprobs: int) -> list[TokenLogprob]:
    """The chat format: per token its text, log-prob and UTF-8 bytes, and its top_logprobs most likely
    alternatives."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        text = texts(token_id)
        top = [TopLogprob(token=texts(t), logprob=_finite(lp), bytes=list(texts(t).encode()))
               for t, lp in _ranked(entry)[:top_logprobs]]
        content.append(TokenLogprob(token=text, logprob=_finite(entry[token_id]), bytes=list(text.encode()),
                                    top_logprobs=top))
    return content
