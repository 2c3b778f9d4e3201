import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import pointwise


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """SwiGLU's gate: the merged gate_up projection's first half, SiLU'd, times its second half (one
    Triton kernel on a GPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pointwise.silu_and_mul(x) if x.is_cuda else silu_and_mul(x)
