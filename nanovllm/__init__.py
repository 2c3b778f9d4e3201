from nanovllm.async_llm import AsyncLLM
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "LLM", "SamplingParams"]
