"""The EAGLE-3 draft head (Li et al. 2025) for Llama and Qwen3 targets, in the layout its published
checkpoints use (config.json's architectures "LlamaForCausalLMEagle3" or "Eagle3LlamaForCausalLM"):

    fc.weight                   [hidden, 3 * target hidden]   the target's residual stream entering three
                                                              layers (set_aux_hidden_layers), fused into one
    midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight
    midlayer.self_attn.{q,k,v,o}_proj.weight                  q/k/v read [normed embedding, normed hidden]
    midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight, lm_head.weight [draft vocab, hidden]
    d2t                         [draft vocab] int64: target id = draft id + d2t[draft id] (absent when the
                                draft vocabulary is the target's); t2d, embed_tokens: not read (the head
                                embeds with the target's embedding)

At position p the head reads token p + 1's embedding and a hidden state for position p: the target's (through
fc) where the target computed p, else its own output at p - 1 (`forward`'s `from_target`). It returns the
normed state (logits come from it) and the state before the norm (the next position's hidden input)."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def aux_hidden_layer_ids(head_config: PretrainedConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose entering residual stream the head reads: the head config's own list (as
    `eagle_config.eagle_aux_hidden_state_layer_ids`), else layers 2, L // 2 and L - 3, as EAGLE-3 trains."""
    eagle = getattr(head_config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    ids = tuple(ids) if ids else (2, num_target_layers // 2, num_target_layers - 3)
    if len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(f"the EAGLE-3 head reads three distinct layers of the target's {num_target_layers}, "
                         f"got {list(ids)} (set eagle_config.eagle_aux_hidden_state_layer_ids in its config.json)")
    return ids


class Eagle3Layer(nn.Module):
    """The head's one decoder layer: attention over [input_layernorm(embedding), hidden_norm(hidden)]."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.self_attn = LlamaAttention(config, input_size=2 * config.hidden_size)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden_states
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden_states)], dim=-1)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: PretrainedConfig, target_hidden_size: int):
        super().__init__()
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.fc = ReplicatedLinear(3 * target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, config.hidden_size)
        self.d2t = None
        if self.draft_vocab_size != config.vocab_size:
            self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False)
        self.embed_tokens: list[VocabParallelEmbedding] = []    # the target's, handed in (not a parameter here)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                from_target: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, before the norm) of each row: token input_ids[r]'s embedding at positions[r], with the
        target's aux hidden states (from_target) or the head's own previous output."""
        embeds = self.embed_tokens[0](input_ids)
        if from_target:
            hidden_states = self.fc(hidden_states)
        x, residual = self.midlayer(positions, embeds, hidden_states)
        return self.norm(x, residual)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]
