"""Load safetensors weights into a model, letting each parameter's weight_loader take its shard, then let
each module finish its weights (`process_weights_after_loading`: online quantization).

What depends on a quantization scheme is asked of the layers' quantization methods (`quant_method`, which the
layers carry): this module tests no scheme's name (it only refuses FP8 values for a parameter of another
dtype, whatever the scheme)."""
import re
from glob import glob
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

# a checkpoint's per-expert tensor: "...experts.{e}.{name}.weight" (Qwen: gate_proj/up_proj/down_proj,
# Mixtral: w1/w3/w2), or a tensor its quantization keeps beside it ("....weight_scale_inv"); the model's stacked
# parameters are "...experts.w13_weight" (gate, up) and "w2_weight", and the others "w13_weight_scale_inv"...
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<name>\w+)\.(?P<tensor>\w+)$")
_STACKED_SHARDS = {"w13": ("gate", "up"), "w2": ("down",)}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit "
                         f"a parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def _checked(checkpoint_name: str, tensor: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """FP8 values land only in FP8 parameters: read as numbers without their scales they are garbage."""
    if tensor.dtype in FP8_DTYPES and param.dtype not in FP8_DTYPES:
        raise ValueError(f"checkpoint tensor {checkpoint_name} is {tensor.dtype}, but the model built for it is "
                         f"not quantized there: the checkpoint's config.json lacks the quantization_config that "
                         f"describes it")
    return tensor


def after_loading(model: nn.Module) -> None:
    """Every module that finishes its weights once they are all in (online quantization) does so now."""
    for module in model.modules():
        finish = getattr(module, "process_weights_after_loading", None)
        if finish is not None:
            finish()


def load_model(model: nn.Module, path: str) -> None:
    """Packed modules (q/k/v -> qkv_proj, gate/up -> gate_up_proj) are mapped through the model's
    `packed_modules_mapping`, per-expert tensors of MoE families into the stacked experts through its
    `expert_shards`; names the model does not have (e.g. rotary caches) are skipped, but for those a
    quantization method knows (FP8 scales the model was not built for, static activation scales): refused,
    saying what they are. The tensors a quantization keeps beside a weight (FP8 scales: `*.weight_scale_inv`,
    `*.weight_scale`) follow it through the same mapping."""
    methods = _quantization_methods(model)
    packed = getattr(model, "packed_modules_mapping", {})
    renamed = getattr(model, "renamed_modules", {})
    expert_shards = getattr(model, "expert_shards", {})
    params = dict(model.named_parameters())
    loaded = set()
    for file in sorted(glob(str(Path(path) / "*.safetensors"))):
        with safe_open(file, "pt", "cpu") as f:
            for checkpoint_name in f.keys():
                name = checkpoint_name
                for source, target in renamed.items():
                    name = name.replace(f".{source}.", f".{target}.")
                expert = expert_tensor(name, expert_shards) if expert_shards else None
                if expert is not None:
                    param_name, expert_id, shard = expert
                    param = params.get(param_name)
                    if param is None:
                        _refuse_quantization_tensor(path, checkpoint_name, methods)
                    else:
                        param.weight_loader(param, f.get_tensor(checkpoint_name), expert_id, shard)
                        loaded.add((param_name, expert_id, shard))
                    continue
                shard = ()
                for source, (target, shard_id) in packed.items():
                    if source in name:
                        name, shard = name.replace(source, target), (shard_id,)
                        break
                param = params.get(name)
                if param is None:
                    _refuse_quantization_tensor(path, checkpoint_name, methods)
                    continue
                tensor = _checked(checkpoint_name, f.get_tensor(checkpoint_name), param)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, *shard)
                loaded.add(name)
    missing = [n for n in params if n not in loaded and not _experts_complete(n, params[n], loaded)]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
    after_loading(model)


def _quantization_methods(model: nn.Module) -> list:
    """The quantization methods the model's layers were built with (each layer carries its `quant_method`)."""
    methods = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            methods.setdefault(id(method), method)
    return list(methods.values())


def _refuse_quantization_tensor(path: str, checkpoint_name: str, methods: list) -> None:
    """A checkpoint tensor no parameter takes: refused if a quantization method knows what it is."""
    for method in methods:
        what = method.unexpected_tensor(checkpoint_name)
        if what is not None:
            raise ValueError(f"checkpoint {path!r} has {what}")


def _experts_complete(name: str, param: nn.Parameter, loaded: set) -> bool:
    """Whether a stacked experts parameter got every expert's every shard."""
    shards = _STACKED_SHARDS.get(name.rsplit(".", 1)[-1].split("_", 1)[0])
    return shards is not None and all((name, e, s) in loaded for e in range(param.shape[0]) for s in shards)


def load_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """load_format="dummy": random weights of a trained model's scale, drawn on the parameters' device
    from a seeded generator (the same model each run): matrices ~ N(0, std^2) (`initializer_range`),
    norm weights one, biases zero. Quantized layers hold their weights in the model's dtype until after_loading
    quantizes them (Config makes dummy weights quantize online)."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(param.device).manual_seed(seed)
        if param.dim() == 1:
            param.data.fill_(1.0 if "norm" in name else 0.0)
        else:
            param.data.normal_(0.0, std, generator=generator)
    after_loading(model)


def expert_tensor(name: str, shards: dict[str, str]) -> tuple[str, int, str] | None:
    """A per-expert checkpoint tensor's (parameter name, expert, shard), or None for other tensors.
    `shards` maps the checkpoint's projection names to "gate", "up" and "down"."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match["name"] not in shards:
        return None
    shard = shards[match["name"]]
    stacked = "w2" if shard == "down" else "w13"
    return f"{match['prefix']}.{stacked}_{match['tensor']}", int(match["expert"]), shard
