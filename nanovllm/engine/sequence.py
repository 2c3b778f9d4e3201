import sys
from copy import copy
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams

PENDING = -1    # stands in for a token the device is still sampling (the next step is scheduled before it arrives)


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its tokens, where their KV lives (block_table) and how much of it is computed."""
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int, index: int = 0,
                 parent_id: int | None = None):
        self.seq_id = next(Sequence._ids)
        self.index = index               # which of its request's n completions this is
        self.parent_id = self.seq_id if parent_id is None else parent_id    # the request's first sequence
        # completions still to split off this one: indexes index + 1 .. index + num_forks
        self.num_forks = sampling_params.n - 1 if index == 0 else 0
        self.status = SequenceStatus.WAITING
        self.block_size = block_size
        self.token_ids = copy(token_ids)
        self.last_token = token_ids[-1]
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0       # tokens whose KV is already in the cache
        self.num_scheduled_tokens = 0    # tokens this step computes, from num_cached_tokens on
        self.num_pending_tokens = 0      # trailing PENDING placeholders (at most one per step in flight)
        self.block_table: list[int] = []
        self.sampling_params = sampling_params
        # max_tokens None: no limit of its own (the scheduler ends every sequence at max_model_len)
        self.max_tokens = sampling_params.max_tokens if sampling_params.max_tokens is not None else sys.maxsize
        self.ignore_eos = sampling_params.ignore_eos
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.finish_reason: str | None = None    # "stop" or "length"
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        # prompt_logprobs: one entry per prompt token (None for the first), filled as the prompt's chunks are
        # computed; the request's first completion holds them
        wants_prompt_logprobs = sampling_params.prompt_logprobs is not None and index == 0
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * len(token_ids) if wants_prompt_logprobs else None)
        self.cumulative_logprob = 0.0
        self.num_reported_tokens = 0     # completion tokens already in a CompletionUpdate
        self.finish_reported = False     # its end is in one too: later rows of it (a step late) say nothing
        self.grammar = None              # a structured output's GrammarState (engine/structured_output.py)

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key):
        if len(self.token_ids) < self.num_tokens:
            # a worker's copy of a step that computes one token got only that one (__getstate__): a
            # prefill of one token (the rest hit in the cache, or held by reference) reads it here
            return ([PENDING] * (self.num_tokens - 1) + [self.last_token])[key]
        return self.token_ids[key]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1

    def fork(self, index: int) -> "Sequence":
        """Completion `index` of this request: the same tokens so far; it samples its own continuation
        from the next token on. Its blocks come from BlockManager.fork (or share_prompt)."""
        child = Sequence(self.token_ids, self.sampling_params, self.block_size, index, self.parent_id)
        child.status = self.status
        child.num_prompt_tokens = self.num_prompt_tokens
        child.grammar = None if self.grammar is None else self.grammar.fork()
        return child

    def append_pending(self) -> None:
        self.append_token(PENDING)
        self.num_pending_tokens += 1

    def fill_pending(self, token_id: int) -> None:
        """The oldest placeholder's token arrived."""
        assert self.num_pending_tokens > 0
        i = self.num_tokens - self.num_pending_tokens
        self.token_ids[i] = token_id
        self.num_pending_tokens -= 1
        if i == self.num_tokens - 1:
            self.last_token = token_id

    def drop_pending(self) -> None:
        """Forget the placeholders of steps that ran past the end (the sequence stopped before them)."""
        if self.num_pending_tokens:
            del self.token_ids[-self.num_pending_tokens:]
            self.num_tokens -= self.num_pending_tokens
            self.num_pending_tokens = 0
            self.last_token = self.token_ids[-1]

    # Workers get a compact copy each step: the full token list only while a prefill needs it,
    # otherwise just the last token (decode computes one token whose position follows from num_tokens).
    def __getstate__(self):
        needs_all_tokens = self.num_tokens - self.num_cached_tokens > 1
        return (self.seq_id, self.block_size, self.num_tokens, self.num_prompt_tokens, self.num_cached_tokens,
                self.num_scheduled_tokens, self.block_table,
                self.token_ids if needs_all_tokens else self.last_token)

    def __setstate__(self, state):
        (self.seq_id, self.block_size, self.num_tokens, self.num_prompt_tokens, self.num_cached_tokens,
         self.num_scheduled_tokens, self.block_table, tokens) = state
        if isinstance(tokens, list):
            self.token_ids, self.last_token = tokens, tokens[-1]
        else:
            self.token_ids, self.last_token = [], tokens
