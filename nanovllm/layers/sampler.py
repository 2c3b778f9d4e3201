import torch
from torch import nn


def sample(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Gumbel-max: argmax(probs / E) with E ~ Exp(1) draws from softmax(logits / T) without a
    cumulative sum; rows with temperature 0 take the plain argmax."""
    logits = logits.float()
    greedy = temperatures == 0
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temperatures).unsqueeze(1), dim=-1)
    sampled = probs.div_(torch.empty_like(probs).exponential_(1).clamp_min_(1e-10)).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


sample_compiled = torch.compile(sample, dynamic=True)


class Sampler(nn.Module):

    def __init__(self):
        super().__init__()
        self.compiled = False

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        return (sample_compiled if self.compiled else sample)(logits, temperatures)
