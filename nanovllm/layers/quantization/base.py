"""What a quantization method is (QuantizationMethod: one object per scheme) and the registry the schemes are
found in by name (QUANTIZATION_METHODS, register_quantization).

A method object answers everything that depends on how a layer's weights are quantized, so that the linear and
MoE layers, the loader, Config and the model runner never test a scheme's name:

- for Config, at class level: `name` (LLM(quantization=name)), `checkpoint_formats` (the quantization_config
  quant_method values it reads), for_unquantized_checkpoint / for_quantized_checkpoint (the method object for
  a checkpoint), and check_device;
- for the layers, which keep it as `layer.quant_method`: create_weights (the layer's parameters, each with the
  layer's `weight_loader`), process_weights_after_loading (once every checkpoint tensor is in: online
  quantization), apply (the forward), warmup_token_counts (the token counts whose prefill compiles each kernel
  variant the layer can take; the engine runs them at start-up); and the moe_ variants of each for FusedMoE;
- for the modules that produce a quantized layer's input (RMSNorm, SiLU-and-mul), where that layer is its only
  reader: input_quantization (an InputQuantization that writes the input in the form the layer multiplies,
  QuantizedActivations, in the same pass; apply takes either form);
- for the loader: unexpected_tensor (what a checkpoint tensor that no parameter takes is, if some registered
  scheme stores such tensors: refused by name rather than skipped).
"""
from typing import ClassVar, NamedTuple

import torch
from torch import nn

# name -> method class: LLM(quantization=name), and checkpoints through each class's checkpoint_formats
QUANTIZATION_METHODS: dict[str, type["QuantizationMethod"]] = {}


class QuantizedActivations(NamedTuple):
    """A quantized layer's input already in the form its scheme multiplies (FP8: e4m3 values [M, K] and their
    float32 scales), written by the module that produced it; `dtype`: the model's, which the output takes."""
    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


class ScaledOutput(NamedTuple):
    """A quantized GEMM's output whose per-row and per-column scales are still to be applied: the value is
    raw[i, j] * row_scales[i] * col_scales[j] (raw in the model's dtype, the scales float32). A layer returns it
    only where the model said the module reading its output applies them in its own pass
    (`layer.defer_output_scales`: "norm", the residual RMSNorm, layers/layernorm.py; "silu", SiLU-and-mul,
    layers/activation.py):
    the GEMM itself then runs unscaled, which cuBLASLt does faster at decode sizes (FP8: kernels/fp8_gemm.py)."""
    raw: torch.Tensor
    row_scales: torch.Tensor
    col_scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.raw.shape

    def materialize(self) -> torch.Tensor:
        """The value, in the model's dtype."""
        return (self.raw.float() * self.row_scales[:, None] * self.col_scales[None, :]).to(self.raw.dtype)


def reader_input(x: "torch.Tensor | ScaledOutput", kernel_applies, quantization: "InputQuantization | None"):
    """What a reader of a GEMM's output (RMSNorm, SiLU-and-mul) works on: (x, scales, quantization). A
    ScaledOutput gives its raw values and (row, column) scales where `kernel_applies(raw)` (the reader's
    kernel applies them), else its materialized value; `quantization` (the reader's output_quantization)
    comes back None where it does not apply to x."""
    scales = None
    if isinstance(x, ScaledOutput):
        if kernel_applies(x.raw):
            x, scales = x.raw, (x.row_scales, x.col_scales)
        else:
            x = x.materialize()
    if quantization is not None and not quantization.applies(x):
        quantization = None
    return x, scales, quantization


class InputQuantization:
    """How a scheme's layers want their input, for the module whose output a layer alone reads: that module
    calls the fused variant of its pass where one runs (None elsewhere), or quantizes its plain output."""

    def applies(self, x: torch.Tensor) -> bool:
        """Whether the layer reads this input quantized; False: it takes x in the model's dtype as it is."""
        return True

    def quantize(self, x: torch.Tensor) -> QuantizedActivations:
        """x [M, K] in the model's dtype as the layer would quantize it."""
        raise NotImplementedError

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None):
        """RMSNorm (of x + residual) written quantized, as RMSNorm.forward returns it (with the sum as the
        residual when given one), or None where no fused pass runs (then the plain output is quantized).
        scales: x is a ScaledOutput's raw values, these its (row, column) scales."""
        return None

    def silu_and_mul(self, x: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> QuantizedActivations | None:
        """SiLU(x's first half) * its second half, written quantized, or None (as rms_norm; scales: as its)."""
        return None


class QuantizationMethod:
    """One quantization scheme. Subclasses override what their scheme does differently; the defaults here are
    a scheme without post-processing, warm-up, MoE support or checkpoint formats of its own."""
    name: ClassVar[str | None] = None       # LLM(quantization=name); None: the default (unquantized)
    # quantization_config["quant_method"] values this scheme reads -> how messages describe what it supports
    checkpoint_formats: ClassVar[dict[str, str]] = {}

    # ---- resolving (Config) ------------------------------------------------------------------------------------
    @classmethod
    def for_unquantized_checkpoint(cls, hf_config, where: str) -> "QuantizationMethod":
        """LLM(quantization=name) on a checkpoint in the model's dtype (online quantization, if the scheme
        quantizes): the method object. `where` names the config for messages."""
        return cls()

    @classmethod
    def for_quantized_checkpoint(cls, quantization_config: dict, hf_config, where: str,
                                 random_weights: bool) -> "QuantizationMethod":
        """A checkpoint whose quantization_config names one of checkpoint_formats: the method object, or a
        ValueError naming what is not supported. random_weights: load_format="dummy" (weights are drawn in
        the model's dtype, then quantized as the checkpoint's would be)."""
        raise ValueError(f"quantization={cls.name!r} reads no quantized checkpoints")

    def check_device(self, device: str) -> None:
        """A ValueError if the scheme cannot run on `device` ("cuda", "cpu")."""

    @classmethod
    def describe_checkpoint_tensor(cls, checkpoint_name: str) -> str | None:
        """What checkpoint_name is if this scheme's checkpoints hold such tensors beside their weights (the
        loader's refusal of one that the model does not take reads "checkpoint ... has <this>"); else None."""
        return None

    def unexpected_tensor(self, checkpoint_name: str) -> str | None:
        """The loader asks this of a checkpoint tensor that no parameter of the model takes: what it is if any
        registered scheme stores such tensors (another scheme's may be the reason), else None (skipped)."""
        for method_class in QUANTIZATION_METHODS.values():
            what = method_class.describe_checkpoint_tensor(checkpoint_name)
            if what is not None:
                return what
        return None

    # ---- linear layers (LinearBase) -------------------------------------------------------------------------
    def create_weights(self, layer: nn.Module, input_size: int, output_parts: list[int], tp_size: int,
                       input_split: bool) -> None:
        """The layer's parameters for this rank: a `weight` of sum(output_parts) rows and input_size columns
        (output_parts: this rank's share of each merged output, q/k/v or gate/up), and whatever the scheme
        keeps beside it, each with `weight_loader` = layer.weight_loader (or one that calls it). tp_size: the
        ranks the checkpoint's tensors are split over; input_split: along the input (row parallel) rather than
        the output."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once every checkpoint tensor is in (called again, it changes nothing)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T + bias, in x's dtype (x: QuantizedActivations where input_quantization says so)."""
        raise NotImplementedError

    def warmup_token_counts(self, layer: nn.Module) -> tuple[int, ...]:
        """Token counts whose prefill compiles each kernel variant `layer` can take (none: nothing compiles)."""
        return ()

    def input_quantization(self, layer: nn.Module) -> InputQuantization | None:
        """How the module that alone feeds `layer` may write its input quantized (None: in the model's dtype)."""
        return None

    # ---- mixture-of-experts layers (FusedMoE) ------------------------------------------------------------------
    def create_moe_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                           intermediate_size: int) -> None:
        """The stacked experts' parameters for this rank (intermediate_size: its share): `w13_weight`
        [E, 2I, H] (gate rows, then up rows), `w2_weight` [E, H, I], and whatever the scheme keeps beside them
        (named "w13_..." and "w2_...", as the loader maps the checkpoint's per-expert tensors)."""
        raise ValueError(f"quantization={self.name!r} does not support mixture-of-experts layers")

    def process_moe_weights_after_loading(self, layer: nn.Module) -> None:
        """Once every expert is loaded (called again, it changes nothing)."""

    def apply_moe(self, layer: nn.Module, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted outputs [T, H] (this rank's partial sums)."""
        raise NotImplementedError

    def moe_warmup_token_counts(self, layer: nn.Module) -> tuple[int, ...]:
        return ()


def register_quantization(method_class: type[QuantizationMethod]) -> type[QuantizationMethod]:
    """Make method_class.name a value of LLM(quantization=...) and its checkpoint_formats readable (a
    decorator too). A name is registered once."""
    name = method_class.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"{method_class.__name__}.name must be a non-empty string, got {name!r}")
    if QUANTIZATION_METHODS.get(name, method_class) is not method_class:
        raise ValueError(f"quantization {name!r} is already registered ({QUANTIZATION_METHODS[name].__name__})")
    QUANTIZATION_METHODS[name] = method_class
    return method_class


# ---- helpers the schemes share ---------------------------------------------------------------------------------
def stacked_expert_weights(layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                           dtype: torch.dtype | None = None) -> None:
    """`w13_weight` [E, 2I, H] and `w2_weight` [E, H, I] (dtype None: the default, the model's), loaded
    through the layer's weight_loader."""
    layer.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
                                    requires_grad=False)
    layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
                                   requires_grad=False)
    layer.w13_weight.weight_loader = layer.w2_weight.weight_loader = layer.weight_loader


def moe_kernel_token_counts(layer: nn.Module) -> tuple[int, ...]:
    """One token count per compiled variant of the MoE kernels (nanovllm.kernels.fused_moe) for this layer's
    top_k and number of experts."""
    from nanovllm.kernels.fused_moe import config_token_counts
    return config_token_counts(layer.top_k, layer.num_experts)
