"""Conversations as prompts, and a checkpoint's default sampling parameters: what LLM.chat and AsyncLLM
(the server) both need, kept below them."""
import json
from pathlib import Path

from nanovllm.sampling_params import SamplingParams

# the generation_config.json keys that override SamplingParams' defaults, as in vLLM
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# apply_chat_template's own arguments, which chat_template_kwargs may not override
RESERVED_TEMPLATE_ARGUMENTS = frozenset({"conversation", "tools", "documents", "chat_template", "tokenize",
                                         "add_generation_prompt", "continue_final_message", "return_dict",
                                         "return_tensors", "padding", "truncation", "max_length",
                                         "tokenizer_kwargs", "return_assistant_tokens_mask"})


def conversations(messages) -> list[list[dict]]:
    """One conversation or a list of them -> a list of checked conversations."""
    if not isinstance(messages, list):
        raise TypeError(f"messages must be a list of message dicts or a list of conversations, "
                        f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    found = [messages] if isinstance(messages[0], dict) else messages
    for i, conversation in enumerate(found):
        if not isinstance(conversation, list):
            raise TypeError(f"conversation {i} must be a list of message dicts, got {type(conversation).__name__}")
        if not conversation:
            raise ValueError(f"conversation {i} is empty")
        for j, message in enumerate(conversation):
            if not isinstance(message, dict):
                raise TypeError(f"message {j} of conversation {i} must be a dict, got {type(message).__name__}")
            # an assistant message that calls tools may leave its content out (or null)
            needed = ("role",) if message.get("tool_calls") else ("role", "content")
            missing = [key for key in needed if key not in message]
            if missing:
                raise ValueError(f"message {j} of conversation {i} lacks {' and '.join(map(repr, missing))}")
            if not isinstance(message["role"], str):
                raise TypeError(f"the role of message {j} of conversation {i} must be a str, "
                                f"got {type(message['role']).__name__}")
            calls = message.get("tool_calls")
            if calls is not None and (not isinstance(calls, list) or not all(
                    isinstance(call, dict) and isinstance(call.get("function"), dict) for call in calls)):
                raise TypeError(f"the tool_calls of message {j} of conversation {i} must be a list of "
                                f"{{\"function\": {{\"name\", \"arguments\"}}}} dicts")
    return found


def _template_message(message: dict) -> dict:
    """A message as templates expect it: content text ("" for none), and tool calls' arguments as objects
    (templates write them with `tojson`; OpenAI clients send them as JSON text), as vLLM hands them over."""
    message = {**message, "content": "" if message.get("content") is None else message["content"]}
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = dict(call["function"])
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass        # not JSON: the template gets the text
            calls.append({**call, "function": function})
        message["tool_calls"] = calls
    return message


def render_chat(tokenizer, model: str, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
    """One conversation's prompt token ids, through the tokenizer's chat template (model: for the error)."""
    [conversation] = conversations([messages])
    return render_conversation(tokenizer, model, conversation, add_generation_prompt, tools, chat_template_kwargs)


def render_conversation(tokenizer, model: str, conversation: list[dict], add_generation_prompt: bool,
                        tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
    """A checked conversation's prompt token ids. `tools` (OpenAI's function tools) and
    `chat_template_kwargs` (e.g. {"enable_thinking": False}) are the template's to read; a template that
    refuses the conversation raises ValueError."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {model} has no chat template; use generate() with plain prompts")
    kwargs = dict(chat_template_kwargs or {})
    taken = sorted(RESERVED_TEMPLATE_ARGUMENTS & set(kwargs))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {taken}: the request sets them")
    from jinja2 import TemplateError
    try:
        text = tokenizer.apply_chat_template([_template_message(m) for m in conversation], tools=tools,
                                             tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    except TemplateError as error:
        raise ValueError(f"the chat template of {model} refused the conversation: {error}") from None
    return tokenizer.encode(text, add_special_tokens=False)     # the template holds any BOS


def default_sampling_params(model: str) -> SamplingParams:
    """SamplingParams() with the checkpoint's generation_config.json values (if any) for temperature,
    top_p, top_k, min_p and repetition_penalty, as vLLM does."""
    path = Path(model) / "generation_config.json"
    if not path.is_file():
        return SamplingParams()
    config = json.loads(path.read_text())
    return SamplingParams(**{key: config[key] for key in GENERATION_CONFIG_KEYS if config.get(key) is not None})
