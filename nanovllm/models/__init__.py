"""The model registry: a checkpoint's `architectures` entry -> the class that builds it."""
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("nanovllm.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("nanovllm.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("nanovllm.models.qwen3", "Qwen3ForCausalLM"),
}


def model_class(hf_config):
    from importlib import import_module
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in SUPPORTED_ARCHITECTURES:
            module, name = SUPPORTED_ARCHITECTURES[arch]
            return getattr(import_module(module), name)
    raise ValueError(f"unsupported architecture {hf_config.architectures!r}; "
                     f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
