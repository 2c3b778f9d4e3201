"""The per-step attention metadata, set by the ModelRunner around each forward and read by Attention."""
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Context:
    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    # decode: the rows longest context first (int32, a permutation), the order decode attention takes them in
    decode_order: torch.Tensor | None = None
    # decode: rows whose contexts begin with the same pages, read once for the group (engine/shared_prefixes.py:
    # shared_lens, items, members), or None
    shared_prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(is_prefill: bool, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                slot_mapping=None, context_lens=None, block_tables=None, decode_order=None,
                shared_prefix=None) -> None:
    global _CONTEXT
    _CONTEXT = Context(is_prefill, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       slot_mapping, context_lens, block_tables, decode_order, shared_prefix)


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = Context()


@contextmanager
def using_context(context: Context):
    """A step's context set again for a while (a speculative draft runs under its target step's metadata)."""
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, context
    try:
        yield context
    finally:
        _CONTEXT = previous
