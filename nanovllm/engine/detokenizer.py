"""Incremental detokenization of one completion, and stop strings found in its text as it grows.

Only requests with stop strings need text while they run, so this costs O(new tokens) per call: each
call decodes a small window of token ids (the last emitted group as context, then the unemitted ones)
and searches only the new text plus a lookback of (longest stop string - 1) characters.
"""

PROMPT_CONTEXT = 5   # prompt tokens seeding the first window, so the first token's leading space comes out right


class IncrementalDetokenizer:
    """Detokenizes one completion as its tokens arrive and finds stop strings in the text."""

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
        # The window: _ids[:_read] were already turned into text and are kept only as decoding context
        # (SentencePiece/BPE decoders treat a window's first token differently); _ids[_read:] are not yet.
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._read = len(self._ids)
        self._pending: tuple[int, str] | None = None   # (window length, its text) when that text ended in U+FFFD
        self._pieces: list[str] = []             # the text in pieces: joining on every call would be O(total)
        self._length = 0                         # len(text)
        self._lookback = max(map(len, self.stop), default=1) - 1
        self._tail = ""                          # the text's last _lookback characters, where a stop may begin

    @property
    def text(self) -> str:
        if len(self._pieces) != 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0]

    def append(self, token_ids: list[int]) -> str | None:
        """Add the completion's next token ids; return the stop string that this completed, if any."""
        if self.stop_reason is not None or not token_ids:   # tokens past a stop (a step late) are ignored
            return None
        self.num_tokens += len(token_ids)
        self._ids.extend(token_ids)
        new_text = self._detokenize(len(token_ids))
        if new_text:
            self._pieces.append(new_text)
            self._length += len(new_text)
        if not self.stop:
            return None
        searched = self._tail + new_text
        self._tail = searched[-self._lookback:] if self._lookback else ""
        if self.num_tokens < self.min_tokens:
            return None
        return self._find_stop(searched, len(new_text), self._length - len(searched))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _detokenize(self, num_new: int) -> str:
        """The text the new tokens add, decoded from the window only."""
        context = self._decode(self._ids[:self._read])
        window = self._decode(self._ids)
        if window == (self._pending[1] if self._pending else context) and not self._decode(self._ids[-num_new:]):
            # the new tokens print nothing (skipped special tokens): drop them, or a long run of them
            # would grow the window
            del self._ids[-num_new:]
            return ""
        end = len(self._ids)
        if window.endswith("\ufffd"):
            # A trailing U+FFFD may be a multi-byte character still arriving: hold the text back. Only the
            # last character can still change, so once a later call's text has more characters after the
            # previous held text, that text is final: emit it (garbage bytes must not grow the window).
            pending, self._pending = self._pending, (end, window)
            if pending is None or len(window) <= len(pending[1]) or not window.startswith(pending[1]):
                return ""
            end, window = pending
        elif len(window) <= len(context):
            return ""                            # the decoder took text back: wait for more tokens
        self._pending = None
        # the tokens just read become the next window's context; older ones are no longer needed
        del self._ids[:self._read]
        self._read = end - self._read
        return window[len(context):]

    def _find_stop(self, searched: str, num_new: int, start: int) -> str | None:
        """The stop string starting earliest in `searched` (ties: the first listed) among those that end
        in its last num_new characters (the new text: a stop completed before min_tokens never counts);
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
