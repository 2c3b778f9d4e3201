"""Turn a float checkpoint directory (random_checkpoint's) into the FP8 layouts nanovllm loads, and into the
dequantized float32 copy transformers runs as the oracle.

- `to_block_fp8`: Qwen's (and DeepSeek's) FP8 release layout: every attention and MLP projection weight in
  float8_e4m3fn with `weight_scale_inv`, float32, one per 128x128 block ([ceil(N/128), ceil(K/128)]; the
  value is q * scale); embeddings, LM head, norms and MoE routers unchanged; quantization_config
  {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
  with "modules_to_not_convert" naming the LM head and each router (as Qwen3-30B-A3B-FP8's does).
- `to_fp8_dynamic`: compressed-tensors' FP8-dynamic layout (llm-compressor's): the same weights with
  `weight_scale` [N, 1] per output channel, in the checkpoint's dtype, "ignore": ["lm_head"].
- `dequantized`: a copy whose quantized weights are q * scale in float32, with no quantization_config.

Scales are amax / 448 over the block or row, values x / scale rounded to e4m3, as the releases compute them
(written here independently of nanovllm's own quantization code, which the tests compare with this).
"""
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
# the projections (Qwen's and Llama's names; Mixtral's experts: w1, w2, w3), not the routers (mlp.gate)
LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$|\.experts\.\d+\.w[123]\.weight$")
ROUTER = re.compile(r"^(?P<module>.*\.(mlp|block_sparse_moe)\.gate)\.weight$")
BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
FP8_DYNAMIC_CONFIG = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
                    "group_size": None, "block_structure": None, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True, "group_size": None, "block_structure": None, "observer": None},
        "output_activations": None}},
    "ignore": ["lm_head"], "kv_cache_scheme": None}


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], float32 [ceil(N/128), ceil(K/128)]), block by block."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty((n + 127) // 128, (k + 127) // 128, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            s = block.abs().max().clamp(min=1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def channel_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scales [N, 1] in w's dtype)."""
    scale = w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.to(w.dtype)


def _rewrite(source: Path, target: Path, tensors: dict, quantization_config: dict | None) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, target / file.name)
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _weights(source: Path) -> dict:
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _convert(source: str | Path, target: str | Path, quantize, scale_suffix: str, config: dict) -> Path:
    """Every projection weight quantized (its scale saved as `<name><scale_suffix>`), the rest as it was."""
    tensors = {}
    for name, w in _weights(Path(source)).items():
        if LINEAR.search(name):
            tensors[name], tensors[name + scale_suffix] = quantize(w)
        else:
            tensors[name] = w
    return _rewrite(Path(source), Path(target), tensors, config)


def to_block_fp8(source: str | Path, target: str | Path) -> Path:
    routers = sorted(m["module"] for m in map(ROUTER.match, _weights(Path(source))) if m)
    return _convert(source, target, block_quantize, "_scale_inv",
                    {**BLOCK_CONFIG, "modules_to_not_convert": ["lm_head", *routers]})


def to_fp8_dynamic(source: str | Path, target: str | Path) -> Path:
    return _convert(source, target, channel_quantize, "_scale", FP8_DYNAMIC_CONFIG)


def dequantized(source: str | Path, target: str | Path) -> Path:
    """An FP8 checkpoint's weights as float32 numbers (q * scale), loadable by transformers."""
    stored = _weights(Path(source))
    tensors = {}
    for name, w in stored.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if w.dtype == torch.float8_e4m3fn:
            if name + "_scale_inv" in stored:
                s = stored[name + "_scale_inv"].float()
                s = s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
            else:
                s = stored[name + "_scale"].float()
            w = w.float() * s
        tensors[name] = w.float()
    return _rewrite(Path(source), Path(target), tensors, None)
