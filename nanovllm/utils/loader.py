"""Load safetensors weights into a model, letting each parameter's weight_loader take its shard."""
import re
from glob import glob
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

# a checkpoint's per-expert tensor: "...experts.{e}.{name}.weight" (Qwen: gate_proj/up_proj/down_proj,
# Mixtral: w1/w3/w2); the model's stacked parameters are "...experts.w13_weight" (gate, up) and "w2_weight"
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<name>\w+)\.weight$")
_STACKED_SHARDS = {"w13_weight": ("gate", "up"), "w2_weight": ("down",)}


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit "
                         f"a parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def load_model(model: nn.Module, path: str) -> None:
    """Packed modules (q/k/v -> qkv_proj, gate/up -> gate_up_proj) are mapped through the model's
    `packed_modules_mapping`, per-expert tensors of MoE families into the stacked experts through its
    `expert_shards`; names the model does not have (e.g. rotary caches) are skipped."""
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
                    if param is not None:
                        param.weight_loader(param, f.get_tensor(checkpoint_name), expert_id, shard)
                        loaded.add((param_name, expert_id, shard))
                    continue
                for source, (target, shard_id) in packed.items():
                    if source in name:
                        param_name = name.replace(source, target)
                        param = params.get(param_name)
                        if param is not None:
                            param.weight_loader(param, f.get_tensor(checkpoint_name), shard_id)
                            loaded.add(param_name)
                        break
                else:
                    param = params.get(name)
                    if param is not None:
                        getattr(param, "weight_loader", default_weight_loader)(param, f.get_tensor(checkpoint_name))
                        loaded.add(name)
    missing = [n for n in params if n not in loaded and not _experts_complete(n, params[n], loaded)]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))


def _experts_complete(name: str, param: nn.Parameter, loaded: set) -> bool:
    """Whether a stacked experts parameter got every expert's every shard."""
    shards = _STACKED_SHARDS.get(name.rsplit(".", 1)[-1])
    return shards is not None and all((name, e, s) in loaded for e in range(param.shape[0]) for s in shards)


def load_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """load_format="dummy": random weights of a trained model's scale, drawn on the parameters' device
    from a seeded generator (the same model each run): matrices ~ N(0, std^2) (`initializer_range`),
    norm weights one, biases zero."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(param.device).manual_seed(seed)
        if param.dim() == 1:
            param.data.fill_(1.0 if "norm" in name else 0.0)
        else:
            param.data.normal_(0.0, std, generator=generator)


def expert_tensor(name: str, shards: dict[str, str]) -> tuple[str, int, str] | None:
    """A per-expert checkpoint tensor's (parameter name, expert, shard), or None for other tensors.
    `shards` maps the checkpoint's projection names to "gate", "up" and "down"."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match["name"] not in shards:
        return None
    shard = shards[match["name"]]
    param = "w2_weight" if shard == "down" else "w13_weight"
    return f"{match['prefix']}.{param}", int(match["expert"]), shard
