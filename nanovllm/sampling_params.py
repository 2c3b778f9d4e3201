import json
from dataclasses import dataclass, fields

MAX_LOGPROBS = 20


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# the kinds of constraint, exactly one a request (vLLM's names)
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output, with vLLM's names and meanings: exactly one of
    json (a JSON schema, as a dict or its text), regex, choice (the output is one of these strings),
    grammar (EBNF, as xgrammar and llama.cpp's GBNF read it), json_object=True (any JSON object) or
    structural_tag (xgrammar's structural tag, as JSON text). The output always conforms; generation
    ends when the constraint is complete (on an end-of-sequence token, finish_reason "stop") or at
    max_tokens. disable_any_whitespace: JSON without whitespace between tokens;
    disable_additional_properties: a schema's objects take no properties beyond those it names.
    Whether a schema, regex or grammar is well formed is checked when a request is added (ValueError)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self):
        given = [name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(CONSTRAINT_KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as error:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
            elif isinstance(self.json, dict):
                schema = self.json
            else:
                raise TypeError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                                f"got {type(self.json).__name__}")
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema: an object")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"structured_outputs.{name} must be a str, got {type(value).__name__}")
            if value == "":
                raise ValueError(f"structured_outputs.{name} must not be empty")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise TypeError(f"structured_outputs.choice must be a non-empty list of str, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise TypeError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of CONSTRAINT_KINDS."""
        return next(name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False))

    @classmethod
    def from_dict(cls, value: "dict | StructuredOutputsParams") -> "StructuredOutputsParams":
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"structured_outputs must be a StructuredOutputsParams or a dict, "
                            f"got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**value)


@dataclass
class SamplingParams:
    """How to pick each request's tokens, with vLLM's names and meanings.

    Processing order for a step's logits: allowed_token_ids (every other token -inf) -> logit_bias (added
    to the logits) -> penalties (repetition over prompt + output, presence and frequency over the output)
    -> temperature -> min_p -> top_k -> top_p -> draw, as vLLM's sampler orders them. temperature 0.0 is
    greedy (after those edits). logprobs come from the raw logits.
    """
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 64         # None: up to max_model_len
    min_tokens: int = 0                 # eos, stop tokens and stop strings wait until this many tokens exist
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None         # per token: the sampled token's and the k most likely
    prompt_logprobs: int | None = None  # per prompt token (after the first): its log-prob and the k most likely
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None   # a dict is taken too
    logit_bias: dict[int, float] | None = None      # token id -> added to its logit (str keys of digits too)
    allowed_token_ids: list[int] | None = None      # only these tokens may be sampled
    truncate_prompt_tokens: int | None = None       # keep the prompt's last k tokens (-1: max_model_len)

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"{name} must be finite, got {value!r}")
            setattr(self, name, float(value))
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            if not _is_int(getattr(self, name)) and not (name == "max_tokens" and self.max_tokens is None):
                raise TypeError(f"{name} must be an int{' or None' if name == 'max_tokens' else ''}, "
                                f"got {getattr(self, name)!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self._check_ranges()
        self._check_stops()
        if self.seed is not None and not _is_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                if not _is_int(value):
                    raise TypeError(f"{name} must be an int or None, got {value!r}")
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.top_k == -1:
            self.top_k = 0
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._check_logit_edits()
        if self.truncate_prompt_tokens is not None:
            if not _is_int(self.truncate_prompt_tokens):
                raise TypeError(f"truncate_prompt_tokens must be an int or None, got {self.truncate_prompt_tokens!r}")
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(f"truncate_prompt_tokens must be >= 1 (or -1: max_model_len), "
                                 f"got {self.truncate_prompt_tokens}")

    def _check_ranges(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 1, or 0 / -1 for off, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (or None: up to max_model_len), got {self.max_tokens}")
        if not 0 <= self.min_tokens <= (self.max_tokens if self.max_tokens is not None else self.min_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    def _check_stops(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop = list(self.stop)
        else:
            raise TypeError(f"stop must be a str or a list of str, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) for t in self.stop_token_ids):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise TypeError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")

    def _check_logit_edits(self) -> None:
        """logit_bias as {int id: float} (JSON's string keys of digits are read as ids), allowed_token_ids
        as a non-empty list of ids; whether the ids are in the vocabulary is the engine's check."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            bias = {}
            for token, value in self.logit_bias.items():
                if isinstance(token, str) and token.strip().isdigit():
                    token = int(token)
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
                if not _is_number(value):
                    raise TypeError(f"logit_bias[{token}] must be a number, got {value!r}")
                if value != value or value in (float("inf"), float("-inf")):
                    raise ValueError(f"logit_bias[{token}] must be finite, got {value!r}")
                bias[token] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            if (not isinstance(self.allowed_token_ids, (list, tuple))
                    or not all(_is_int(t) for t in self.allowed_token_ids)):
                raise TypeError(f"allowed_token_ids must be a list of ints, got {self.allowed_token_ids!r}")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None: every token)")
            if any(t < 0 for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be token ids >= 0, got {self.allowed_token_ids}")
            self.allowed_token_ids = sorted(set(self.allowed_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def edits_logits(self) -> bool:
        """allowed_token_ids or logit_bias: the logits are edited before penalties (greedy too)."""
        return self.logit_bias is not None or self.allowed_token_ids is not None

    def min_tokens_bans(self, eos_token_ids: frozenset[int]) -> set[int]:
        """What min_tokens bans until that many tokens exist: the stop tokens, and eos unless ignored."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))

    @property
    def has_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
