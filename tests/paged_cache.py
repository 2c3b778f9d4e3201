"""Random paged K/V caches for the kernel tests."""
import torch


def random_paged_cache(lens, kv_heads, head_dim, block_size, dtype, device, width=None, extra_blocks=2):
    """Caches [num_blocks, block_size, kv_heads, head_dim] and a block table whose pages are scattered
    and whose unused entries are -1 (the engine's padding)."""
    need = [(n + block_size - 1) // block_size for n in lens]
    width = width or max(need) + 1
    num_blocks = sum(need) + extra_blocks
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn(k_cache.shape, device=device).to(dtype)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    table = torch.full((len(lens), width), -1, dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n]
        used += n
    return k_cache, v_cache, table
