"""Quantization as method objects: one QuantizationMethod per scheme (base.py says what a method answers),
found by name in a registry; Unquantized (the model's dtype) is the default.

- Config resolves the method once (resolve_quantization): the checkpoint's quantization_config (if any), read
  by the registered method whose checkpoint_formats name its quant_method, or LLM(quantization=name).
- The model runner builds the model inside building_with_quantization(method); the linear and MoE layers
  read it as they are constructed (as they read their tensor-parallel group), keep it as `quant_method`, and
  ask it to create, finish and run their weights; warmup_token_counts(model) collects the token counts their
  kernels need warmed up.

A scheme is a module here (fp8.py) and one register_quantization line below.
"""
from contextlib import contextmanager

from torch import nn

from nanovllm.layers.quantization.base import QUANTIZATION_METHODS, QuantizationMethod, register_quantization
from nanovllm.layers.quantization.fp8 import Fp8Method
from nanovllm.layers.quantization.unquantized import UNQUANTIZED, Unquantized

__all__ = ["QUANTIZATION_METHODS", "QuantizationMethod", "Unquantized", "UNQUANTIZED", "building_with_quantization",
           "current_quant_method", "register_quantization", "resolve_quantization", "warmup_token_counts"]

# ---- the registry: LLM(quantization=name) and the checkpoints each method reads ------------------------------
register_quantization(Fp8Method)


def _choices() -> str:
    names = [repr(name) for name in QUANTIZATION_METHODS]
    return names[0] if len(names) == 1 else f"one of {', '.join(names)}"


def _supported_checkpoints() -> str:
    formats = [what for method in QUANTIZATION_METHODS.values() for what in method.checkpoint_formats.values()]
    return " and ".join([", ".join(formats[:-1]), formats[-1]] if len(formats) > 1 else formats) or "none"


# ---- resolving the settings (Config) -------------------------------------------------------------------------
def resolve_quantization(hf_config, requested: str | None, where: str, load_format: str = "auto"
                         ) -> QuantizationMethod:
    """The method the checkpoint's quantization_config (if any) and LLM(quantization=...) ask for (UNQUANTIZED
    for neither); ValueError for anything else, naming it. `where`: the config's path, for messages."""
    if requested is not None and (not isinstance(requested, str) or requested not in QUANTIZATION_METHODS):
        raise ValueError(f"quantization must be None or {_choices()}, got {requested!r}")
    config = getattr(hf_config, "quantization_config", None)
    if config is not None and not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    if not config:
        if requested is None:
            return UNQUANTIZED
        return QUANTIZATION_METHODS[requested].for_unquantized_checkpoint(hf_config, where)
    checkpoint_method = config.get("quant_method")
    method_class = next((m for m in QUANTIZATION_METHODS.values() if checkpoint_method in m.checkpoint_formats), None)
    if method_class is None:
        raise ValueError(f"quantization method {checkpoint_method!r} in {where} is not supported; supported: "
                         f"{_supported_checkpoints()}")
    if requested is not None and requested != method_class.name:
        raise ValueError(f"{where} describes a checkpoint quantized with quant_method {checkpoint_method!r}, which "
                         f"quantization={method_class.name!r} reads; quantization={requested!r} cannot apply to it")
    return method_class.for_quantized_checkpoint(config, hf_config, where, random_weights=load_format == "dummy")


# ---- the build context ---------------------------------------------------------------------------------------
_building: list[QuantizationMethod] = []   # only non-empty while a model is being constructed


@contextmanager
def building_with_quantization(method: QuantizationMethod | None):
    """The quantizable layers constructed inside take their quantization method from here (None: UNQUANTIZED)."""
    _building.append(UNQUANTIZED if method is None else method)
    try:
        yield _building[-1]
    finally:
        _building.pop()


def current_quant_method() -> QuantizationMethod:
    return _building[-1] if _building else UNQUANTIZED


# ---- warm-up ---------------------------------------------------------------------------------------------------
def warmup_token_counts(model: nn.Module) -> tuple[int, ...]:
    """The token counts the engine prefills at start-up so that no request pays for a compilation: each layer
    with a quantization method says which its kernels need (`warmup_token_counts()`, asked of its method)."""
    counts = set()
    for module in model.modules():
        layer_counts = getattr(module, "warmup_token_counts", None)
        if callable(layer_counts):
            counts.update(layer_counts())
    return tuple(sorted(counts))
