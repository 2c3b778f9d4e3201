"""Speculative decoding's n-gram proposer (vLLM's "ngram" method, also called prompt lookup): a sequence that
is repeating itself (code edits, quoting its prompt, lists) is likely to go on as it went on before.

For a sequence's tokens T (prompt + output, all known), find the longest earlier occurrence of its last n
tokens, n in [prompt_lookup_min, prompt_lookup_max] (among equally long matches, the earliest), and
propose the up to k tokens that followed it there (fewer when the match lies near the end; none when
nothing matches: the sequence then decodes one token, as without speculation).

Per sequence: one numpy comparison of T with its last token finds the candidates, which are then extended
back (ngram_draft). Each sequence's tokens are kept as a numpy array that grows with it (only new tokens are
copied each step)."""
import weakref

import numpy as np

from nanovllm.engine.sequence import Sequence


def ngram_draft(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """The up to k tokens that followed the longest (then earliest) earlier match of tokens' last n
    tokens, min_n <= n <= max_n; empty if there is none. A match may overlap the suffix itself (in
    [7, 7, 7] the suffix [7, 7] matches at 0 and proposes [7]).

    The candidates are the earlier positions of the last token (one comparison over the sequence), each
    extended back while it matches: in Python for a few, else over the surviving candidates in numpy (a
    sequence repeating one token); ~10 us a sequence of a few thousand tokens, where comparing every
    position against the whole suffix took 0.1-1.2 ms, every step."""
    length = len(tokens)
    if length < min_n + 1 or k < 1:
        return tokens[:0]
    max_n = min(max_n, length - 1)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])     # a match ends at e < length - 1: a token follows it
    longest, earliest = 0, -1
    if len(ends) <= 16:
        suffix = tokens[length - max_n:].tolist()
        for end in ends.tolist():
            n = 1
            while n < max_n and end >= n and tokens.item(end - n) == suffix[max_n - 1 - n]:
                n += 1
            if n > longest:             # ascending ends: the first of each length is the earliest
                longest, earliest = n, end
                if n == max_n:
                    break
    else:
        longest, earliest = 1, int(ends[0])
        for i in range(1, max_n):       # keep the candidates whose match reaches i + 1 tokens
            ends = ends[ends >= i]
            ends = ends[tokens[ends - i] == tokens[length - 1 - i]]
            if not len(ends):
                break
            longest, earliest = i + 1, int(ends[0])
    if longest < min_n:
        return tokens[:0]
    return tokens[earliest + 1:earliest + 1 + k]


class NgramProposer:
    """Drafts for a decode batch, each sequence's from its own tokens."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        # each live sequence's tokens as numpy, grown as it grows; gone with the sequence
        self._tokens: weakref.WeakKeyDictionary[Sequence, np.ndarray] = weakref.WeakKeyDictionary()

    def _array(self, seq: Sequence) -> np.ndarray:
        """seq's known tokens (a step in flight leaves placeholders at its end) as an int64 array, appending
        only what is new since its last call."""
        num_known = seq.num_tokens - seq.num_pending_tokens
        held = self._tokens.get(seq)
        had = 0 if held is None else len(held)
        if held is None or num_known < had:
            held = np.array(seq.token_ids[:num_known], dtype=np.int64)
        elif num_known > had:
            held = np.concatenate([held, np.array(seq.token_ids[had:num_known], dtype=np.int64)])
        self._tokens[seq] = held
        return held

    def may_propose(self, seqs: list[Sequence]) -> bool:
        """Whether any sequence's known tokens end in a match. With a step in flight, this is one token
        stale: the engine asks it to decide whether collecting that step first (so that drafts can follow
        every token) may pay, or whether the next step may as well be launched beside it, without drafts."""
        return any(len(ngram_draft(self._array(seq), 1, self.min_n, self.max_n)) for seq in seqs)

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[list[int]]:
        """Per sequence, at most min(k, max_drafts[i]) draft tokens (none where max_drafts[i] <= 0)."""
        drafts = []
        for seq, most in zip(seqs, max_drafts):
            assert not seq.num_pending_tokens, "drafts follow a sequence's last token: it must be known"
            k = min(self.k, most)
            drafts.append(ngram_draft(self._array(seq), k, self.min_n, self.max_n).tolist() if k > 0 else [])
        return drafts
