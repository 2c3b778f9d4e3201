"""The default method: weights in the model's dtype, as the checkpoint stores them (LLM(quantization=None) on
an unquantized checkpoint, and the layers no scheme quantizes: the MoE router)."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.quantization.base import QuantizationMethod, moe_kernel_token_counts, stacked_expert_weights


@dataclass(frozen=True)
class Unquantized(QuantizationMethod):

    def create_weights(self, layer: nn.Module, input_size: int, output_parts: list[int], tp_size: int,
                       input_split: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(sum(output_parts), input_size))
        layer.weight.weight_loader = layer.weight_loader

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def create_moe_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                           intermediate_size: int) -> None:
        stacked_expert_weights(layer, num_experts, hidden_size, intermediate_size)

    def apply_moe(self, layer: nn.Module, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        return layer.run_experts(hidden_states, topk_weights, topk_ids)

    def moe_warmup_token_counts(self, layer: nn.Module) -> tuple[int, ...]:
        return moe_kernel_token_counts(layer)


UNQUANTIZED = Unquantized()
