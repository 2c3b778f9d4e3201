"""A completion's text: one definition, computed token by token (stop strings, streaming) or at once.

The definition (vLLM's): the text is what the completion's tokens add to the prompt's text,

    decode(prompt_ids) + text == decode(prompt_ids + output_ids)      (the same skip_special_tokens)

for every request, whatever its stop settings. Where that identity cannot hold exactly:
  * An unfinished character at the end (a multi-byte UTF-8 character whose first bytes decode to
    U+FFFD) is left out, as vLLM does: the text ends with the last complete character, that of the decode
    without the completion's last 1, 2 or 3 tokens, the nearest that ends in one; with none of them (the
    last 4 or more tokens are invalid bytes), before the trailing U+FFFD. While tokens arrive, the same
    holds for the text so far.
  * A completion that finishes a character the prompt left unfinished (decode(prompt) ends in U+FFFD
    that decode(prompt + output) shows otherwise) starts its text with that character:
    decode(prompt).rstrip("\ufffd") + text == decode(prompt + output).
  * Decoders that are not prefix-stable (decode(a + b) does not start with decode(a)): a byte-fallback
    run (SentencePiece <0x..> tokens) that is not valid UTF-8 decodes to U+FFFD as a whole, characters
    before the bad byte included; transformers' clean_up_tokenization_spaces on WordPiece vocabularies.
    Text once produced is never taken back, so there the text is what each window below added: it may
    differ from the identity, and from a request that groups the tokens otherwise (with or without
    stop strings). Valid UTF-8, the text a model means, is exact.

How: decoding the whole prompt and completion for every token would cost O(length) per token. Each
call decodes a window instead: a few tokens of context (the prompt's last ones at first, later the last
ones already turned into text) and the tokens after them, and takes the window's text past what was
already produced. That equals the definition, for any grouping of the tokens into calls, wherever what a
token adds to the text depends only on the few tokens before it: byte-level BPE, SentencePiece "▁"
pieces with byte fallback, WordLevel vocabularies joined by spaces (tests/engine/test_output_text.py
checks all three). So requests with stop strings run it token by token, and requests without compute
the same text once at the end, in a single call (OutputProcessor.completion). Each call decodes
O(new tokens) tokens and searches only the new text plus a lookback of (longest stop string - 1)
characters.
"""

PROMPT_CONTEXT = 5   # context tokens before a window's new tokens (a decoder treats the first token apart)
MAX_HELD = 8         # tokens without a complete character after which the U+FFFD are invalid bytes
FFFD = "\ufffd"      # what decoders print for bytes that are not (yet) valid UTF-8


def _unfinished(text: str) -> int:
    """The length of text's trailing run of U+FFFD: a character that may still be arriving."""
    return len(text) - len(text.rstrip(FFFD))


class IncrementalDetokenizer:
    """Detokenizes one completion as its tokens arrive and finds stop strings in the text.

    `text` is the text so far; `stable_length` how much of it is final (a streaming server sends that
    much, and the rest once the request has ended); `text_from(i)` the text from character i on."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.min_tokens = min_tokens
        self.stop_reason: str | None = None
        self.num_tokens = 0                      # completion tokens appended so far (min_tokens counts these)
        # The window: context tokens, then the completion's tokens since; _start: how many characters
        # of its text are context or produced already. No character straddles _ids[:_floor] (the
        # window's start, or where the window last started over).
        start, context = self._context(prompt_token_ids, len(prompt_token_ids))
        self._ids = list(prompt_token_ids[start:])
        self._floor = 0
        self._complete_at = len(self._ids)       # where the text last ended in a complete character (or began)
        self._start = len(context) - _unfinished(context)
        self._prompt_held = context[self._start:]    # the prompt's U+FFFD: its own, unless the completion finishes them
        self._window_text = context              # the window's text after the last call
        self._checkpoints: list[tuple[int, str]] = []   # (window length, its text) of calls that held text back
        self._rebase_at: tuple[int, str] | None = None  # (window length, its text) where the next window starts
        self._set_aside = ""                     # final U+FFFD (invalid bytes) at the end of the text so far
        self._pieces: list[str] = []             # the text in pieces: joining on every call would be O(total)
        self._length = 0                         # len(text)
        self._lookback = max(map(len, self.stop), default=1) - 1
        self._tail = ""                          # the text's last _lookback characters, where a stop may begin

    @property
    def text(self) -> str:
        if len(self._pieces) != 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0]

    @property
    def stable_length(self) -> int:
        """How many characters at the start of `text` are final: later calls only add text after them.
        Until a stop string is found, a stop string that later tokens complete may still cut the last
        (longest stop string - 1) characters, unless include_stop_str_in_output (the text then ends after
        the stop string, which ends in new text). Once the request has ended, all of `text` is final."""
        if self.stop_reason is not None or self.include_stop_str_in_output:
            return self._length
        return max(0, self._length - self._lookback)

    def text_from(self, start: int) -> str:
        """text[start:], in time proportional to its length (a streaming server's delta)."""
        parts, length = [], self._length
        for piece in reversed(self._pieces):
            if length <= start:
                break
            parts.append(piece[max(0, start - (length - len(piece))):])
            length -= len(piece)
        return "".join(reversed(parts))

    def append(self, token_ids: list[int]) -> str | None:
        """Add the completion's next token ids; return the stop string that this completed, if any."""
        if self.stop_reason is not None or not token_ids:   # tokens past a stop (a step late) are ignored
            return None
        self.num_tokens += len(token_ids)
        new_text = self._detokenize(list(token_ids))
        if new_text:
            self._pieces.append(new_text)
            self._length += len(new_text)
        if not self.stop:
            return None
        searched = self._tail + new_text
        self._tail = searched[-self._lookback:] if self._lookback else ""
        if self.num_tokens <= self.min_tokens:     # vLLM's rule: a stop string must end past min_tokens tokens
            return None
        return self._find_stop(searched, len(new_text), self._length - len(searched))

    # ---- the window ---------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _context(self, ids: list[int], end: int, floor: int = 0) -> tuple[int, str]:
        """Where the context for the tokens after ids[:end] starts, and its text: the last PROMPT_CONTEXT
        tokens after ids[:floor] (where no character straddles), twice as many while their text is empty
        (skipped special tokens print nothing, and decoders treat the first token they print apart) or
        starts with U+FFFD (inside a character, or inside a byte-fallback run, which decodes as a whole:
        valid only from its first byte)."""
        start = max(floor, end - PROMPT_CONTEXT)
        text = self._decode(ids[start:end])
        while start > floor and (not text or text[0] == FFFD):
            start = max(floor, 2 * start - end)
            text = self._decode(ids[start:end])
        return start, text

    def _detokenize(self, new: list[int]) -> str:
        """The text the new tokens make final."""
        if self._rebase_at is not None:
            self._rebase(*self._rebase_at)
        self._ids.extend(new)
        window = self._decode(self._ids)
        if window == self._window_text and not self._decode(new + new):
            # the new tokens print nothing, even twice (skipped special tokens; not a "▁" that only a
            # window's first position hides): drop them, or a long run of them would grow the window
            del self._ids[-len(new):]
            return ""
        self._window_text = window
        held = _unfinished(window)
        if not held:
            # every character is final: the next window starts after these tokens (decoded then, so
            # that a single call, the whole completion at once, decodes nothing twice)
            self._rebase_at = (len(self._ids), window)
            return self._emit(window, len(window))
        text = self._emit(window, len(window) - held)
        for back in range(1, min(len(new), 4)):
            # Several new tokens: where the text ended in a complete character within the last 3 (an
            # unfinished one has at most 3 more bytes), one token at a time would have produced it all
            # (a byte-fallback decoder shows the whole run as U+FFFD once an unfinished character ends it)
            ended = self._decode(self._ids[:-back])
            if not _unfinished(ended):
                self._rebase_at = (len(self._ids) - back, ended)
                return text + self._emit(ended, len(ended))
        self._checkpoints.append((len(self._ids), window))
        if len(self._ids) - self._complete_at > MAX_HELD:
            self._set_aside_invalid_bytes(window)
        return text

    def _advance(self, window: str, end: int) -> str:
        """window[:end] is final: the part of it past _start, which moves to end."""
        if self._prompt_held and end > self._start:
            if window.startswith(self._prompt_held, self._start):   # the prompt's U+FFFD stay: they are its own
                skip = min(len(self._prompt_held), end - self._start)
                self._start += skip
                self._prompt_held = self._prompt_held[skip:]
            else:                                # the completion finished the prompt's last character
                self._prompt_held = ""
        if end <= self._start:
            return ""
        text, self._start = window[self._start:end], end
        return text

    def _emit(self, window: str, end: int) -> str:
        """The text produced now that window[:end] is final, after U+FFFD set aside before it."""
        text = self._advance(window, end)
        if text and self._set_aside:
            text, self._set_aside = self._set_aside + text, ""
        return text

    def _rebase(self, end: int, text_at_end: str, context: tuple[int, str] | None = None) -> None:
        """Start the window over with the tokens after _ids[:end] (text_at_end, now behind _start),
        behind a short context."""
        self._rebase_at = None
        start, context_text = context or self._context(self._ids, end, self._floor)
        # _start > len(text_at_end) only where a decoder took back text it had shown (not prefix-stable)
        self._start = len(context_text) + self._start - len(text_at_end)
        self._window_text = context_text + self._window_text[len(text_at_end):]
        self._checkpoints = [(n - start, context_text + t[len(text_at_end):])
                             for n, t in self._checkpoints if n > end]
        del self._ids[:start]
        self._floor = self._complete_at = end - start

    def _set_aside_invalid_bytes(self, window: str) -> None:
        """Text held back for more than MAX_HELD tokens is invalid bytes, not a character arriving (that
        has at most 3 bytes after its first). Its U+FFFD are final, though produced only before the next
        complete character (a whole decode's trailing U+FFFD are left out too): set them aside up to the
        last checkpoint 3 or more tokens back whose text the window still starts with, and start the
        window over there, so that it stays short, if a one-token context decodes the rest the same (it
        does for byte-level decoders; a byte-fallback run may decode validly without the bytes before)."""
        for end, text_at_end in reversed(self._checkpoints):
            if len(self._ids) - end >= 3 and window.startswith(text_at_end):
                context = self._decode(self._ids[end - 1:end])
                if self._decode(self._ids[end - 1:]) != context + window[len(text_at_end):]:
                    return
                self._set_aside += self._advance(window, len(text_at_end))
                self._rebase(end, text_at_end, (end - 1, context))
                return

    # ---- stop strings ---------------------------------------------------------------------------------
    def _find_stop(self, searched: str, num_new: int, start: int) -> str | None:
        """The stop string starting earliest in `searched` (ties: the first listed) among those that end
        in its last num_new characters (the new text: a stop completed by the first min_tokens tokens never
        counts);
        the text is cut at it."""
        found = None
        for stop in self.stop:
            i = searched.find(stop, max(0, len(searched) - num_new - len(stop) + 1))
            if i >= 0 and (found is None or i < found[0]):
                found = (i, stop)
        if found is None:
            return None
        i, stop = found
        cut = start + i + (len(stop) if self.include_stop_str_in_output else 0)
        self._pieces = [self.text[:cut]]
        self._length = cut
        self.stop_reason = stop
        return stop
