"""A mixture-of-experts MLP: a router picks each token's top-k experts, each a SwiGLU MLP, and the token's
output is their outputs weighted by the router's probabilities.

The experts' weights are stacked, [experts, 2 x intermediate, hidden] for gate and up (one matmul, as
the dense MLP's gate_up_proj) and [experts, hidden, intermediate] for down. Tensor parallel splits each
expert's intermediate dimension over the ranks, as a dense MLP's, and sums the partial outputs with one
all-reduce; the router is replicated. On a GPU the Triton kernels in nanovllm.kernels.moe_routing and
nanovllm.kernels.fused_moe do the routing and the grouped GEMMs; the torch functions here are the CPU path
and the kernels' oracle.

The experts hold, load and run their weights through the quantization method the model was built under
(layers/quantization: `quant_method`, the model's dtype by default): FP8 experts are e4m3 with float32 scales,
per output row or per 128x128 block, stacked as the weights are. The router stays in the model's dtype.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.layers.quantization import current_quant_method
from nanovllm.distributed.group import current_group

FP8 = torch.float8_e4m3fn


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts by softmax probability (in float32, largest first), and their
    probabilities (renormalized to sum to one if asked): (weights float32 [T, k], ids int64 [T, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              scaled_linear=None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden_states[t]) for hidden_states [T, H],
    w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]; FP8 experts with their scales as
    nanovllm.kernels.fused_moe.fused_moe takes them, each projection through scaled_linear(x, weight, scale)
    (its quantization method's arithmetic: x @ weight^T rounded to x's dtype).

    The roundings are the dense MLP's: the gate/up product and the activation are rounded to the input
    dtype, as is each expert's output and its weighted value; the k weighted outputs are summed in
    float32 and rounded once."""
    num_tokens, top_k = topk_ids.shape
    dtype = hidden_states.dtype
    inter_size = w13.shape[1] // 2
    # the gate's scales, then the up's: per row [E, 2I], or per block [E, 2 x row blocks, column blocks]
    up_scales = None if w13_scale is None else w13_scale.shape[1] // 2
    if w13_scale is not None and scaled_linear is None:
        raise ValueError("experts with weight scales need the scaled_linear that multiplies by them")
    # each (token, j) pair's weighted expert output in its own row: no index_add_ (slow on busy CPU threads)
    pair_out = torch.zeros(num_tokens * top_k, hidden_states.shape[1], dtype=torch.float32,
                           device=hidden_states.device)
    flat_ids = topk_ids.reshape(-1)
    for expert in flat_ids.unique().tolist():
        pairs = (flat_ids == expert).nonzero().squeeze(1)
        x = hidden_states[pairs // top_k]
        if w13_scale is None:
            gate, up = F.linear(x, w13[expert]).chunk(2, dim=-1)
        else:
            gate = scaled_linear(x, w13[expert, :inter_size], w13_scale[expert, :up_scales])
            up = scaled_linear(x, w13[expert, inter_size:], w13_scale[expert, up_scales:])
        act = (F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)
        y = F.linear(act, w2[expert]) if w2_scale is None else scaled_linear(act, w2[expert], w2_scale[expert])
        pair_out[pairs] = (y.float() * topk_weights.reshape(-1)[pairs, None]).to(dtype).float()
    return pair_out.view(num_tokens, top_k, -1).sum(1).to(dtype)


class FusedMoE(nn.Module):
    """The experts of one MoE layer, stacked; forward(hidden_states, router_logits) -> the layer's output
    (all-reduced over the tensor-parallel group)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool):
        super().__init__()
        self.tp = current_group()
        if intermediate_size % self.tp.size:
            raise ValueError(f"tensor_parallel_size={self.tp.size} does not divide the experts' "
                             f"intermediate size {intermediate_size}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size // self.tp.size     # this rank's share
        self.quant_method = current_quant_method()
        self.quant_method.create_moe_weights(self, num_experts, hidden_size, self.intermediate_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, expert: int | None,
                      shard: str) -> None:
        """Copy this rank's slice of one checkpoint tensor (a weight or its FP8 scales): shard "gate", "up"
        or "down" of `expert`, or (expert None) the same shard of every expert at once ([E, ...],
        transformers' fused layout)."""
        target = param.data if expert is None else param.data[expert]
        if loaded_weight.dim() == target.dim() + 1 and loaded_weight.shape[-1] == 1:
            loaded_weight = loaded_weight.squeeze(-1)       # compressed-tensors' per-row scales: [N, 1]
        matrix = param.dim() == 3           # weights and block scales; per-row scales are [E, rows]
        size = -(-self.intermediate_size // getattr(param, "shard_unit", 1))
        source = loaded_weight
        if shard in ("gate", "up"):
            target = target.narrow(-2 if matrix else -1, 0 if shard == "gate" else size, size)
            source = loaded_weight.narrow(-2 if matrix else -1, self.tp.rank * size, size)
        elif matrix:                        # down's input columns are split; its per-row scales are whole
            source = loaded_weight.narrow(-1, self.tp.rank * size, size)
        if target.shape != source.shape:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit the "
                             f"experts' {shard} part {tuple(target.shape)}")
        if (source.dtype == FP8) != (target.dtype == FP8):
            raise ValueError(f"checkpoint tensor of dtype {source.dtype} for experts built with {target.dtype} "
                             f"weights: the checkpoint's quantization_config does not describe its experts")
        target.copy_(source)

    def process_weights_after_loading(self) -> None:
        """Once every expert is loaded: the quantization method finishes the experts (online quantization)."""
        self.quant_method.process_moe_weights_after_loading(self)

    def warmup_token_counts(self) -> tuple[int, ...]:
        """One token count per compiled variant of the MoE kernels this layer takes."""
        return self.quant_method.moe_warmup_token_counts(self)

    def run_experts(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                    scaled_linear=None) -> torch.Tensor:
        """The routed tokens through the stacked experts as the weights are stored (FP8 with their scales): the
        Triton kernels on a GPU, the torch path elsewhere (scaled projections through scaled_linear)."""
        if hidden_states.is_cuda:
            from nanovllm.kernels import fused_moe as kernels
            return kernels.fused_moe(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                     w13_scale=w13_scale, w2_scale=w2_scale)
        return fused_moe(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids, w13_scale, w2_scale,
                         scaled_linear)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if hidden_states.is_cuda:
            from nanovllm.kernels import moe_routing
            topk_weights, topk_ids = moe_routing.route(router_logits, self.top_k, self.renormalize)
        else:
            topk_weights, topk_ids = route(router_logits, self.top_k, self.renormalize)
        out = self.quant_method.apply_moe(self, hidden_states, topk_weights, topk_ids)
        return self.tp.all_reduce(out)


class SparseMoeBlock(nn.Module):
    """A decoder layer's feed-forward block as a mixture of experts: the router (`gate`, replicated on
    every rank) scores the experts, `experts` runs each token's top-k."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))

