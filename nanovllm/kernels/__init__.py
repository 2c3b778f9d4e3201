"""Triton kernels. Attention with flash-attn 2's signatures (exported here beside plain-PyTorch references);
`rotary` (RoPE with an optional per-head RMSNorm) and `sampling` (one-pass Gumbel-max) serve the GPU path
from their own modules, their torch versions living in the layers that call them."""
from .decode_attention import flash_attn_with_kvcache
from .prefill_attention import flash_attn_varlen_func
from .reference import flash_attn_varlen_func as torch_flash_attn_varlen_func
from .reference import flash_attn_with_kvcache as torch_flash_attn_with_kvcache
from .reference import store_kvcache as torch_store_kvcache
from .store_kvcache import store_kvcache

__all__ = ["store_kvcache", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "torch_store_kvcache", "torch_flash_attn_varlen_func", "torch_flash_attn_with_kvcache"]
