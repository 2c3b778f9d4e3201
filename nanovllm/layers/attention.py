from types import SimpleNamespace

import torch
from torch import nn

from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_kv_store import RotaryEmbedding
from nanovllm.utils.context import get_context


def attention_ops(backend: str) -> SimpleNamespace:
    """The three flash-attn-shaped functions of one backend: 'flash_attn', 'triton' or 'torch'; and
    `fused_rope_store`: whether its store is our Triton one, which the rotary kernel can do in passing;
    `new_kv_beside_pages`: whether its paged prefill also takes this step's K/V packed (k_new, v_new);
    `decode_order`: whether its paged decode takes the order of the rows (the context's decode_order) and
    reads the pages that rows share once for them (the context's shared_prefix)."""
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from nanovllm.kernels import store_kvcache
    elif backend == "triton":
        from nanovllm.kernels import flash_attn_varlen_func, flash_attn_with_kvcache, store_kvcache
    elif backend == "torch":
        from nanovllm.kernels.reference import flash_attn_varlen_func, flash_attn_with_kvcache, store_kvcache
    else:
        raise ValueError(f"unknown attention backend {backend!r}")
    return SimpleNamespace(store_kvcache=store_kvcache, flash_attn_varlen_func=flash_attn_varlen_func,
                           flash_attn_with_kvcache=flash_attn_with_kvcache, fused_rope_store=backend != "torch",
                           new_kv_beside_pages=backend == "triton", decode_order=backend == "triton")


class Attention(nn.Module):
    """Rotates q and k (given `rotary_emb`), writes this step's K/V into the paged cache, then attends:
    varlen for prefill, paged for decode. Where the backend's store is our Triton one, the rotary kernel
    does the write too (one launch fewer per layer).

    The ModelRunner binds `k_cache`, `v_cache` (views of its one KV tensor) and `ops` (the backend).
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])
        self.ops = attention_ops("torch")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None,
                rotary_emb: RotaryEmbedding | None = None, q_norm: RMSNorm | None = None,
                k_norm: RMSNorm | None = None) -> torch.Tensor:
        context, ops = get_context(), self.ops
        k_cache, v_cache = self.k_cache, self.v_cache
        cached = k_cache.numel() and v_cache.numel()
        # a backend with our Triton store has the rotary call write the cache too: on a GPU its kernel does,
        # one launch fewer per layer (on CPU, under the interpreter, it rotates and stores in torch)
        if rotary_emb is not None and cached and ops.fused_rope_store:
            q, k = rotary_emb(positions, q, k, q_norm, k_norm, value=v, k_cache=k_cache, v_cache=v_cache,
                              slot_mapping=context.slot_mapping)
        else:
            if rotary_emb is not None:
                q, k = rotary_emb(positions, q, k, q_norm, k_norm)
            if cached:
                ops.store_kvcache(k, v, k_cache, v_cache, context.slot_mapping)
        if context.is_prefill:
            new_kv = {}
            if context.block_tables is not None:    # part of a prompt is cached: read K/V through pages
                if ops.new_kv_beside_pages and k_cache.dtype == k.dtype:
                    # where pages are smaller than a key tile (no TMA for them), the batch's prompts with
                    # nothing cached read theirs packed, through TMA (prefill-heavy's prefill at 16-token
                    # pages: 4-8% longer than at 256 on an H100 before, within 0.4% after on an H200)
                    new_kv = {"k_new": k, "v_new": v}
                k, v = k_cache, v_cache
            elif k_cache.dtype != k.dtype and k_cache.dtype == torch.float8_e4m3fn:
                # the fresh K/V hold the fp8 values (the cache write rounded them in place): hand them over
                # as fp8, so this prompt's attention runs the arithmetic a later read of its cached
                # blocks will (float16 dots for bf16 queries), and outputs do not depend on cache hits
                k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
            return ops.flash_attn_varlen_func(q, k, v, cu_seqlens_q=context.cu_seqlens_q,
                                              cu_seqlens_k=context.cu_seqlens_k,
                                              max_seqlen_q=context.max_seqlen_q, max_seqlen_k=context.max_seqlen_k,
                                              softmax_scale=self.scale, causal=True,
                                              block_table=context.block_tables, **new_kv)
        ours = {"order": context.decode_order, "shared_prefix": context.shared_prefix} if ops.decode_order else {}
        o = ops.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context.context_lens,
                                        block_table=context.block_tables, softmax_scale=self.scale, causal=True,
                                        **ours)
        return o.squeeze(1)
