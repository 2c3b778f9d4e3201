import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import pointwise
from nanovllm.layers.quantization.base import ScaledOutput, reader_input


def _fused(x: torch.Tensor) -> bool:
    """Whether the Triton kernel takes x (and a ScaledOutput's scales with it)."""
    return x.is_cuda and x.dim() == 2


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """SwiGLU's gate: the merged gate_up projection's first half, SiLU'd, times its second half (one
    Triton kernel on a GPU, which also applies a ScaledOutput's scales: elsewhere it is materialized first).
    `output_quantization`: as RMSNorm's (the down projection's input form)."""

    def __init__(self):
        super().__init__()
        self.output_quantization = None

    def forward(self, x: torch.Tensor | ScaledOutput) -> torch.Tensor:
        x, scales, quantization = reader_input(x, _fused, self.output_quantization)
        if quantization is not None:
            fused = quantization.silu_and_mul(x, scales)
            if fused is not None:
                return fused
        out = pointwise.silu_and_mul(x, scales) if _fused(x) else silu_and_mul(x)
        return out if quantization is None else quantization.quantize(out)
