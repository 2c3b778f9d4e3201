from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.kernels import sampling as kernels
from nanovllm.layers.logits_processor import (apply_penalties, ban_tokens, keep_at_least,
                                              thresholds_from_candidates)


@dataclass
class Penalties:
    """The penalized rows of a step and their state (prompt tokens seen, output token counts)."""
    rows: torch.Tensor              # [p] rows of the batch
    prompt_mask: torch.Tensor       # [p, vocab] bool
    output_counts: torch.Tensor     # [p, vocab] int32
    repetition: torch.Tensor        # [p] float32
    frequency: torch.Tensor
    presence: torch.Tensor


@dataclass
class SamplingTensors:
    """One step's sampling inputs, a row per sampled sequence, on the logits' device. The host-side
    summaries (max_top_k, ...) choose the work without reading the device."""
    temperatures: torch.Tensor      # [rows] float32; 0 = greedy
    keys: torch.Tensor              # [rows] int64 Philox keys (a seed and position, or per-step random)
    top_k: torch.Tensor | None = None   # [rows] int32, 0 = off (filters are None when no row has any)
    top_p: torch.Tensor | None = None   # [rows] float32, 1 = off
    min_p: torch.Tensor | None = None   # [rows] float32, 0 = off
    max_top_k: int = 0
    filter_rows: torch.Tensor | None = None   # int32 rows with top_k or top_p (the exact search's grid)
    max_logprobs: int | None = None     # the most top log-probs a row asks for; None: no row asks
    penalties: Penalties | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None   # (rows, token ids) set to -inf
    logits_rows: torch.Tensor | None = None     # the logits row of each sampled row (n > 1 repeats one)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                     # [rows] int64
    logprobs: torch.Tensor | None = None        # [rows] the sampled token's log-prob (raw logits)
    top_token_ids: torch.Tensor | None = None   # [rows, max_logprobs] most likely first
    top_logprobs: torch.Tensor | None = None


class Sampler(nn.Module):
    """penalties -> temperature -> min_p -> top_k -> top_p -> draw, and log-probs of the raw logits.

    On a GPU nothing sorts the vocabulary and nothing waits for the host: the Triton kernels find each
    row's largest logits and softmax normalizers in two passes, the filters become one threshold a row
    (the exact bisection settles the rows the candidates cannot), and one more pass draws. Elsewhere the
    same thresholds come from a full sort, and the draw is torch's. use_kernels=True takes the kernel
    path off the GPU too (Triton's interpreter, in tests)."""

    def __init__(self, use_kernels: bool | None = None):
        super().__init__()
        self.use_kernels = use_kernels

    def _on_kernels(self, logits: torch.Tensor) -> bool:
        return logits.is_cuda if self.use_kernels is None else self.use_kernels

    def forward(self, logits: torch.Tensor, tensors: SamplingTensors) -> SamplerOutput:
        if tensors.logits_rows is not None:
            logits = logits[tensors.logits_rows]
        raw = logits
        edits = tensors.penalties is not None or tensors.banned is not None
        if edits and tensors.max_logprobs is not None and logits is raw:
            logits = logits.clone()
        output = SamplerOutput(token_ids=torch.empty(0))
        log_z = None
        if tensors.max_logprobs is not None:
            k = max(tensors.max_logprobs, 1)
            values, token_ids, _, _, log_z = self._largest(raw, tensors.temperatures, k)[:5]
            output.top_token_ids = token_ids[:, :tensors.max_logprobs]
            output.top_logprobs = values[:, :tensors.max_logprobs] - log_z.unsqueeze(1)
        if tensors.penalties is not None:
            p = tensors.penalties
            apply_penalties(logits, p.rows, p.prompt_mask, p.output_counts, p.repetition, p.frequency, p.presence)
        if tensors.banned is not None:
            ban_tokens(logits, *tensors.banned)
        thresholds = self._thresholds(logits, tensors) if tensors.top_k is not None else None
        output.token_ids = self._draw(logits, tensors.temperatures, thresholds, tensors.keys)
        if log_z is not None:
            output.logprobs = raw.gather(1, output.token_ids.unsqueeze(1)).squeeze(1).float() - log_z
        return output

    def _largest(self, logits: torch.Tensor, temperatures: torch.Tensor, k: int):
        """(values, token ids, floors, complete, log_z, z_t): see kernels.sampling.candidates; off the GPU,
        every logit (a full sort: floors are -inf)."""
        if self._on_kernels(logits):
            k = min(k, kernels.max_candidates(logits.size(1)))
            values, token_ids, floors, complete, _, log_z, z_t = kernels.candidates(logits, temperatures, k)
            return values, token_ids, floors, complete, log_z, z_t
        x = logits.float()
        values, token_ids = x.sort(dim=1, descending=True, stable=True)
        t = torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
        rows = x.size(0)
        floors = torch.full((rows,), float("-inf"), device=x.device)
        complete = torch.ones(rows, dtype=torch.bool, device=x.device)
        z_t = torch.exp((x - values[:, :1]) / t).sum(1)
        return values, token_ids, floors, complete, torch.logsumexp(x, 1), z_t

    def _thresholds(self, logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
        # on the GPU as many candidates as the kernels serve: the more, the fewer rows need the search
        on_kernels = self._on_kernels(logits)
        held = kernels.max_candidates(logits.size(1)) if on_kernels else logits.size(1)
        values, _, floors, complete, _, z_t = self._largest(logits, tensors.temperatures, held)
        thresholds, floor_min_p, settled = thresholds_from_candidates(
            values, floors, complete, z_t, tensors.temperatures, tensors.top_k, tensors.top_p, tensors.min_p, held)
        if on_kernels:          # off them every row is settled: its candidates are the whole row
            thresholds = torch.where(settled, thresholds, floor_min_p).contiguous()
            kernels.exact_thresholds(logits, tensors.filter_rows, tensors.temperatures, tensors.top_k,
                                     tensors.top_p, thresholds, settled)
        return thresholds

    def _draw(self, logits: torch.Tensor, temperatures: torch.Tensor, thresholds: torch.Tensor | None,
              keys: torch.Tensor) -> torch.Tensor:
        if self._on_kernels(logits):
            return kernels.sample(logits.contiguous(), temperatures, thresholds, keys)
        return gumbel_max(logits, temperatures, thresholds, keys)


def gumbel_max(logits: torch.Tensor, temperatures: torch.Tensor, thresholds: torch.Tensor | None,
               keys: torch.Tensor) -> torch.Tensor:
    """argmax(x / T + G) over the kept tokens, G Gumbel noise from a generator seeded with the row's key
    (so a row's draw depends on its key alone); rows with temperature 0 take the plain argmax."""
    x = logits.float() if thresholds is None else keep_at_least(logits, thresholds)
    greedy = temperatures == 0
    scaled = x / torch.where(greedy, 1.0, temperatures).unsqueeze(1)
    for row, key in enumerate(keys.tolist()):
        if not greedy[row]:
            u = torch.rand(x.size(1), generator=torch.Generator().manual_seed(key)).to(x.device)
            exponential = (-torch.log(u)).clamp_min(1e-20)
            scaled[row] -= torch.log(exponential)
    return scaled.argmax(dim=-1)
