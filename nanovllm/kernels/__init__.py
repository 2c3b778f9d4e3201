"""Attention kernels with flash-attn 2's signatures: Triton versions, and plain-PyTorch references."""
from .decode_attention import flash_attn_with_kvcache
from .prefill_attention import flash_attn_varlen_func
from .reference import flash_attn_varlen_func as torch_flash_attn_varlen_func
from .reference import flash_attn_with_kvcache as torch_flash_attn_with_kvcache
from .reference import store_kvcache as torch_store_kvcache
from .store_kvcache import store_kvcache

__all__ = ["store_kvcache", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "torch_store_kvcache", "torch_flash_attn_varlen_func", "torch_flash_attn_with_kvcache"]
