"""FP8 weights for the tensor-parallel linear layers (W8A8): which scheme a checkpoint or
LLM(quantization="fp8") asks for, the parameters a quantized layer holds, and its arithmetic.

Two schemes, both float8_e4m3fn (largest finite value 448) with float32 scales, as vLLM runs them:
- "block": Qwen's and DeepSeek's FP8 releases (quant_method "fp8", weight_block_size [128, 128]). One scale
  per 128x128 block of the weight (`weight_scale_inv`, [ceil(N/128), ceil(K/128)]: the value is q * scale,
  whatever the name says); activations scaled per token and group of 128 columns.
- "channel": compressed-tensors' FP8-dynamic, and LLM(quantization="fp8") on a bf16 checkpoint. One scale per
  output row of the weight (`weight_scale`, [N]); activations scaled per token.

Every scale is amax / 448 over the values it covers (amax at least MIN_AMAX), and each value is stored as
x / scale (IEEE division), clamped to [-448, 448] and rounded to the nearest e4m3 value (ties to even). A
layer computes, for input rows x [M, K] and a weight of e4m3 values q_w [N, K]:

    y[m, n] = sum_k (q_x[m, k] * s_x[m, k // 128 or 0]) * (q_w[n, k] * s_w[n // 128, k // 128 or n])

in float32, then rounds y to the model's dtype and adds the bias. The CPU path here computes exactly that
(both operands dequantized to float32, one float32 matmul); the GPU kernels (nanovllm.kernels.fp8_gemm)
quantize the activations to the same values, multiply e4m3 values on tensor cores with float32 accumulation
and apply the scales in the epilogue, so the two agree to float32 rounding of the sums.

Online quantization (quantization="fp8" on a bf16 checkpoint, and load_format="dummy"): a layer holds its
weight in the model's dtype while the checkpoint loads (every shard where an unquantized layer puts it), and
`quantize_after_loading` turns the whole local weight into e4m3 values and scales once every shard is in.

The model runner builds the model inside `building_with_quantization(config.weight_quantization)`; the linear
layers read it as they are constructed (as they read their tensor-parallel group), so nothing else carries it.
"""
import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.kernels import fp8_gemm

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12    # an all-zero row or group: a tiny scale (its values quantize to 0), never 0/0
BLOCK = 128         # the block scheme's weight blocks are BLOCK x BLOCK, its activation groups 1 x BLOCK
SUPPORTED = ("fp8 (e4m3, weight_block_size [128, 128], dynamic activations) and compressed-tensors "
             "FP8-dynamic (per-channel weights, per-token dynamic activations)")
# the decoder's linear layers as checkpoints name them (Llama, Qwen2, Qwen3): what ignore lists are checked against
CHECKPOINT_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class WeightQuantization:
    """How the linear layers' weights are quantized: `scheme` "block" (128x128 weight blocks, 1x128
    activation groups) or "channel" (per output row, per-token activations); `online`: the weights load in
    the model's dtype and are quantized once loaded."""
    scheme: str
    online: bool = False

    @property
    def activation_group(self) -> int | None:
        return BLOCK if self.scheme == "block" else None

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.scheme == "block" else "weight_scale"


# ---- resolving the settings (Config) -------------------------------------------------------------------------
def resolve_weight_quantization(hf_config, requested: str | None, where: str,
                                load_format: str = "auto") -> WeightQuantization | None:
    """The scheme the checkpoint's quantization_config (if any) and LLM(quantization=...) ask for, or None
    for unquantized weights; ValueError for anything else, naming it. `where`: the config's path, for
    messages."""
    if requested is not None and requested != "fp8":
        raise ValueError(f"quantization must be None or 'fp8', got {requested!r}")
    config = getattr(hf_config, "quantization_config", None)
    if config is not None and not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    if not config:
        return WeightQuantization("channel", online=True) if requested == "fp8" else None
    method = config.get("quant_method")
    if method == "fp8":
        _check_block_fp8(config, where)
        scheme, exempt = "block", (config.get("modules_to_not_convert") or []) + (config.get("ignored_layers") or [])
    elif method == "compressed-tensors":
        _check_fp8_dynamic(config, where)
        scheme, exempt = "channel", config.get("ignore") or []
    else:
        raise ValueError(f"quantization method {method!r} in {where} is not supported; supported: {SUPPORTED}")
    _check_exemptions(exempt, hf_config, where)
    # random weights are drawn in the model's dtype and quantized by the checkpoint's scheme
    return WeightQuantization(scheme, online=load_format == "dummy")


def _check_block_fp8(config: dict, where: str) -> None:
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 format {fmt!r} in {where} is not supported; supported: e4m3")
    activations = config.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        raise ValueError(f"fp8 activation_scheme {activations!r} (static activation scales) in {where} is not "
                         f"supported; supported: dynamic")
    block = config.get("weight_block_size")
    if block is None:
        raise ValueError(f"fp8 without weight_block_size (one scale per tensor) in {where} is not supported; "
                         f"supported: weight_block_size [128, 128]")
    if list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"fp8 weight_block_size {list(block)} in {where} is not supported; supported: [128, 128]")


def _check_fp8_dynamic(config: dict, where: str) -> None:
    """compressed-tensors: one config group, FP8 weights per channel and FP8 activations per token, dynamic."""
    def refuse(what: str):
        raise ValueError(f"compressed-tensors {what} in {where} is not supported; supported: FP8-dynamic (weights "
                         f"num_bits 8, type float, strategy channel, symmetric; input_activations num_bits 8, type "
                         f"float, strategy token, dynamic)")
    if config.get("format", "float-quantized") != "float-quantized":
        refuse(f"format {config.get('format')!r}")
    if config.get("kv_cache_scheme"):
        refuse("kv_cache_scheme (use kv_cache_dtype='fp8' for an fp8 KV cache)")
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        refuse(f"with {len(groups)} config groups")
    group = next(iter(groups.values()))
    weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
    if set(group.get("targets") or []) != {"Linear"}:
        refuse(f"targets {group.get('targets')!r}")
    if group.get("output_activations"):
        refuse("output_activations")
    for name, scheme, strategy, dynamic in (("weights", weights, "channel", False),
                                            ("input_activations", inputs, "token", True)):
        wanted = dict(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=dynamic)
        found = {key: scheme.get(key, True if key == "symmetric" else None) for key in wanted}
        if found["dynamic"] is None and not dynamic:
            found["dynamic"] = False
        if found != wanted or scheme.get("group_size") or scheme.get("block_structure"):
            refuse(f"{name} {found}")


def _check_exemptions(entries: list[str], hf_config, where: str) -> None:
    """Layers a checkpoint leaves unquantized: the embeddings and the LM head (never quantized here) are fine;
    an attention or MLP projection is refused (every one of them is quantized here). Entries are module names
    ("lm_head"), name fragments, or compressed-tensors' "re:" regular expressions."""
    for entry in entries:
        pattern = entry[3:] if entry.startswith("re:") else None
        for i in range(hf_config.num_hidden_layers):
            for linear in CHECKPOINT_LINEARS:
                name = f"model.layers.{i}.{linear}"
                if (re.match(pattern, name) if pattern is not None else entry == name or name.endswith(f".{entry}")
                        or f".{entry}." in f".{name}."):
                    raise ValueError(f"{where}'s quantization_config leaves {name} unquantized ({entry!r}); "
                                     f"per-layer exceptions are not supported (only the embeddings and the LM "
                                     f"head stay unquantized)")


# ---- the build context ---------------------------------------------------------------------------------------
_building: list[WeightQuantization | None] = []   # only non-empty while a model is being constructed


@contextmanager
def building_with_quantization(quantization: WeightQuantization | None):
    """The linear layers constructed inside take their weights' quantization from here."""
    _building.append(quantization)
    try:
        yield quantization
    finally:
        _building.pop()


def current_quantization() -> WeightQuantization | None:
    return _building[-1] if _building else None


# ---- the arithmetic (torch: the CPU path and the kernels' oracle) ------------------------------------------------
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


def _expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Per-block scales [ceil(rows/128), ceil(cols/128)] as one per element [rows, cols]."""
    return scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """e4m3 values times their scales, float32 [N, K]."""
    if scheme == "channel":
        return weight.float() * scale.float()[:, None]
    return weight.float() * _expand(scale.float(), *weight.shape)


def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """The CPU path: x [..., K] quantized as the scheme says, dequantized, times the dequantized weight in
    float32, rounded to x's dtype (the module docstring's arithmetic)."""
    shape, rows = x.shape, x.reshape(-1, x.shape[-1])
    q, scale = quantize_activations(rows, BLOCK if scheme == "block" else None)
    if scheme == "block":
        a = q.float() * scale.repeat_interleave(BLOCK, 1)[:, :rows.shape[1]]
    else:
        a = q.float() * scale[:, None]
    y = a @ dequantize_weight(weight, weight_scale, scheme).t()
    return y.to(x.dtype).view(*shape[:-1], weight.shape[0])


# ---- a quantized linear layer's parameters and forward ----------------------------------------------------------
def create_fp8_weights(layer: nn.Module, quantization: WeightQuantization, output_parts: list[int],
                       input_size: int, tp_size: int, input_split: bool) -> None:
    """The layer's `weight` (e4m3 [N, K]; in the model's dtype until loaded if online) and its scales, for
    this rank's output parts (a merged layer's q/k/v or gate/up, each this rank's share) and input_size
    columns. Block scales are split with their weights, so every shard must start on a block: each part but
    the last a multiple of 128 rows, every part (column parallel) or the input (row parallel) too when the
    checkpoint's tensors are split over several ranks."""
    output_size = sum(output_parts)
    if quantization.scheme == "block":
        split_rows = tp_size > 1 and not input_split
        ragged_rows = [p for p in (output_parts if split_rows else output_parts[:-1]) if p % BLOCK]
        if ragged_rows or (input_split and tp_size > 1 and input_size % BLOCK):
            what = f"output rows {output_parts}" if ragged_rows else f"input columns ({input_size})"
            raise ValueError(f"block-FP8 weights are split with their 128x128 scale blocks, so every shard must "
                             f"start on a block boundary: this {type(layer).__name__}'s {what} per rank "
                             f"(tensor_parallel_size={tp_size}) are not all multiples of 128")
    if quantization.online:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        return
    layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8), requires_grad=False)
    layer.weight.weight_loader = layer.weight_loader
    if quantization.scheme == "block":
        scale = torch.empty(-(-output_size // BLOCK), -(-input_size // BLOCK), dtype=torch.float32)
    else:
        scale = torch.empty(output_size, dtype=torch.float32)
    _register_scale(layer, quantization, scale)


def _register_scale(layer: nn.Module, quantization: WeightQuantization, scale: torch.Tensor) -> None:
    param = nn.Parameter(scale, requires_grad=False)
    if quantization.scheme == "block":
        param.shard_unit = BLOCK        # each entry covers 128 weight rows and 128 columns (linear._copy_shard)

    def load_scale(param: nn.Parameter, loaded: torch.Tensor, *shard) -> None:
        # compressed-tensors stores per-channel scales as [N, 1], often in bf16: ours are float32 [N]
        if param.dim() == 1 and loaded.dim() == 2 and loaded.shape[1] == 1:
            loaded = loaded.reshape(-1)
        layer.weight_loader(param, loaded.float(), *shard)
    param.weight_loader = load_scale
    layer.register_parameter(quantization.scale_name, param)


@torch.no_grad()
def quantize_after_loading(layer: nn.Module, quantization: WeightQuantization) -> None:
    """Online quantization: the loaded weight (model dtype) -> e4m3 values and scales, once."""
    if not quantization.online or layer.weight.dtype == FP8:
        return
    q, scale = quantize_weight(layer.weight.data, quantization.scheme)
    layer.weight = nn.Parameter(q, requires_grad=False)
    _register_scale(layer, quantization, scale)


def fp8_linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The quantized layer's x @ W^T (+ bias, added in x's dtype after the GEMM)."""
    scheme = layer.quantization.scheme
    scale = getattr(layer, layer.quantization.scale_name)
    if x.is_cuda:
        y = fp8_gemm.fp8_linear(x, layer.weight, scale, block_scaled=scheme == "block")
    else:
        y = fp8_linear_torch(x, layer.weight, scale, scheme)
    return y if bias is None else y + bias


def fp8_warmup_token_counts(model: nn.Module) -> tuple[int, ...]:
    """One token count per compiled tile config of the FP8 GEMM, for a model with FP8 linear layers (else
    none): the engine runs each at start-up, so that no request pays for a compilation."""
    if not any(getattr(m, "quantization", None) is not None for m in model.modules()):
        return ()
    return fp8_gemm.config_token_counts()
