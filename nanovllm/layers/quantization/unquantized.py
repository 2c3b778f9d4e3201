"""The default method: weights in the model's dtype, as the checkpoint stores them (LLM(quantization=None) on
an unquantized checkpoint, and the layers no scheme quantizes: the MoE router)."""
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import skinny_gemm
from nanovllm.layers.quantization.base import QuantizationMethod, moe_kernel_token_counts, stacked_expert_weights
from nanovllm.utils.stderr_fd import stderr_to


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 skinny_configs: tuple | None = None) -> torch.Tensor:
    """x @ weight^T + bias in the model's dtype. On a GPU one row (a lone sequence's decode step) goes to
    skinny_gemm.gemv: its products on CUDA cores stream the weight nearer the copy rate than cuBLAS's GEMV,
    and it loads its first weights before the kernel it follows has finished (H100, one stream: Qwen3-8B
    6.53 -> 5.95 ms/token, Qwen3-0.6B 1.40 -> 1.09). A few rows go to the split-K skinny GEMM where
    `skinny_configs` (a table of nanovllm.kernels.skinny_gemm) has tiles for them (the LM head); a decode
    step's LT_ROWS to cuBLASLt; the rest, and the CPU, to cuBLAS / torch."""
    num_rows = x.numel() // x.shape[-1]
    if x.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1:
        if num_rows == 1:
            return skinny_gemm.gemv(x.reshape(1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
        config = skinny_gemm.choose_config(num_rows, skinny_configs) if skinny_configs else None
        if config is not None:
            out = skinny_gemm.skinny_gemm(x.reshape(num_rows, x.shape[-1]), weight, bias, config=config)
            return out.view(*x.shape[:-1], weight.shape[0])
        if LT_ROWS[0] <= num_rows <= LT_ROWS[1]:
            return _linear_through_cublaslt(x, weight, bias)
    return F.linear(x, weight, bias)


# Rows for which cuBLASLt's heuristics pick faster bf16 kernels than cuBLAS's (the four projections of a
# layer; H100: 8B shape 32-96 rows 2.6-3.9% faster, 384 2.8%, 128-256 the same, 16 1.8% slower; 0.6B shape
# 128-256 4.6-4.9%; H200 8B 32-96 4-7%. Qwen3-8B standard, H100: decode 13.60 s against 13.72-13.75.
# A zero bias through addmm's cuBLASLt epilogue instead, with no switch: slower. docs/benchmarks.md)
LT_ROWS = (17, 384)
_BLAS = getattr(torch._C, "_BlasBackend", None)


def _linear_through_cublaslt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear with torch's preferred BLAS library set to cuBLASLt for this call only: the switch is
    process-wide (it picks the kernel at launch, so a CUDA graph captures cuBLASLt's), and the caller's
    own GEMMs keep whatever it had chosen."""
    global _BLAS
    if _BLAS is None:
        return F.linear(x, weight, bias)
    previous = torch._C._get_blas_preferred_backend()
    try:
        _select_cublaslt()
    except RuntimeError:            # a torch built without cuBLASLt: cuBLAS from now on
        _BLAS = None
        return F.linear(x, weight, bias)
    try:
        return F.linear(x, weight, bias)
    finally:
        torch._C._set_blas_preferred_backend(previous)


_switched_before = False


def _select_cublaslt() -> None:
    """torch.backends.cuda.preferred_blas_library("cublaslt"), minus the line torch's C++ writes to stderr the
    first time a process sets it (that the switch is experimental: the engine sets it, not the user, who could
    do nothing about it). Raises RuntimeError where torch has no cuBLASLt."""
    global _switched_before
    if not _switched_before:
        _switched_before = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                with stderr_to(devnull):
                    torch._C._set_blas_preferred_backend(_BLAS.Cublaslt)
                return
            finally:
                os.close(devnull)
        except OSError:         # no stderr to mute (fd 2 closed): set it plainly
            pass
    torch._C._set_blas_preferred_backend(_BLAS.Cublaslt)


@dataclass(frozen=True)
class Unquantized(QuantizationMethod):

    def create_weights(self, layer: nn.Module, input_size: int, output_parts: list[int], tp_size: int,
                       input_split: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(sum(output_parts), input_size))
        layer.weight.weight_loader = layer.weight_loader

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_linear(x, layer.weight, bias)

    def create_moe_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                           intermediate_size: int) -> None:
        stacked_expert_weights(layer, num_experts, hidden_size, intermediate_size)

    def apply_moe(self, layer: nn.Module, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        return layer.run_experts(hidden_states, topk_weights, topk_ids)

    def moe_warmup_token_counts(self, layer: nn.Module) -> tuple[int, ...]:
        return moe_kernel_token_counts(layer)


UNQUANTIZED = Unquantized()
