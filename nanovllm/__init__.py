"""nanovllm: LLM (offline batches), AsyncLLM (the engine driven from asyncio, as the server uses it) and
SamplingParams (StructuredOutputsParams for constrained outputs). They are imported on first use (PEP 562), not with the package: `nanovllm --help` and
the other commands that never build an engine do not pay for torch's import."""
from importlib import import_module
from typing import TYPE_CHECKING

# public name -> the module that defines it
_EXPORTS = {
    "AsyncLLM": "nanovllm.async_llm",
    "EngineDeadError": "nanovllm.async_llm",
    "LLM": "nanovllm.llm",
    "SamplingParams": "nanovllm.sampling_params",
    "StructuredOutputsParams": "nanovllm.sampling_params",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from nanovllm.async_llm import AsyncLLM, EngineDeadError
    from nanovllm.llm import LLM
    from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value     # later lookups find it here, without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
