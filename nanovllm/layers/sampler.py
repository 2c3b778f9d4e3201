import torch
from torch import nn

from nanovllm.kernels.sampling import sample as triton_sample


def sample(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Gumbel-max: argmax(logits / T + G), G = -log(E) with E ~ Exp(1), draws from softmax(logits / T)
    without computing it; rows with temperature 0 take the plain argmax."""
    logits = logits.float()
    greedy = (temperatures == 0).unsqueeze(1)
    scaled = logits / torch.where(greedy, 1.0, temperatures.unsqueeze(1))
    gumbel = -torch.empty_like(logits).exponential_(1).clamp_min_(1e-20).log_()
    return torch.where(greedy, scaled, scaled + gumbel).argmax(dim=-1)


class Sampler(nn.Module):
    """One token per row: the Triton kernel on a GPU (one pass over the logits), torch elsewhere."""

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        if logits.is_cuda:
            return triton_sample(logits.contiguous(), temperatures)
        return sample(logits, temperatures)
