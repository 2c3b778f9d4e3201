"""Plain-PyTorch versions of the three attention functions, with flash-attn 2's signatures.

They run anywhere (CPU included), compute in float32 (or float64 when given float64) and serve
as the `"torch"` backend and as the oracle the Triton kernels are tested against.
"""
import torch


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write key/value [N, kv_heads, head_dim] into the paged caches at flat slots; slot -1 is skipped.
    With an fp8 cache, key and value are rounded in place to the values stored."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache in ((key, k_cache), (value, v_cache)):
        stored = to_cache_dtype(x[keep], cache.dtype)
        cache.view(-1, *cache.shape[2:])[slots] = stored
        if cache.dtype == torch.float8_e4m3fn:   # attention over x now sees what the cache holds
            x[keep] = stored.to(x.dtype)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the cache stores of x: fp8 (float8_e4m3fn) saturates at +-448, its largest finite value."""
    if dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-448.0, 448.0)
    return x.to(dtype)


def _gather_pages(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence, read through its row of the block table."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    pages = cache[block_row[:num_blocks].long()]              # [num_blocks, block_size, H, D]
    return pages.reshape(-1, *cache.shape[2:])[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """One sequence: q [Lq, Hq, D], k/v [Lk, Hkv, D]; causal mask aligned to the bottom right."""
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lq, num_heads, _ = q.shape
    lk, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qf = q.to(compute_dtype).transpose(0, 1)                                      # [Hq, Lq, D]
    kf = k.to(compute_dtype).transpose(0, 1).repeat_interleave(group, dim=0)     # [Hq, Lk, D]
    vf = v.to(compute_dtype).transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale                       # [Hq, Lq, Lk]
    if causal:
        rows = torch.arange(lq, device=q.device).unsqueeze(1) + (lk - lq)
        cols = torch.arange(lk, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(cols > rows, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)   # a query row with no key gives zeros
    return torch.matmul(probs, vf).transpose(0, 1).to(q.dtype)                   # [Lq, Hq, D]


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float | None = None,
                           causal: bool = False, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen attention. Without block_table k/v are packed [Nk, Hkv, D]; with it they are paged caches."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        qs = q[cu_q[i]:cu_q[i + 1]]
        lk = cu_k[i + 1] - cu_k[i]
        if block_table is None:
            ks, vs = k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        else:
            ks, vs = _gather_pages(k, block_table[i], lk), _gather_pages(v, block_table[i], lk)
        out[cu_q[i]:cu_q[i + 1]] = _attend(qs, ks, vs, scale, causal)
    return out


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                            softmax_scale: float | None = None, causal: bool = False) -> torch.Tensor:
    """Paged decode: q [B, Lq, Hq, D] against each sequence's first cache_seqlens[b] cached tokens.

    Batched: every sequence's pages are gathered into one padded [B, L, Hkv, D] tensor and the padding is
    masked, so a decode step costs a handful of tensor ops whatever the batch size. Grouped-query heads
    are not repeated: the `group` query heads that share a KV head are stacked as rows of one matrix
    ([B, Hkv, group * Lq, D]), so each K/V is read once. On the host (CPU tensors) L is cut to the
    batch's longest sequence; on a device it stays the block table's width (no sync, graph-safe)."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, lq, num_heads, head_dim = q.shape
    on_host = q.device.type == "cpu"
    longest = int(cache_seqlens.max()) if on_host and batch else None
    if block_table is None:
        k, v = k_cache, v_cache                                             # [B, L, Hkv, D]
    else:
        pages = block_table.long().clamp_min(0)                              # -1 padding -> any valid block
        if longest is not None:
            pages = pages[:, :max(1, -(-longest // k_cache.shape[1]))]       # only the blocks some row reads
        k = k_cache[pages].flatten(1, 2)                                     # [B, M * block_size, Hkv, D]
        v = v_cache[pages].flatten(1, 2)
    if longest is not None:
        k, v = k[:, :max(1, longest)], v[:, :max(1, longest)]
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    # query head h reads KV head h // group; rows of a KV head's matrix run (head in group, query position)
    qg = q.to(compute_dtype).view(batch, lq, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(batch, num_kv_heads, group * lq, head_dim)
    kt = k.to(compute_dtype).permute(0, 2, 3, 1)                                  # [B, Hkv, D, L]
    vf = v.to(compute_dtype).transpose(1, 2)                                      # [B, Hkv, L, D]
    scores = torch.matmul(qg, kt) * scale                                         # [B, Hkv, group * Lq, L]
    lengths = cache_seqlens.long().view(batch, 1, 1, 1)
    key_pos = torch.arange(kt.shape[-1], device=q.device).view(1, 1, 1, -1)
    visible = key_pos < lengths
    # slots past a sequence's length were never written (the cache is uninitialized memory): zero
    # their values, or a NaN there would survive its zero attention weight (0 * NaN = NaN)
    vf = vf.masked_fill(~visible.transpose(2, 3), 0.0)
    if causal:
        query_pos = (torch.arange(group * lq, device=q.device) % lq).view(1, 1, -1, 1) + lengths - lq
        visible = visible & (key_pos <= query_pos)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    out = torch.matmul(probs, vf).view(batch, num_kv_heads, group, lq, head_dim)   # [B, Hkv, group, Lq, D]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, lq, num_heads, head_dim).to(q.dtype)
