"""Mixtral (8x7B, 8x22B): the Llama decoder with a mixture of experts as every layer's MLP, each
token's top-2 of 8 experts weighted by their renormalized router probabilities. Its checkpoints name the
block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up) and w2 (down)."""
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.fused_moe import SparseMoeBlock
from nanovllm.models.llama import LlamaForCausalLM


def sparse_mlp(config: PretrainedConfig, layer_index: int) -> nn.Module:
    return SparseMoeBlock(config.hidden_size, config.intermediate_size, config.num_local_experts,
                          config.num_experts_per_tok, renormalize=True)


class MixtralForCausalLM(LlamaForCausalLM):
    renamed_modules = {"block_sparse_moe": "mlp"}
    expert_shards = {"w1": "gate", "w3": "up", "w2": "down"}
    sparse_mlp = staticmethod(sparse_mlp)

    @staticmethod
    def variant(config: PretrainedConfig) -> dict:
        return dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)

    @staticmethod
    def check_config(config: PretrainedConfig, tensor_parallel_size: int, max_model_len: int) -> None:
        """Refuse, before anything is built, what this implementation would get wrong."""
        window = getattr(config, "sliding_window", None)
        if window is not None and window < max_model_len:
            raise ValueError(f"this Mixtral attends over a sliding window of {window} tokens, which is not "
                             f"supported; set max_model_len <= {window} (every token then sees all before it)")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        if not 1 <= config.num_experts_per_tok <= config.num_local_experts:
            raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} must be in "
                             f"[1, num_local_experts={config.num_local_experts}]")
        if config.intermediate_size % tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide "
                             f"intermediate_size={config.intermediate_size}")
