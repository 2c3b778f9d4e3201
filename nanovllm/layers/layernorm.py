import torch
from torch import nn

from nanovllm.kernels import pointwise
from nanovllm.layers.quantization.base import ScaledOutput, reader_input


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    orig_dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x.to(orig_dtype) * weight


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x, then normalize it: one pass instead of two (the sum is the next residual)."""
    orig_dtype = x.dtype
    x = x.float() + residual.float()
    residual = x.to(orig_dtype)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x.to(orig_dtype) * weight, residual


class RMSNorm(nn.Module):
    """`output_quantization`: set where one quantized layer alone reads the output (the model says which: its
    InputQuantization); the output is then written in that layer's input form (QuantizedActivations)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.output_quantization = None

    def forward(self, x: torch.Tensor | ScaledOutput, residual: torch.Tensor | None = None):
        """Normalized x; with `residual`, (normalized x + residual, x + residual). One Triton kernel on a GPU,
        which also applies a ScaledOutput's scales (elsewhere it is materialized first)."""
        x, scales, quantization = reader_input(x, self._fused, self.output_quantization)
        if quantization is not None:
            fused = quantization.rms_norm(x, self.weight, self.eps, residual, scales)
            if fused is not None:
                return fused
        out = self._normalize(x, residual, scales)
        if quantization is None:
            return out
        if residual is None:
            return quantization.quantize(out)
        return quantization.quantize(out[0]), out[1]

    def _fused(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dim() == 2 and self.weight.dtype == x.dtype

    def _normalize(self, x: torch.Tensor, residual: torch.Tensor | None,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None):
        if self._fused(x):
            return pointwise.rms_norm(x, self.weight, self.eps, residual, scales)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
