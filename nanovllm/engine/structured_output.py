"""Structured outputs: each constrained sequence's grammar state, and the token masks the sampler applies.

The grammars are xgrammar's (JSON schemas, regexes, EBNF, xgrammar's structural tags), chosen over
llguidance because vLLM's default backend is xgrammar (the same grammar dialects and the same outputs for
code written against vLLM), its matcher forks (n completions) and rolls back (speculative decoding), and
its compiled grammars precompute which tokens each state allows, so a mask costs tens of microseconds.
xgrammar is imported only when a request asks for a structured output.

Flow: a request's constraint is parsed when it is checked (check_structured_outputs: a bad one is a
ValueError before anything runs), compiled against the tokenizer once per distinct text (the engine's
StructuredOutputs keeps them), and each of its sequences gets a GrammarState. The engine launches a step
that holds constrained sequences without its sampling; while the device runs that step's forward pass, it
collects the previous step's tokens (the scheduler feeds them to each state) and fills this step's
bitmask rows here, then launches the sampling with the mask (kernels/token_bitmask applies it). With
speculative decoding, a verification's rows are masked as if the drafts before each were accepted (the
matcher advanced over them, then rolled back): the target never accepts a draft its grammar forbids.

With a reasoning parser (Config.reasoning_parser) a state waits for the end of the model's thinking (the
end marker in the output, or already in the prompt) before it constrains anything.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from functools import lru_cache
from importlib.util import find_spec
from typing import TYPE_CHECKING

import torch

from nanovllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from nanovllm.engine.sequence import Sequence

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256     # compiled grammars kept per engine (a compiled JSON schema is ~100 KB)


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured outputs need the xgrammar package: pip install xgrammar") from None
    return xgrammar


def constraint_key(params: StructuredOutputsParams) -> tuple:
    """What identifies a compiled grammar: the constraint's kind, its text and the options it depends on."""
    value = getattr(params, params.kind)
    if params.kind == "json":
        value = value if isinstance(value, str) else json.dumps(value)     # key order matters: it is the output's
    elif params.kind == "choice":
        value = tuple(value)
    return params.kind, value, params.disable_any_whitespace


def _ebnf_string(text: str) -> str:
    """text as an EBNF string literal (xgrammar's escapes)."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char.isprintable():
            out.append(char)
        elif ord(char) <= 0xFFFF:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(f"\\U{ord(char):08x}")
    return '"' + "".join(out) + '"'


@lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def _parsed_grammar(key: tuple):
    """The xgrammar Grammar of a constraint (tokenizer-independent); raises ValueError if it is malformed."""
    xgr = _xgrammar()
    kind, value, disable_any_whitespace = key
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(value, any_whitespace=not disable_any_whitespace)
        if kind == "json_object":     # an object (xgrammar's built-in JSON grammar takes any value)
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False,
                                                any_whitespace=not disable_any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(choice) for choice in value))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(value)
        if kind == "structural_tag":
            tag = json.loads(value)
            if isinstance(tag, dict) and "structures" in tag:      # vLLM's first form: begin/schema/end + triggers
                items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                         for s in tag["structures"]]
                return xgr.Grammar.from_structural_tag(items, tag["triggers"])
            return xgr.Grammar.from_structural_tag(value)
    except Exception as error:     # xgrammar raises RuntimeError (and its own errors) with the parser's words
        raise ValueError(f"structured_outputs.{kind} is not valid: {_xgrammar_words(error)}") from None
    raise AssertionError(kind)


def _xgrammar_words(error: Exception) -> str:
    """An xgrammar error's last line, less its "[time] file.cc:line: " prefix."""
    lines = str(error).strip().splitlines()
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[-1]) if lines else type(error).__name__


def check_structured_outputs(params: StructuredOutputsParams | None) -> None:
    """Raise ValueError, naming the problem, if the constraint is malformed (an unparsable schema, regex,
    grammar or tag); parsed grammars are cached, so the engine does not parse them again."""
    if params is not None:
        _parsed_grammar(constraint_key(params))


class GrammarState:
    """One sequence's place in its grammar: which tokens may come next. A reasoning gate (end marker)
    keeps it open, constraining nothing, until the model's thinking has ended."""

    def __init__(self, matcher, reasoning: "ReasoningGate | None" = None):
        self.matcher = matcher
        self.reasoning = reasoning
        self.broken = False

    @property
    def active(self) -> bool:
        """Does it constrain the next token? Not while the model thinks, nor once the grammar has taken its
        stop token (ignore_eos: what follows is free)."""
        return (not self.broken and (self.reasoning is None or self.reasoning.ended)
                and not self.matcher.is_terminated())

    def accept(self, token_id: int) -> None:
        """The sequence's next token. The mask lets no other through, except where the request's own
        settings leave the grammar no token (min_tokens banning the end-of-sequence token the grammar
        needs): then the sequence goes on unconstrained, and a warning says so."""
        if self.broken or self.matcher.is_terminated():
            return      # unconstrained from here on (ignore_eos goes on past the stop token)
        if not self.active:
            self.reasoning.feed(token_id)
            return
        if not self.matcher.accept_token(token_id):
            self.broken = True
            logger.warning("token %d breaks its structured output's grammar: the request's own settings left "
                           "the grammar no token (min_tokens longer than the grammar's output, or "
                           "allowed_token_ids / logit_bias excluding every token it allows); the rest of "
                           "this completion is unconstrained", token_id)

    def fill_draft_rows(self, draft: list[int], bitmask: torch.Tensor, first: int) -> list[int]:
        """Speculative decoding's masks: row j of a verification (j = 0..len(draft)) samples as if draft[:j]
        were already accepted. Fills bitmask rows first, first + 1, ... for the rows the grammar constrains and
        returns their j. Rows it leaves free: while the model thinks (the reasoning gate), once the grammar
        has ended, and after a draft token the grammar forbids (the target, masked, never accepts that token,
        so no row after it can be emitted). The state itself is left as it was (the matcher rolled back)."""
        rows: list[int] = []
        gate = self.reasoning.fork() if self.reasoning is not None and not self.reasoning.ended else None
        taken = 0
        try:
            for j in range(len(draft) + 1):
                if self.broken or self.matcher.is_terminated():
                    break
                if gate is not None and not gate.ended:      # still thinking: the row is free
                    if j < len(draft):
                        gate.feed(draft[j])
                    continue
                self.matcher.fill_next_token_bitmask(bitmask, first + len(rows))
                rows.append(j)
                if j == len(draft) or not self.matcher.accept_token(draft[j]):
                    break
                taken += 1
        finally:
            if taken:
                self.matcher.rollback(taken)
        return rows

    def fork(self) -> "GrammarState":
        """The same state for a new completion that continues from here on its own."""
        reasoning = None if self.reasoning is None else self.reasoning.fork()
        return GrammarState(self.matcher.fork(), reasoning)


class ReasoningGate:
    """Has the model's thinking ended? It has once the end marker is in the text after the last start
    marker: in the prompt already (a template that closes an empty thought) or in the output so far."""

    def __init__(self, tokenizer, start: str, end: str, prompt_token_ids: list[int]):
        self.tokenizer, self.start, self.end = tokenizer, start, end
        text = tokenizer.decode(prompt_token_ids)
        self.ended = text.rfind(end) > text.rfind(start) if end in text else False
        self.tail = ""      # the output's last characters, as long as the end marker

    def feed(self, token_id: int) -> None:
        self.tail = (self.tail + self.tokenizer.decode([token_id]))[-4 * len(self.end):]
        if self.end in self.tail:
            self.ended = True

    def fork(self) -> "ReasoningGate":
        twin = object.__new__(ReasoningGate)
        twin.__dict__.update(self.__dict__)
        return twin


class StructuredOutputs:
    """An engine's grammars: compiled against its tokenizer and vocabulary once per distinct constraint,
    states for new sequences, and each step's bitmask rows."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 reasoning_markers: tuple[str, str] | None = None, pin_memory: bool = False):
        self.tokenizer = tokenizer
        self.pin_memory = pin_memory
        self._host_bitmask: torch.Tensor | None = None
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(eos_token_ids)
        self.reasoning_markers = reasoning_markers
        self._compiler = None
        self._lock = threading.Lock()
        self._batch = None      # xgrammar's BatchGrammarMatcher: fills many rows on several threads
        self._compiled: dict[tuple, object] = {}      # constraint_key -> CompiledGrammar, least recent first

    def prepare_in_background(self) -> None:
        """prepare() on a thread, if xgrammar is installed."""
        if find_spec("xgrammar") is not None:
            threading.Thread(target=self.prepare, name="xgrammar-prepare", daemon=True).start()

    @property
    def num_words(self) -> int:
        """int32 words a bitmask row holds: one bit a token."""
        return (self.vocab_size + 31) // 32

    def prepare(self) -> None:
        """Import xgrammar and read the tokenizer's vocabulary into its compiler (a second or two for a
        150k vocabulary): on a GPU the engine does it on a thread at start-up, so that the first
        constrained request does not wait for it; otherwise the first one that needs it."""
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def _compile(self, params: StructuredOutputsParams):
        key = constraint_key(params)
        compiled = self._compiled.pop(key, None)
        if compiled is None:
            self.prepare()
            grammar = _parsed_grammar(key)
            try:
                compiled = self._compiler.compile_grammar(grammar)
            except Exception as error:    # one that parses yet does not compile (a string's minLength < 0): the
                # request's refusal, never the engine's death (compiled before any engine state is touched)
                words = _xgrammar_words(error)
                raise ValueError(f"structured_outputs.{key[0]} cannot be compiled: {words}") from None
            if len(self._compiled) >= MAX_CACHED_GRAMMARS:
                self._compiled.pop(next(iter(self._compiled)))
        self._compiled[key] = compiled      # most recent last
        return compiled

    def new_state(self, params: StructuredOutputsParams, prompt_token_ids: list[int]) -> GrammarState:
        """The grammar state of a new request's first sequence (its other completions fork it)."""
        matcher = _xgrammar().GrammarMatcher(self._compile(params), override_stop_tokens=self.stop_token_ids)
        reasoning = None
        if self.reasoning_markers is not None:
            reasoning = ReasoningGate(self.tokenizer, *self.reasoning_markers, prompt_token_ids)
        return GrammarState(matcher, reasoning)

    def bitmask(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(bitmask [rows, num_words] int32, the batch rows they mask [rows] int32) for this step's
        sequences that are constrained now, on the host; None if none is. xgrammar fills the rows on
        several threads."""
        rows = [i for i, seq in enumerate(seqs)
                if seq.grammar is not None and not seq.is_finished and seq.grammar.active]
        if not rows:
            return None
        bitmask = self._host_rows(len(rows))
        matchers = [seqs[i].grammar.matcher for i in rows]
        if len(rows) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            if self._batch is None:
                self._batch = _xgrammar().BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask, torch.tensor(rows, dtype=torch.int32)

    def verify_bitmask(self, seqs: list[Sequence], drafts: list[list[int]]
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """bitmask()'s for a verification step, whose rows are each sequence's len(drafts[i]) + 1 positions
        (GrammarState.fill_draft_rows); None if no row is constrained."""
        most = sum(len(draft) + 1 for seq, draft in zip(seqs, drafts) if seq.grammar is not None)
        if not most:
            return None
        bitmask, rows, first = self._host_rows(most), [], 0
        for seq, draft in zip(seqs, drafts):
            if seq.grammar is not None and not seq.is_finished:
                rows += [first + j for j in seq.grammar.fill_draft_rows(draft, bitmask, len(rows))]
            first += len(draft) + 1
        return (bitmask[:len(rows)], torch.tensor(rows, dtype=torch.int32)) if rows else None

    def _host_rows(self, num_rows: int) -> torch.Tensor:
        """num_rows bitmask rows on the host, kept across steps (pinned on a GPU): the last step's copy to
        the device is done by now, since the host has waited for that step's tokens, which the device
        sampled after the copy."""
        if self._host_bitmask is None or self._host_bitmask.size(0) < num_rows:
            size = max(num_rows, 64 if self._host_bitmask is None else 2 * self._host_bitmask.size(0))
            self._host_bitmask = torch.empty((size, self.num_words), dtype=torch.int32, pin_memory=self.pin_memory)
        return self._host_bitmask[:num_rows]
