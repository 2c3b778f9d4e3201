import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import pointwise
from nanovllm.layers.quantization.base import ScaledOutput


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
        scales = None
        if isinstance(x, ScaledOutput):
            if x.raw.is_cuda and x.raw.dim() == 2:
                x, scales = x.raw, (x.row_scales, x.col_scales)
            else:
                x = x.materialize()
        quantization = self.output_quantization
        if quantization is not None and not quantization.applies(x):
            quantization = None
        if quantization is not None:
            fused = quantization.silu_and_mul(x, scales)
            if fused is not None:
                return fused
        out = pointwise.silu_and_mul(x, scales) if x.is_cuda else silu_and_mul(x)
        return out if quantization is None else quantization.quantize(out)
