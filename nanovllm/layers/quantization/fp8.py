"""FP8 weights (W8A8) for the tensor-parallel linear layers and the MoE experts: LLM(quantization="fp8") and
the FP8 checkpoints (fp8_checkpoints.py says which), their parameters and their arithmetic.

Two schemes, both float8_e4m3fn (largest finite value 448) with float32 scales, as vLLM runs them:
- Fp8BlockMethod: Qwen's and DeepSeek's FP8 releases (quant_method "fp8", weight_block_size [128, 128]). One
  scale per 128x128 block of the weight (`weight_scale_inv`, [ceil(N/128), ceil(K/128)]: the value is q * scale,
  whatever the name says); activations scaled per token and group of 128 columns.
- Fp8ChannelMethod: compressed-tensors' FP8-dynamic, and LLM(quantization="fp8") on a bf16 checkpoint. One
  scale per output row of the weight (`weight_scale`, [N]); activations scaled per token.

Every scale is amax / 448 over the values it covers (amax at least MIN_AMAX), and each value is stored as
x / scale (IEEE division), clamped to [-448, 448] and rounded to the nearest e4m3 value (ties to even). A
layer computes, for input rows x [M, K] and a weight of e4m3 values q_w [N, K]:

    y[m, n] = sum_k (q_x[m, k] * s_x[m, k // 128 or 0]) * (q_w[n, k] * s_w[n // 128, k // 128 or n])

in float32, then rounds y to the model's dtype and adds the bias. The CPU path here computes exactly that
(both operands dequantized to float32, one float32 matmul); the GPU kernels (nanovllm.kernels.fp8_gemm)
quantize the activations to the same values, multiply e4m3 values on tensor cores with float32 accumulation
and apply the scales in the epilogue, so the two agree to float32 rounding of the sums. MoE experts hold
e4m3 values with the same scales per expert (the checkpoint's per-expert scales stacked as the weights are:
w13's gate blocks, then its up blocks), and each expert computes what an FP8 linear layer computes.

Online quantization (quantization="fp8" on a bf16 checkpoint, and load_format="dummy"): a layer holds its
weight in the model's dtype while the checkpoint loads (every shard where an unquantized layer puts it), and
process_weights_after_loading turns the whole local weight into e4m3 values and scales once every shard is in.
"""
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from torch import nn

from nanovllm.kernels import fp8_activations, fp8_gemm
from nanovllm.layers.quantization import fp8_checkpoints
from nanovllm.layers.quantization.base import (InputQuantization, QuantizationMethod, QuantizedActivations,
                                               ScaledOutput, moe_kernel_token_counts, stacked_expert_weights)
from nanovllm.layers.quantization.fp8_checkpoints import BLOCK

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12    # an all-zero row or group: a tiny scale (its values quantize to 0), never 0/0


# ---- the arithmetic (torch: the CPU path and the kernels' oracle); scheme "block" or "channel" ---------------------
def amax_to_scale(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.float().clamp(min=MIN_AMAX)
    # divided by a tensor: CUDA turns a division by a Python number into a product with its rounded
    # reciprocal, which is a bit off the IEEE quotient the kernels compute (and the CPU computes)
    return amax / torch.full_like(amax, FP8_MAX)


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 x / scale (broadcast), clamped to +-448 and rounded to e4m3 (nearest, ties to even)."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] as [..., ceil(K/group), group], zero-padded (zeros never raise an amax)."""
    pad = -x.shape[-1] % group
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.unflatten(-1, (-1, group))


def quantize_activations(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M] (per token) or [M, ceil(K/group)] (per group))."""
    x = x.float()
    if group is None:
        scale = amax_to_scale(x.abs().amax(-1))
        return to_e4m3(x, scale[:, None]), scale
    groups = _grouped(x, group)
    scale = amax_to_scale(groups.abs().amax(-1))
    return to_e4m3(groups, scale[..., None]).flatten(-2)[:, :x.shape[1]], scale


def quantize_weight(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], float32 scales [N] ("channel") or [ceil(N/128), ceil(K/128)] ("block"))."""
    if scheme == "channel":
        return quantize_activations(weight, None)       # a row's scale: the same rule as a token's
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -k % BLOCK, 0, -n % BLOCK))
    blocks = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    scale = amax_to_scale(blocks.abs().amax((1, 3)))                    # [N/128, K/128]
    q = to_e4m3(blocks, scale[:, None, :, None]).view(padded.shape)
    return q[:n, :k].contiguous(), scale


def quantize_experts(weights: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e4m3 [E, N, K], scales [E, N] or [E, ceil(N/128), ceil(K/128)]), expert by expert."""
    if scheme == "channel":
        values, scales = quantize_weight(weights.reshape(-1, weights.shape[-1]), "channel")
        return values.view(weights.shape), scales.view(weights.shape[:2])
    values, scales = zip(*(quantize_weight(w, "block") for w in weights))
    return torch.stack(values), torch.stack(scales)


def _expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Per-block scales [ceil(rows/128), ceil(cols/128)] as one per element [rows, cols]."""
    return scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """e4m3 values times their scales, float32 [N, K]."""
    if scheme == "channel":
        return weight.float() * scale.float()[:, None]
    return weight.float() * _expand(scale.float(), *weight.shape)


def fp8_linear_torch(x: torch.Tensor | QuantizedActivations, weight: torch.Tensor, weight_scale: torch.Tensor,
                     scheme: str) -> torch.Tensor:
    """The CPU path: x [..., K] quantized as the scheme says (or already, as QuantizedActivations [M, K]),
    dequantized, times the dequantized weight in float32, rounded to x's dtype (the module docstring's
    arithmetic)."""
    if isinstance(x, QuantizedActivations):
        (q, scale, dtype), shape = x, x.values.shape
    else:
        shape, dtype = x.shape, x.dtype
        q, scale = quantize_activations(x.reshape(-1, x.shape[-1]), BLOCK if scheme == "block" else None)
    if scheme == "block":
        a = q.float() * scale.repeat_interleave(BLOCK, 1)[:, :q.shape[1]]
    else:
        a = q.float() * scale[:, None]
    y = a @ dequantize_weight(weight, weight_scale, scheme).t()
    return y.to(dtype).view(*shape[:-1], weight.shape[0])


@dataclass(frozen=True)
class Fp8Input(InputQuantization):
    """An FP8 layer's input: e4m3 values with float32 scales per token (group_size None) or per token and group
    of 128 columns. On a GPU, RMSNorm and SiLU-and-mul write it themselves (nanovllm.kernels.fp8_activations:
    one launch and one pass over the rows fewer per projection); elsewhere their output is quantized."""
    group_size: int | None

    def applies(self, x: torch.Tensor) -> bool:
        return not (x.is_cuda and fp8_gemm.reads_unquantized(x.numel() // x.shape[-1], self.group_size is not None))

    def quantize(self, x: torch.Tensor) -> QuantizedActivations:
        quantize = fp8_gemm.quantize_activations if x.is_cuda else quantize_activations
        return QuantizedActivations(*quantize(x, self.group_size), x.dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None):
        if not (x.is_cuda and x.dim() == 2 and weight.dtype == x.dtype):
            return None
        q, scale, *summed = fp8_activations.rms_norm_quant(x, weight, eps, residual, self.group_size, scales)
        out = QuantizedActivations(q, scale, x.dtype)
        return (out, *summed) if summed else out

    def silu_and_mul(self, x: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> QuantizedActivations | None:
        if not (x.is_cuda and x.dim() == 2):
            return None
        return QuantizedActivations(*fp8_activations.silu_and_mul_quant(x, self.group_size, scales), x.dtype)


# ---- the methods --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fp8Method(QuantizationMethod):
    """FP8 weights, e4m3 values with float32 scales; a subclass per scheme (how the scales are laid out).
    `online`: the weights load in the model's dtype and are quantized once loaded."""
    online: bool = False

    name: ClassVar[str] = "fp8"
    checkpoint_formats: ClassVar[dict[str, str]] = fp8_checkpoints.FORMATS
    scheme: ClassVar[str]               # the arithmetic's name for it: "block" or "channel"
    scale_name: ClassVar[str]           # the checkpoint's name for the weight's scales
    shard_unit: ClassVar[int]           # weight rows (columns) one scale entry covers when shards are split

    @classmethod
    def for_unquantized_checkpoint(cls, hf_config, where: str) -> "Fp8Method":
        return Fp8ChannelMethod(online=True)

    @classmethod
    def for_quantized_checkpoint(cls, quantization_config: dict, hf_config, where: str,
                                 random_weights: bool) -> "Fp8Method":
        # random weights are drawn in the model's dtype and quantized by the checkpoint's scheme
        if quantization_config.get("quant_method") == "fp8":
            fp8_checkpoints.checked_block_fp8(quantization_config, hf_config, where)
            return Fp8BlockMethod(online=random_weights)
        fp8_checkpoints.checked_fp8_dynamic(quantization_config, hf_config, where)
        return Fp8ChannelMethod(online=random_weights)

    def check_device(self, device: str) -> None:
        if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
            raise ValueError(f"FP8 weights need a GPU of compute capability 8.9 or newer (Ada, Hopper); this one "
                             f"is {'.'.join(map(str, torch.cuda.get_device_capability()))}")

    @classmethod
    def describe_checkpoint_tensor(cls, checkpoint_name: str) -> str | None:
        if checkpoint_name.endswith(".input_scale"):
            return (f"static activation scales ({checkpoint_name}); only dynamic activation scaling is "
                    f"supported")
        if checkpoint_name.endswith((".weight_scale", ".weight_scale_inv")):
            return (f"FP8 weight scales ({checkpoint_name}) that the model does not expect: its config.json lacks "
                    f"the quantization_config that describes them (or names a different scheme)")
        return None

    # ---- what the schemes do differently
    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """The scales of a weight [rows, cols]."""
        raise NotImplementedError

    def check_shards(self, layer: nn.Module, output_parts: list[int], input_size: int, tp_size: int,
                     input_split: bool) -> None:
        """A ValueError if this rank's shards cannot carry their own scales."""

    def check_expert_shards(self, layer: nn.Module, intermediate_size: int) -> None:
        """The same for experts split over the tensor-parallel ranks."""

    def _scale_parameter(self, scale: torch.Tensor, weight_loader) -> nn.Parameter:
        param = nn.Parameter(scale, requires_grad=False)
        if self.shard_unit != 1:
            param.shard_unit = self.shard_unit     # the layers' shard copies count whole scale entries
        param.weight_loader = weight_loader
        return param

    # ---- linear layers
    def create_weights(self, layer: nn.Module, input_size: int, output_parts: list[int], tp_size: int,
                       input_split: bool) -> None:
        """The layer's `weight` (e4m3 [N, K]; in the model's dtype until loaded if online) and its scales."""
        self.check_shards(layer, output_parts, input_size, tp_size, input_split)
        output_size = sum(output_parts)
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=None if self.online else FP8),
                                    requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        if not self.online:
            self._register_linear_scale(layer, torch.empty(self.scale_shape(output_size, input_size),
                                                            dtype=torch.float32))

    def _register_linear_scale(self, layer: nn.Module, scale: torch.Tensor) -> None:
        def load_scale(param: nn.Parameter, loaded: torch.Tensor, *shard) -> None:
            # compressed-tensors stores per-channel scales as [N, 1], often in bf16: ours are float32 [N]
            if param.dim() == 1 and loaded.dim() == 2 and loaded.shape[1] == 1:
                loaded = loaded.reshape(-1)
            layer.weight_loader(param, loaded.float(), *shard)
        layer.register_parameter(self.scale_name, self._scale_parameter(scale, load_scale))

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Online quantization: the loaded weight (model dtype) -> e4m3 values and scales, once."""
        if layer.defer_output_scales and layer.weight.is_cuda:
            fp8_gemm.unit_scale(layer.weight.device)        # before any CUDA graph is captured
        if not self.online or layer.weight.dtype == FP8:
            return
        q, scale = quantize_weight(layer.weight.data, self.scheme)
        layer.weight = nn.Parameter(q, requires_grad=False)
        self._register_linear_scale(layer, scale)

    def apply(self, layer: nn.Module, x: torch.Tensor | QuantizedActivations,
              bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T (+ bias, added in x's dtype after the GEMM); x in the model's dtype, or already quantized."""
        scale = getattr(layer, self.scale_name)
        block_scaled = self.scheme == "block"
        if bias is None and not block_scaled and layer.defer_output_scales:
            deferred = self._unscaled(layer.weight, scale, x, layer.defer_output_scales)
            if deferred is not None:
                return deferred
        if isinstance(x, QuantizedActivations) and x.values.is_cuda:
            y = fp8_gemm.fp8_matmul(x.values, x.scales, layer.weight, scale, block_scaled, x.dtype)
        elif not isinstance(x, QuantizedActivations) and x.is_cuda:
            y = fp8_gemm.fp8_linear(x, layer.weight, scale, block_scaled)
        else:
            y = fp8_linear_torch(x, layer.weight, scale, self.scheme)
        return y if bias is None else y + bias

    @staticmethod
    def _unscaled(weight: torch.Tensor, scale: torch.Tensor, x: torch.Tensor | QuantizedActivations,
                  reader: str) -> ScaledOutput | None:
        """The GEMM without its scales, for a reader that applies them (ScaledOutput), where that is faster
        (fp8_gemm.defers_output_scales); else None."""
        values = x.values if isinstance(x, QuantizedActivations) else x
        dtype = x.dtype
        if values.dim() != 2 or not fp8_gemm.defers_output_scales(values.shape[0], weight.shape[0], values.shape[1],
                                                                  dtype, values.device, reader):
            return None
        if not isinstance(x, QuantizedActivations):
            x = Fp8Input(None).quantize(x)
        return ScaledOutput(fp8_gemm.unscaled_matmul(x.values, weight, dtype), x.scales, scale)

    def input_quantization(self, layer: nn.Module) -> Fp8Input:
        return Fp8Input(BLOCK if self.scheme == "block" else None)

    def warmup_token_counts(self, layer: nn.Module) -> tuple[int, ...]:
        """One token count per compiled tile config of the FP8 GEMM."""
        return fp8_gemm.config_token_counts()

    # ---- mixture-of-experts layers
    def create_moe_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                           intermediate_size: int) -> None:
        """e4m3 experts (in the model's dtype until loaded if online) and their scales: w13's [E, gate's, then
        up's] and w2's, each as the checkpoint stores one expert's projection's."""
        self.check_expert_shards(layer, intermediate_size)
        stacked_expert_weights(layer, num_experts, hidden_size, intermediate_size, None if self.online else FP8)
        if self.online:
            return
        gate_rows, *gate_cols = self.scale_shape(intermediate_size, hidden_size)
        for name, shape in (("w13", (num_experts, 2 * gate_rows, *gate_cols)),
                            ("w2", (num_experts, *self.scale_shape(hidden_size, intermediate_size)))):
            self._register_expert_scale(layer, name, torch.empty(shape, dtype=torch.float32))

    def _register_expert_scale(self, layer: nn.Module, name: str, scale: torch.Tensor) -> None:
        layer.register_parameter(f"{name}_{self.scale_name}", self._scale_parameter(scale, layer.weight_loader))

    def process_moe_weights_after_loading(self, layer: nn.Module) -> None:
        """Online quantization, once every expert is loaded: each expert's projections as a linear layer's
        (block scales of gate and up separately, as a checkpoint stores them)."""
        if not self.online or layer.w13_weight.dtype == FP8:
            return
        inter_size = layer.intermediate_size
        for name in ("w13", "w2"):
            weight = getattr(layer, f"{name}_weight").data
            parts = (weight[:, :inter_size], weight[:, inter_size:]) if name == "w13" else (weight,)
            values, scales = zip(*(quantize_experts(part, self.scheme) for part in parts))
            setattr(layer, f"{name}_weight", nn.Parameter(torch.cat(values, 1), requires_grad=False))
            self._register_expert_scale(layer, name, torch.cat(scales, 1))

    def apply_moe(self, layer: nn.Module, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        return layer.run_experts(hidden_states, topk_weights, topk_ids, getattr(layer, f"w13_{self.scale_name}"),
                                 getattr(layer, f"w2_{self.scale_name}"),
                                 scaled_linear=partial(fp8_linear_torch, scheme=self.scheme))

    def moe_warmup_token_counts(self, layer: nn.Module) -> tuple[int, ...]:
        return moe_kernel_token_counts(layer)


@dataclass(frozen=True)
class Fp8BlockMethod(Fp8Method):
    """128x128 weight blocks (`weight_scale_inv`), activations per token and 1x128 group. Block scales are
    split with their weights, so every shard must start on a block."""
    scheme: ClassVar[str] = "block"
    scale_name: ClassVar[str] = "weight_scale_inv"
    shard_unit: ClassVar[int] = BLOCK       # each scale entry covers 128 weight rows and 128 columns

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        return -(-rows // BLOCK), -(-cols // BLOCK)

    def check_shards(self, layer: nn.Module, output_parts: list[int], input_size: int, tp_size: int,
                     input_split: bool) -> None:
        """Each output part but the last a multiple of 128 rows, every part (column parallel) or the input (row
        parallel) too when the checkpoint's tensors are split over several ranks."""
        split_rows = tp_size > 1 and not input_split
        ragged_rows = [p for p in (output_parts if split_rows else output_parts[:-1]) if p % BLOCK]
        if ragged_rows or (input_split and tp_size > 1 and input_size % BLOCK):
            what = f"output rows {output_parts}" if ragged_rows else f"input columns ({input_size})"
            raise ValueError(f"block-FP8 weights are split with their 128x128 scale blocks, so every shard must "
                             f"start on a block boundary: this {type(layer).__name__}'s {what} per rank "
                             f"(tensor_parallel_size={tp_size}) are not all multiples of 128")

    def check_expert_shards(self, layer: nn.Module, intermediate_size: int) -> None:
        if layer.tp.size > 1 and intermediate_size % BLOCK:
            raise ValueError(f"block-FP8 experts are split with their 128x128 scale blocks: the experts' "
                             f"intermediate size per rank ({intermediate_size}, tensor_parallel_size="
                             f"{layer.tp.size}) must be a multiple of {BLOCK}")


@dataclass(frozen=True)
class Fp8ChannelMethod(Fp8Method):
    """One scale per output row (`weight_scale`), activations per token."""
    scheme: ClassVar[str] = "channel"
    scale_name: ClassVar[str] = "weight_scale"
    shard_unit: ClassVar[int] = 1

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        return (rows,)
