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
# what joins a message's text parts (vLLM's), here and in the server (entrypoints/chat_protocol.py)
TEXT_PART_SEPARATOR = "\n"


def message_text(content: str | list[dict] | None, where: str = "the content") -> str | None:
    """A message's content as the template reads it: text as it is, None as None, and OpenAI's content
    parts ([{"type": "text", "text": ...}, ...], which vLLM's LLM.chat takes) joined. Other parts
    (image_url, input_audio, ...) are refused by type: the models run here read text only. `where`
    names the content in errors."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TypeError(f"{where} must be a str or a list of content parts, got {type(content).__name__}")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            raise TypeError(f"part {k} of {where} must be a dict ({{\"type\": \"text\", \"text\": ...}}), "
                            f"got {type(part).__name__}")
        kind = part.get("type")
        if kind != "text":
            raise ValueError(f"part {k} of {where} is of type {kind!r}: only text parts ({{\"type\": \"text\", "
                             f"\"text\": ...}}) are supported, the models run here read text only")
        if not isinstance(part.get("text"), str):
            raise TypeError(f"text part {k} of {where} must have a str 'text', got {part.get('text')!r:.80}")
        texts.append(part["text"])
    return TEXT_PART_SEPARATOR.join(texts)


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
            message_text(message.get("content"), f"the content of message {j} of conversation {i}")
            calls = message.get("tool_calls")
            if calls is not None and (not isinstance(calls, list) or not all(
                    isinstance(call, dict) and isinstance(call.get("function"), dict) for call in calls)):
                raise TypeError(f"the tool_calls of message {j} of conversation {i} must be a list of "
                                f"{{\"function\": {{\"name\", \"arguments\"}}}} dicts")
    return found


def _template_message(message: dict) -> dict:
    """A message as templates expect it: content text ("" for none, text parts joined), and tool calls'
    arguments as objects (templates write them with `tojson`; OpenAI clients send them as JSON text), as
    vLLM hands them over."""
    content = message_text(message.get("content"))     # text parts joined (checked by conversations())
    message = {**message, "content": "" if content is None else content}
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
                tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                continue_final_message: bool = False) -> list[int]:
    """One conversation's prompt token ids, through the tokenizer's chat template (model: for the error)."""
    [conversation] = conversations([messages])
    return render_conversation(tokenizer, model, conversation, add_generation_prompt, tools, chat_template_kwargs,
                               continue_final_message)


def check_template_arguments(add_generation_prompt: bool, chat_template_kwargs: dict | None,
                             continue_final_message: bool) -> None:
    """Refuse, by name, template arguments that cannot work, before the template runs."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict (or None), got {type(chat_template_kwargs).__name__}")
    taken = sorted(RESERVED_TEMPLATE_ARGUMENTS & set(chat_template_kwargs or {}))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {taken}: the request sets them")
    if not isinstance(continue_final_message, bool):
        raise TypeError(f"continue_final_message must be a bool, got {continue_final_message!r}")
    # one opens a new assistant turn, the other leaves the last message open for the model to go on (vLLM's error)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=True needs add_generation_prompt=False: the prompt either "
                         "continues the final message or opens a new assistant turn, not both")


def render_conversation(tokenizer, model: str, conversation: list[dict], add_generation_prompt: bool,
                        tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                        continue_final_message: bool = False) -> list[int]:
    """A checked conversation's prompt token ids. `tools` (OpenAI's function tools) and
    `chat_template_kwargs` (e.g. {"enable_thinking": False}) are the template's to read;
    `continue_final_message` ends the prompt inside the final message (no end-of-turn), for the model to
    go on with it, as vLLM's. A template that refuses the conversation raises ValueError."""
    check_template_arguments(add_generation_prompt, chat_template_kwargs, continue_final_message)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {model} has no chat template; use generate() with plain prompts")
    from jinja2 import TemplateError
    try:
        # transformers renders continue_final_message: it cuts the text after the final message's content
        text = tokenizer.apply_chat_template([_template_message(m) for m in conversation], tools=tools,
                                             tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **(chat_template_kwargs or {}))
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
