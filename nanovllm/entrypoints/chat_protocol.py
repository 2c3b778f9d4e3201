"""Chat's request and response bodies: messages (with tool calls and tool results), OpenAI's function
tools and tool_choice, vLLM's chat_template_kwargs, the chat completion and its stream chunks (content,
reasoning, tool calls), and vLLM's /tokenize (which renders messages too). Checked as protocol.py checks."""
from typing import Any, Literal

from pydantic import Field, field_validator, model_serializer, model_validator

from nanovllm.engine.chat_template import TEXT_PART_SEPARATOR
from nanovllm.entrypoints.protocol import ChatLogprobs, RequestModel, ResponseModel, SamplingRequest, UsageInfo
from nanovllm.sampling_params import MAX_LOGPROBS


# ---- requests -----------------------------------------------------------------------------------------
class ContentPart(RequestModel):
    type: str
    text: str | None = None


class FunctionCallText(RequestModel):
    name: str
    arguments: str | dict[str, Any] = "{}"      # JSON text, as OpenAI sends it (an object is taken too)


class MessageToolCall(RequestModel):
    """A tool call of an earlier assistant message, as the client sends it back."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallText


class ChatMessage(RequestModel):
    """One message of a conversation. Content is text, or a list of text parts (joined); other parts
    (images, audio) are refused: the models served here read text only. An assistant message may carry
    `tool_calls` (its content then may be null), a tool message the `tool_call_id` it answers."""
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None    # an assistant's earlier thinking, for templates that show it

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("must be a string or a list of content parts")
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
        return content

    def as_dict(self) -> dict:
        """The message as the chat template reads it: {"role", "content": text}, and the tool fields given."""
        content = self.content
        if isinstance(content, list):
            content = TEXT_PART_SEPARATOR.join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.tool_calls is not None:
            message["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None    # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatTemplateInputs(RequestModel):
    """What a chat template reads besides the messages: tools, and vLLM's chat_template_kwargs,
    add_generation_prompt and continue_final_message (the model goes on with the final message)."""
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def template_tools(self) -> list[dict] | None:
        return None if self.tools is None else [tool.model_dump(exclude_none=True) for tool in self.tools]


class ChatCompletionRequest(ChatTemplateInputs, SamplingRequest):
    """POST /v1/chat/completions: the conversation goes through the tokenizer's chat template."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)                 # deprecated by OpenAI for:
    max_completion_tokens: int | None = Field(None, ge=1)      # None for both: up to max_model_len
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # None: "auto" with tools, else "none" (OpenAI's defaults); see structured_requests.tool_plan
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None     # false: tool_choice "required" makes exactly one call

    @model_validator(mode="after")
    def _supported(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_new_tokens_param(self) -> str:
        """The field max_new_tokens comes from, for an error to name."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None without logprobs, else top_logprobs (0 by default)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        return [message.as_dict() for message in self.messages]


class TokenizeRequest(ChatTemplateInputs):
    """POST /tokenize (vLLM's): a prompt, or messages (and tools) through the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True         # for a prompt; a chat template holds its own
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        return self


# ---- responses ----------------------------------------------------------------------------------------
class FunctionCall(ResponseModel):
    name: str
    arguments: str      # JSON text


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(ResponseModel):
    """The answer. reasoning / reasoning_content (the same text: vLLM's current name and its older one,
    which most clients read) are sent when the server has a reasoning parser, tool_calls when the request
    has tools; content is null when the answer is only tool calls or only reasoning."""
    role: str = "assistant"
    content: str | None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _given_only(self, handler):
        return {key: value for key, value in handler(self).items()
                if key in ("role", "content") or key in self.model_fields_set}


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class SentOnly(ResponseModel):
    """A stream's piece: fields not sent (None) are left out."""

    @model_serializer(mode="wrap")
    def _sent_only(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(SentOnly):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(SentOnly):
    """A piece of tool call `index`: the first carries id, type and name; the arguments' JSON text is
    the concatenation of every piece's."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(SentOnly):
    """A streamed choice's new text (and thinking, and tool calls); the first chunk carries the role."""
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
