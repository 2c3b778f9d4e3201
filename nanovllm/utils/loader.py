"""Load safetensors weights into a model, letting each parameter's weight_loader take its shard."""
from glob import glob
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit "
                         f"a parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def load_model(model: nn.Module, path: str) -> None:
    """Packed modules (q/k/v -> qkv_proj, gate/up -> gate_up_proj) are mapped through the model's
    `packed_modules_mapping`; names the model does not have (e.g. rotary caches) are skipped."""
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    loaded = set()
    for file in sorted(glob(str(Path(path) / "*.safetensors"))):
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                for source, (target, shard_id) in packed.items():
                    if source in name:
                        param_name = name.replace(source, target)
                        param = params.get(param_name)
                        if param is not None:
                            param.weight_loader(param, f.get_tensor(name), shard_id)
                            loaded.add(param_name)
                        break
                else:
                    param = params.get(name)
                    if param is not None:
                        getattr(param, "weight_loader", default_weight_loader)(param, f.get_tensor(name))
                        loaded.add(name)
    missing = [n for n in params if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
