"""A model built on one rank's device, in the engine's dtype, split over the tensor-parallel group and
quantized by a method, with its weights: a checkpoint's, or seeded random ones (load_format="dummy"). The
target model (ModelRunner) and a speculative draft model (draft_model.py) are built alike."""
import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.distributed.group import TensorParallelGroup, building_with
from nanovllm.layers.quantization import QuantizationMethod, building_with_quantization
from nanovllm.models import model_class
from nanovllm.utils.loader import load_dummy_weights, load_model


def build_model(config: Config, hf_config, path: str, device: torch.device, group: TensorParallelGroup,
                quant_method: QuantizationMethod | None, factory=None) -> nn.Module:
    """hf_config's model (factory(hf_config), default its architecture's class) with the weights in `path`
    (or random ones when config.load_format is dummy)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device), building_with(group), building_with_quantization(quant_method):
            model = (factory or model_class(hf_config))(hf_config)
    finally:
        torch.set_default_dtype(default_dtype)
    if config.load_format == "dummy":
        load_dummy_weights(model, std=getattr(hf_config, "initializer_range", None) or 0.02)
    else:
        load_model(model, path)
    return model
