"""Qwen3: the Llama decoder (llama.py) with an RMSNorm on each head's q and k before the rotary embedding."""
from transformers import PretrainedConfig

from nanovllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):

    @staticmethod
    def variant(config: PretrainedConfig) -> dict:
        attention_bias = getattr(config, "attention_bias", False)
        return dict(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False, qk_norm=True)
