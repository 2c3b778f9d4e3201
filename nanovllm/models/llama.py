"""The Llama decoder, and the families that differ from it only in details.

Llama: pre-norm decoder layers of GQA attention with rotary embeddings and a SwiGLU MLP. Qwen2 adds a
bias to the q/k/v projections; Qwen3 (qwen3.py) normalizes each head's q and k. Each family says how it
differs through `variant(config)`; everything else is shared.
"""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.quantization.base import ScaledOutput
from nanovllm.layers.rotary_kv_store import RotaryEmbedding, rope_parameters
from nanovllm.distributed.group import current_group


class LlamaAttention(nn.Module):

    def __init__(self, config: PretrainedConfig, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: bool = False, input_size: int | None = None):
        """input_size: the width q/k/v are projected from (default hidden_size; EAGLE-3's layer reads two)."""
        super().__init__()
        tp_size = current_group().size
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(input_size or config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias)
        theta, scaling = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # Attention rotates q and k (normalized first: Qwen3 only); on a GPU one kernel also writes the KV cache
        o = self.attn(q, k, v, positions, self.rotary_emb, self.q_norm, self.k_norm)
        return self.o_proj(o.flatten(1, -1))


class LlamaMLP(nn.Module):

    def __init__(self, config: PretrainedConfig, bias: bool = False):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()
        self.act_fn.output_quantization = self.down_proj.input_quantization()   # down reads it alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """`mlp`: the feed-forward block (a mixture of experts in MoE families); default the dense SwiGLU MLP."""

    def __init__(self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool, mlp_bias: bool, qk_norm: bool,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, o_bias, qk_norm)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # a norm whose output one projection alone reads writes it in that projection's input form (FP8: e4m3
        # values and scales, in the norm's own pass); a MoE block's router reads it in the model's dtype
        self.input_layernorm.output_quantization = self.self_attn.qkv_proj.input_quantization()
        if isinstance(self.mlp, LlamaMLP):
            self.post_attention_layernorm.output_quantization = self.mlp.gate_up_proj.input_quantization()
        # o_proj's output, and the dense MLP's, go straight into an RMSNorm that adds the residual (this layer's
        # second, the next layer's first, the model's last): where one rank holds the whole sum, a quantized
        # projection may leave its output's scales to that norm (ScaledOutput); gate_up_proj's, on any number of
        # ranks, to SiLU-and-mul (each rank's columns are whole)
        if isinstance(self.mlp, LlamaMLP):
            self.mlp.gate_up_proj.defer_output_scales = "silu"
        if current_group().size == 1:
            self.self_attn.o_proj.defer_output_scales = "norm"
            if isinstance(self.mlp, LlamaMLP):
                self.mlp.down_proj.defer_output_scales = "norm"

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):

    def __init__(self, config: PretrainedConfig, sparse_mlp=None, **variant):
        """`sparse_mlp(config, layer_index)`: layer i's MoE block, or None where the layer is dense."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, **variant, mlp=sparse_mlp and sparse_mlp(config, i))
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

        # EAGLE-3 drafts read the residual stream entering a few layers: set_aux_hidden_layers
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None

    def set_aux_hidden_layers(self, layer_ids: tuple[int, ...], max_tokens: int) -> None:
        """Each forward also writes the residual stream entering layers `layer_ids`, side by side, into
        aux_hidden_states[:num_tokens] (a buffer of max_tokens rows: CUDA graphs replay the copy into it)."""
        self.aux_hidden_layers = tuple(layer_ids)
        width = len(layer_ids) * self.embed_tokens.weight.size(1)
        self.aux_hidden_states = self.embed_tokens.weight.new_empty(max_tokens, width)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_layers:
                width = hidden_states.size(1)
                column = self.aux_hidden_layers.index(i) * width
                if isinstance(hidden_states, ScaledOutput):
                    hidden_states = hidden_states.materialize()
                entering = hidden_states if residual is None else hidden_states + residual
                self.aux_hidden_states[:len(entering), column:column + width].copy_(entering)
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter, which shard of it)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    # checkpoint module name -> ours, where a family names a module differently (Mixtral's MoE block)
    renamed_modules: dict[str, str] = {}
    # MoE families: a per-expert checkpoint tensor's projection name -> its shard of the stacked experts
    expert_shards: dict[str, str] = {}
    sparse_mlp = None   # MoE families: (config, layer_index) -> that layer's MoE block, or None if dense

    @staticmethod
    def variant(config: PretrainedConfig) -> dict:
        """Where this family's decoder differs: projection biases and per-head q/k RMSNorm."""
        attention_bias = getattr(config, "attention_bias", False)
        return dict(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=getattr(config, "mlp_bias", False),
                    qk_norm=False)

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.model = LlamaModel(config, self.sparse_mlp, **self.variant(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)


class Qwen2ForCausalLM(LlamaForCausalLM):

    @staticmethod
    def variant(config: PretrainedConfig) -> dict:
        return dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
