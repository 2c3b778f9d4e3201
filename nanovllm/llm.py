from nanovllm.engine.chat_template import (GENERATION_CONFIG_KEYS, conversations, default_sampling_params,
                                           render_chat, render_conversation)
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "GENERATION_CONFIG_KEYS", "default_sampling_params", "render_chat"]


class LLM(LLMEngine):
    """The public face: `LLM(model_dir, **config).generate(prompts, sampling_params)`, or `.chat(messages)`."""

    def generate(self, prompts: str | dict | list[str] | list[list[int]] | list[dict],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """LLMEngine.generate; sampling_params=None: get_default_sampling_params(), as vLLM."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return super().generate(prompts, sampling_params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             continue_final_message: bool = False) -> list[dict]:
        """Answer one conversation ([{"role", "content"}, ...]) or a list of them, rendered through the
        tokenizer's chat template; one output per conversation, as generate() gives them. Content is text
        or a list of OpenAI text parts ([{"type": "text", "text": ...}], joined).
        sampling_params=None: get_default_sampling_params(). `tools` (OpenAI's function tools) and
        `chat_template_kwargs` (e.g. {"enable_thinking": False}) go to the template; assistant messages
        may carry `tool_calls` (content None) and "tool" messages answer them. continue_final_message=True
        (with add_generation_prompt=False), as vLLM's: the model goes on with the final message."""
        found = conversations(messages)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        prompts = [render_conversation(self.tokenizer, self.config.model, c, add_generation_prompt, tools,
                                       chat_template_kwargs, continue_final_message) for c in found]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                    continue_final_message: bool = False) -> list[int]:
        """One conversation's prompt token ids, as chat() would generate from them."""
        return render_chat(self.tokenizer, self.config.model, messages, add_generation_prompt, tools,
                           chat_template_kwargs, continue_final_message)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the checkpoint's generation_config.json values (if any) for temperature,
        top_p, top_k, min_p and repetition_penalty, as vLLM does."""
        return default_sampling_params(self.config.model)
