"""What crosses between the engine and whatever turns its tokens into outputs: the per-completion token
updates a step produces (in-process for LLM.generate, pickled over a Pipe for AsyncLLM), and the typed
messages between AsyncLLM's process and the engine's (engine_core.py).

    to the engine:   AddRequest | AbortRequest | FinishCompletion | Shutdown
    from the engine: Ready | Refused | StepOutputs | Stats | Fatal
"""
from dataclasses import dataclass, field

from nanovllm.engine.request_check import RequestLimits
from nanovllm.sampling_params import SamplingParams

# a request's or a setting's fault: raised to the caller as they are; anything else is the engine's
REFUSALS: tuple[type[Exception], ...] = (ValueError, TypeError, FileNotFoundError)


def refusal(kind: str, message: str) -> Exception:
    """The exception named `kind` (one of REFUSALS' names; RuntimeError for any other) with `message`."""
    classes = {cls.__name__: cls for cls in REFUSALS}
    return classes.get(kind, RuntimeError)(message)


@dataclass
class CompletionUpdate:
    """What one of a request's n completions gained in a step: sent whenever it gains tokens or ends."""
    request_id: int | str                   # LLMEngine's: the request's first sequence id; AsyncLLM's: its id
    index: int                              # which of the n completions
    token_ids: list[int]                    # the tokens it gained (eos and stop tokens included)
    logprobs: list[dict[int, float]] | None = None      # one {token id: log-prob} per token, if asked
    finish_reason: str | None = None        # "stop" | "length" | "abort" once it has ended
    stop_reason: int | None = None          # the stop token id that ended it (None for eos)
    prompt_logprobs: list[dict[int, float] | None] | None = None   # with completion 0's first update


# ---- AsyncLLM's process -> the engine's ------------------------------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]             # checked already (AsyncLLM.check_request): not checked again
    params: SamplingParams


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class FinishCompletion:
    """The frontend found a stop string in completion `index`'s text: the engine stops computing it."""
    request_id: str
    index: int


@dataclass
class Shutdown:
    pass


# ---- the engine's process -> AsyncLLM's ------------------------------------------------------------------
@dataclass
class EngineInfo:
    model: str
    limits: RequestLimits       # what the engine checks a request against, for the frontend to check first


@dataclass
class Ready:
    info: EngineInfo


@dataclass
class Refused:
    """The engine would not take a request (AsyncLLM checks first, so this is rare)."""
    request_id: str
    kind: str                               # the exception's class name: refusal(kind, message) rebuilds it
    message: str


@dataclass
class StepOutputs:
    updates: list[CompletionUpdate]
    stats: dict | None = None               # the engine's figures, a few times a second


@dataclass
class Stats:
    stats: dict = field(default_factory=dict)


@dataclass
class Fatal:
    """The engine failed (to start, or while stepping) and its process is ending."""
    kind: str
    message: str
