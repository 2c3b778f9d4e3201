"""The KV cache of one rank: one tensor [K/V, layers, blocks, block_size, this rank's kv heads, head_dim],
as many blocks as the device has room for once the model and its warm-up peak are counted (or as the
config says), the same number on every rank, bound into each attention layer as views; and copies of
whole blocks inside it."""
import math

import torch
import torch.distributed as dist

from nanovllm.config import CPU_KV_CACHE_BYTES, Config
from nanovllm.distributed.group import TensorParallelGroup
from nanovllm.layers.attention import Attention


def kv_cache_shape(config: Config, num_blocks: int, hf_config=None) -> tuple[int, ...]:
    """[K/V, layers, blocks, block_size, this rank's kv heads, head_dim] of the target model (or of
    hf_config's: a draft model's cache has the target's blocks, in its own shape)."""
    hf = hf_config or config.hf_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return (2, hf.num_hidden_layers, num_blocks, config.kvcache_block_size,
            hf.num_key_value_heads // config.tensor_parallel_size, head_dim)


def block_bytes(config: Config) -> int:
    """One block's bytes: the target's K/V, and a draft model's beside it (same block ids, own cache)."""
    models = [config.hf_config] + ([config.draft_hf_config] if config.draft_hf_config is not None else [])
    return sum(math.prod(kv_cache_shape(config, 1, hf)) for hf in models) * config.kv_cache_dtype.itemsize


def num_blocks_that_fit(config: Config, device: torch.device) -> int:
    """config.num_kvcache_blocks if set; on CPU, CPU_KV_CACHE_BYTES' worth (at least one max_model_len
    sequence); on a GPU, what gpu_memory_utilization leaves once the memory in use and the warm-up's
    peak activations are counted."""
    size = block_bytes(config)
    if config.num_kvcache_blocks > 0:
        return config.num_kvcache_blocks
    if device.type == "cpu":
        min_blocks = (config.max_model_len + config.kvcache_block_size - 1) // config.kvcache_block_size
        return max(CPU_KV_CACHE_BYTES // size, min_blocks)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    stats = torch.cuda.memory_stats(device)
    peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
    available = int(total * config.gpu_memory_utilization) - used - peak + current
    num_blocks = available // size
    if num_blocks < 1:
        raise ValueError(f"not even one KV cache block ({size} bytes) fits in GPU memory at "
                         f"gpu_memory_utilization={config.gpu_memory_utilization}")
    return num_blocks


def agreed_num_blocks(num_blocks: int, group: TensorParallelGroup, device: torch.device) -> int:
    """The fewest blocks any rank has room for: every rank must agree on the pool the scheduler hands out."""
    if group.size == 1:
        return num_blocks
    t = torch.tensor([num_blocks], device=device)
    return int(group.all_reduce(t, dist.ReduceOp.MIN).item())


def allocate_kv_cache(config: Config, num_blocks: int, device: torch.device,
                      attention_layers: list[Attention], hf_config=None) -> torch.Tensor:
    """The cache tensor; layer i's k_cache and v_cache become views of its [0, i] and [1, i]."""
    kv_cache = torch.empty(kv_cache_shape(config, num_blocks, hf_config), dtype=config.kv_cache_dtype,
                           device=device)
    for i, layer in enumerate(attention_layers):
        layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]
    return kv_cache


def copy_blocks(kv_cache: torch.Tensor, block_copies: list[tuple[int, int]]) -> None:
    """Copy whole KV blocks (every layer, K and V), (source, destination) in list order (a block handed out
    again may be a later pair's destination), each queued behind the step that wrote its source; one block
    at a time, so no gathered copy of them all is allocated (31 blocks of Qwen3-0.6B: ~0.9 GB)."""
    cache = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache  # not every device indexes fp8
    for source, destination in block_copies:
        cache[:, :, destination].copy_(cache[:, :, source])
