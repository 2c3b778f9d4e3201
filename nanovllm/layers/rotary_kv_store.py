"""Rotary position embedding, and the paged KV cache write it does in passing.

RotaryEmbedding rotates q and k by their positions (cos/sin table, Llama 3's frequency scaling; with
Qwen3's q_norm/k_norm each head RMS-normalized first). Given the value and the paged caches it also writes
the rotated key and the value into their slots: on a GPU in the same Triton kernel (kernels/rotary.py, one
launch fewer per layer), on CPU through the reference store. rope_parameters reads a config's rope
settings. Attention decides which of its backends may take the fused write (layers/attention.py)."""
import math
import weakref

import torch
from torch import nn

from nanovllm.kernels.reference import store_kvcache
from nanovllm.kernels.rotary import rotate_qk
from nanovllm.layers.layernorm import RMSNorm, rms_norm


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (first half, second half) pair of x [N, heads, D] by its position's angle."""
    x1, x2 = torch.chunk(x.float(), 2, dim=-1)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    return torch.cat((y1, y2), dim=-1).to(x.dtype)


def rotate(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return apply_rotary_emb(query, cos, sin), apply_rotary_emb(key, cos, sin)


def norm_rotate(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
                q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMS-normalize each head of q and k (Qwen3), then rotate."""
    return rotate(positions, rms_norm(query, q_weight, eps), rms_norm(key, k_weight, eps), cos_sin_cache)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's frequency-dependent stretch: long wavelengths slowed by `factor`, short ones kept,
    the band between interpolated smoothly."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


# the cos/sin tables alive, by what they are built from: a model's layers share one (a 40,960-position table
# is 20 MiB, 0.94 GiB over Qwen3-30B-A3B's 48 layers, room the KV cache is sized into); weak, so that a
# dropped model's table goes with it
_tables: "weakref.WeakValueDictionary[tuple, torch.Tensor]" = weakref.WeakValueDictionary()


def cos_sin_table(head_size: int, max_position: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """[max_position, head_size] float32 on the default device: each position's cos (first half) and sin
    (second half) of its angles; the same tensor for the same arguments while one is alive."""
    key = (head_size, max_position, float(base), repr(sorted((scaling or {}).items())), str(torch.get_default_device()))
    table = _tables.get(key)
    if table is None:
        exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
        inv_freq = 1.0 / (base ** exponents)
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        table = _tables[key] = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return table


class RotaryEmbedding(nn.Module):

    def __init__(self, head_size: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.register_buffer("cos_sin_cache", cos_sin_table(head_size, max_position, base, scaling), persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, *,
                value: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                v_cache: torch.Tensor | None = None,
                slot_mapping: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (query, key); with q_norm and k_norm each head is normalized first. On a GPU one Triton
        kernel does it all (torch.compile made six kernels of it, each launch costing more than its work).

        With value and the paged caches, the rotated key and the value are also written at slot_mapping's
        slots, as store_kvcache writes them (on a GPU in the same kernel: one launch fewer per layer)."""
        assert (q_norm is None) == (k_norm is None) and (q_norm is None or q_norm.eps == k_norm.eps)
        norm = () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        if query.is_cuda:
            return rotate_qk(positions, query, key, self.cos_sin_cache, *norm, value=value, k_cache=k_cache,
                             v_cache=v_cache, slot_mapping=slot_mapping)
        query, key = (norm_rotate if norm else rotate)(positions, query, key, self.cos_sin_cache, *norm)
        if value is not None:
            store_kvcache(key, value, k_cache, v_cache, slot_mapping)
        return query, key


def rope_parameters(hf_config) -> tuple[float, dict | None]:
    """(rope_theta, scaling or None) from a transformers 4.x (rope_theta/rope_scaling) or 5.x
    (rope_parameters) config; scaling kinds we do not implement are refused."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, params
    raise ValueError(f"rope scaling of type {kind!r} is not supported (supported: default, llama3)")
