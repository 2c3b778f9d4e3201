"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's decoder with a mixture of experts as the MLP of
its sparse layers. A layer is sparse unless `mlp_only_layers` names it or `decoder_sparse_step` skips
it; the router's top-k probabilities are renormalized to sum to one when `norm_topk_prob` says so."""
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.fused_moe import SparseMoeBlock
from nanovllm.models.qwen3 import Qwen3ForCausalLM


def is_sparse(config: PretrainedConfig, layer_index: int) -> bool:
    """transformers' rule for which Qwen3-MoE layers have experts."""
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_index + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


def sparse_mlp(config: PretrainedConfig, layer_index: int) -> nn.Module | None:
    if not is_sparse(config, layer_index):
        return None                     # the dense MLP (intermediate_size)
    return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                          config.num_experts_per_tok, bool(getattr(config, "norm_topk_prob", False)))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    expert_shards = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    sparse_mlp = staticmethod(sparse_mlp)

    @staticmethod
    def check_config(config: PretrainedConfig, tensor_parallel_size: int, max_model_len: int) -> None:
        """Refuse, before anything is built, what this implementation would get wrong."""
        for name in ("shared_expert_intermediate_size", "n_shared_experts"):
            if getattr(config, name, None):
                raise ValueError(f"Qwen3-MoE with shared experts ({name}={getattr(config, name)}) is not supported")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        if not 1 <= config.num_experts_per_tok <= config.num_experts:
            raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} must be in "
                             f"[1, num_experts={config.num_experts}]")
        layers = range(config.num_hidden_layers)
        sizes = {"moe_intermediate_size": config.moe_intermediate_size} if any(is_sparse(config, i) for i in layers) else {}
        if not all(is_sparse(config, i) for i in layers):
            sizes["intermediate_size"] = config.intermediate_size
        for name, size in sizes.items():
            if size % tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide {name}={size}")
