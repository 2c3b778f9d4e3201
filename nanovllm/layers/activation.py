import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


silu_and_mul_compiled = torch.compile(silu_and_mul, dynamic=True)


class SiluAndMul(nn.Module):
    """SwiGLU's gate: the merged gate_up projection's first half, SiLU'd, times its second half."""

    def __init__(self):
        super().__init__()
        self.compiled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (silu_and_mul_compiled if self.compiled else silu_and_mul)(x)
