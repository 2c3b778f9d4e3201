"""The HTTP API's request and response bodies that completions and chat share: the sampling fields
(OpenAI's, with vLLM's extras and structured outputs), OpenAI's completions, models, log-probs and errors,
and vLLM's /detokenize. Chat's bodies (messages, tools, /tokenize) are in chat_protocol.py.

Requests are checked here, at the edge: types are strict ("0.5" is not a number, 1.0 is not an int, as
OpenAI reads them), ranges are those of the OpenAI API, and fields this server does not know are
ignored, as OpenAI ignores them. What only the engine can judge (a prompt too long, a token id outside
the vocabulary) is judged by the engine and becomes a 400 in the server.
"""
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nanovllm.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

MAX_N = 128     # OpenAI's limit on completions per prompt
# a seed is a torch int64 (vLLM bounds it so too): a larger one would wrap around, not be refused
MIN_SEED, MAX_SEED = -2 ** 63, 2 ** 63 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingRequest(RequestModel):
    """The fields completions and chat completions share: OpenAI's, then vLLM's extras."""
    model: str | None = None            # None: the served model
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None      # token id (as text) -> bias, clamped to [-100, 100]
    user: str | None = None
    # vLLM's extras
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None       # the prompt's last k tokens (-1: max_model_len)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured outputs (structured_requests.py maps them): OpenAI's response_format, vLLM's
    # structured_outputs, and vLLM's older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, stop):
        if stop is None or isinstance(stop, str):
            return stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError("must be a string or a list of strings")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, ids):
        if ids is not None and any(t < 0 for t in ids):
            raise ValueError("must be token ids >= 0")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias):
        """OpenAI's: token ids as JSON keys, each bias clamped to [-100, 100] (as vLLM does)."""
        if bias is None:
            return None
        clamped = {}
        for token, value in bias.items():
            if not token.strip().isdigit():
                raise ValueError(f"keys must be token ids (integers as strings), got {token!r}")
            if value != value:
                raise ValueError(f"bias of token {token} must be a number, got {value}")
            clamped[int(token)] = min(100.0, max(-100.0, value))
        return clamped

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None = None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """This request's SamplingParams: its own values, the engine's defaults (generation_config.json
        over SamplingParams') for the fields it leaves out. Raises what SamplingParams raises."""
        def pick(name: str):
            value = getattr(self, name)
            return getattr(defaults, name) if value is None else value

        extra = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
        return SamplingParams(
            n=self.n, temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
            min_p=pick("min_p"), seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            presence_penalty=pick("presence_penalty"), frequency_penalty=pick("frequency_penalty"),
            repetition_penalty=pick("repetition_penalty"), skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured_outputs, logit_bias=self.logit_bias or None,
            allowed_token_ids=self.allowed_token_ids, truncate_prompt_tokens=self.truncate_prompt_tokens, **extra)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `echo` with `logprobs` and `max_tokens=0` gives the prompt's own
    log-probs and nothing else (what lm-eval's loglikelihood asks for)."""
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)     # None: up to max_model_len
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt):
        if isinstance(prompt, str) or _is_token_ids(prompt) and prompt:
            return prompt
        if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                    or all(_is_token_ids(p) for p in prompt)):
            return prompt
        if isinstance(prompt, list) and not prompt:
            raise ValueError("must not be empty")
        raise ValueError("must be a string, a list of strings, a list of token ids, or a list of "
                         "token-id lists")

    @model_validator(mode="after")
    def _supported(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo, for the prompt's log-probs)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (other than best_of == n)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One prompt or several, as a list of prompts (each a string or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str) or _is_int(prompt[0]):
            return [prompt]
        return list(prompt)


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# ---- responses ----------------------------------------------------------------------------------------
class ResponseModel(BaseModel):
    pass


class UsageInfo(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(ResponseModel):
    """The legacy completions format: per token its text, log-prob, the top alternatives and where its
    text starts in the choice's text."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None     # vLLM's: the stop string or stop token id


class CompletionResponse(ResponseModel):
    """A completion, or (streamed) one chunk of it."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprob] | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nanovllm"
    root: str
    max_model_len: int


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo
