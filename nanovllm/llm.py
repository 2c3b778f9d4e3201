import json
from pathlib import Path

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams

# the generation_config.json keys that override SamplingParams' defaults, as in vLLM
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _conversations(messages) -> list[list[dict]]:
    """One conversation or a list of them -> a list of checked conversations."""
    if not isinstance(messages, list):
        raise TypeError(f"messages must be a list of message dicts or a list of conversations, "
                        f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    conversations = [messages] if isinstance(messages[0], dict) else messages
    for i, conversation in enumerate(conversations):
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
    return conversations


def render_chat(tokenizer, model: str, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """One conversation's prompt token ids, through the tokenizer's chat template (model: for the error)."""
    [conversation] = _conversations([messages])
    return _render(tokenizer, model, conversation, add_generation_prompt)


def _render(tokenizer, model: str, conversation: list[dict], add_generation_prompt: bool) -> list[int]:
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


class LLM(LLMEngine):
    """The public face: `LLM(model_dir, **config).generate(prompts, sampling_params)`, or `.chat(messages)`."""

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[dict]:
        """Answer one conversation ([{"role", "content"}, ...]) or a list of them, rendered through the
        tokenizer's chat template; one output per conversation, as generate() gives them.
        sampling_params=None: get_default_sampling_params()."""
        conversations = _conversations(messages)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        prompts = [_render(self.tokenizer, self.config.model, c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """One conversation's prompt token ids, as chat() would generate from them."""
        return render_chat(self.tokenizer, self.config.model, messages, add_generation_prompt)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the checkpoint's generation_config.json values (if any) for temperature,
        top_p, top_k, min_p and repetition_penalty, as vLLM does."""
        return default_sampling_params(self.config.model)
