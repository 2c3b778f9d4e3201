"""What the endpoints share: the engine, the served model's name, the engine requests in flight; a
request's prompts checked by the engine (a refusal is a 400, before anything runs), then started
together, their outputs merged as they come."""
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from nanovllm.entrypoints.errors import APIError, as_api_error
from nanovllm.entrypoints.protocol import ErrorResponse
from nanovllm.entrypoints.reasoning_parsers import reasoning_parser
from nanovllm.entrypoints.streams import InFlight, merge, sse
from nanovllm.entrypoints.tool_parsers import tool_parser
from nanovllm.sampling_params import SamplingParams


@dataclass
class Job:
    """One prompt of a request, as the engine will run it."""
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class ChatOptions:
    """The server's options for chat answers (nanovllm serve's flags, vLLM's names): tool_choice "auto"
    parses calls with `tool_call_parser` (needs `enable_auto_tool_choice`); `reasoning_parser` splits
    the thinking from the answer (the engine's Config.reasoning_parser)."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self):
        if self.tool_call_parser is not None:
            tool_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass
class Serving:
    engine: object                  # nanovllm.AsyncLLM, or anything with its interface
    model_name: str
    chat_options: ChatOptions = field(default_factory=ChatOptions)
    in_flight: InFlight = field(init=False)

    def __post_init__(self):
        self.in_flight = InFlight(self.engine)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           status=404, type="invalid_request_error", param="model", code="model_not_found")

    def job(self, prompt: str | list[int], make_params: Callable[[int], SamplingParams],
            max_tokens: int | None, max_tokens_param: str | None = "max_tokens") -> Job:
        """Check one prompt with the engine, once: the job runs with the checked token ids (generate is
        not asked to check them again). max_tokens None: whatever room max_model_len leaves the prompt (as
        SamplingParams takes None; after truncate_prompt_tokens). A max_tokens the client sent in the field
        `max_tokens_param` is refused (400) where the prompt leaves no room for it, as vLLM's server refuses
        it; max_tokens_param None: a default the client did not ask for, capped to the room by the engine."""
        try:
            params = make_params(max_tokens)
            token_ids = self.engine.check_request(prompt, params)
        except (ValueError, TypeError) as error:
            raise APIError(str(error)) from None
        if max_tokens_param is not None:
            check_room(len(token_ids), max_tokens, self.engine.max_model_len, max_tokens_param)
        return Job(token_ids, params)

    def run(self, request_id: str, jobs: list[Job]) -> AsyncIterator[tuple[int, object]]:
        """(job index, engine output) as they come, every job running at once."""
        return merge([self.in_flight.track(f"{request_id}-{i}", self.engine.generate(
            job.prompt_token_ids, job.params, f"{request_id}-{i}", checked_token_ids=job.prompt_token_ids))
            for i, job in enumerate(jobs)])

    async def start(self, request_id: str, jobs: list[Job]) -> tuple[object, AsyncIterator]:
        """Start the jobs and wait for the first output, so that a request the engine refuses after all
        is still a 400 before a stream begins. Returns (the first (index, output), the rest)."""
        outputs = self.run(request_id, jobs)
        try:
            first = await anext(outputs)
        except (ValueError, TypeError) as error:
            await outputs.aclose()
            raise APIError(str(error)) from None
        return first, outputs


def check_room(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
               param: str = "max_tokens") -> None:
    """Refuse a max_tokens longer than the room max_model_len leaves the prompt (vLLM's check and message).
    The engine would cap it silently (the offline LLM's behaviour); a server's client asked for that
    many tokens and is told at once instead of getting a completion cut short with "length"."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                       f"maximum context length is {max_model_len} tokens and your request has "
                       f"{num_prompt_tokens} input tokens ({max_tokens} > {max_model_len} - {num_prompt_tokens}).",
                       param=param)


async def outputs_of(first: tuple[int, object], rest: AsyncIterator) -> AsyncIterator[tuple[int, object]]:
    """The first output and the rest as one iteration, which closes the rest however it ends."""
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item


def stream_error(error: Exception) -> str:
    """An error after a stream began can only be told in the stream: one event in OpenAI's shape (vLLM's
    way), before [DONE]."""
    return sse(ErrorResponse(error=as_api_error(error).info()).model_dump_json())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
