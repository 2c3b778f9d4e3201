"""The model registry: a checkpoint's `architectures` entry -> the class that builds it."""
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("nanovllm.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("nanovllm.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("nanovllm.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("nanovllm.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("nanovllm.models.mixtral", "MixtralForCausalLM"),
}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
# config fields by which a mixture-of-experts checkpoint of another family shows itself
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")


def model_class(hf_config):
    from importlib import import_module
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in architectures:
        if arch in SUPPORTED_ARCHITECTURES:
            module, name = SUPPORTED_ARCHITECTURES[arch]
            return getattr(import_module(module), name)
    if any(getattr(hf_config, field, None) for field in _EXPERT_FIELDS) or any("moe" in a.lower() for a in architectures):
        raise ValueError(f"unsupported mixture-of-experts architecture {architectures!r}; supported MoE "
                         f"architectures: {', '.join(MOE_ARCHITECTURES)} (dense: "
                         f"{', '.join(sorted(set(SUPPORTED_ARCHITECTURES) - set(MOE_ARCHITECTURES)))})")
    raise ValueError(f"unsupported architecture {architectures!r}; "
                     f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
