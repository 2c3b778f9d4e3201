"""Conversations as prompts, and a checkpoint's default sampling parameters: what LLM.chat and AsyncLLM
(the server) both need, kept below them."""
import json
from pathlib import Path

from nanovllm.sampling_params import SamplingParams

# the generation_config.json keys that override SamplingParams' defaults, as in vLLM
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


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
            missing = [key for key in ("role", "content") if key not in message]
            if missing:
                raise ValueError(f"message {j} of conversation {i} lacks {' and '.join(map(repr, missing))}")
            if not isinstance(message["role"], str):
                raise TypeError(f"the role of message {j} of conversation {i} must be a str, "
                                f"got {type(message['role']).__name__}")
    return found


def render_chat(tokenizer, model: str, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """One conversation's prompt token ids, through the tokenizer's chat template (model: for the error)."""
    [conversation] = conversations([messages])
    return render_conversation(tokenizer, model, conversation, add_generation_prompt)


def render_conversation(tokenizer, model: str, conversation: list[dict], add_generation_prompt: bool) -> list[int]:
    """A checked conversation's prompt token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {model} has no chat template; use generate() with plain prompts")
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)     # the template holds any BOS


def default_sampling_params(model: str) -> SamplingParams:
    """SamplingParams() with the checkpoint's generation_config.json values (if any) for temperature,
    top_p, top_k, min_p and repetition_penalty, as vLLM does."""
    path = Path(model) / "generation_config.json"
    if not path.is_file():
        return SamplingParams()
    config = json.loads(path.read_text())
    return SamplingParams(**{key: config[key] for key in GENERATION_CONFIG_KEYS if config.get(key) is not None})
