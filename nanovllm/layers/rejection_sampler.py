"""Speculative decoding's verification: which drafts the target model accepts, and the token each
sequence gains at its first rejection (or after its last draft, the bonus), so that the tokens come out
with exactly the law plain decoding samples from (Leviathan et al. 2023, Chen et al. 2023).

The rows: a sequence with d drafts has d + 1 consecutive rows of target logits; row j is the
distribution of its token after its last token and drafts 1..j (row 0: the token plain decoding would
sample now). Row j < d is checked against draft j + 1; row d (the bonus) against nothing.

Rejection sampling with the target's law p and the proposal's law q at a row with draft d: accept d with
probability min(1, p(d) / q(d)); on rejection draw from normalize(max(p - q, 0)), and stop there (the
rows after a rejection are conditioned on a token that did not happen). After all drafts are accepted the
bonus row draws from p. Each emitted token then has law p given the tokens before it.

A deterministic proposal (n-gram lookup: q is one-hot at d) needs no explicit p: accepting with
probability p(d), and otherwise drawing from p without d, is the same law as drawing t from p and
accepting iff t == d (emitting t where it differs). So `RejectionSampler` then draws every row with the
Sampler itself (penalties, temperature, min_p, top_k, top_p, keyed draws, log-probs: plain decoding's
code, on the GPU its kernels) and counts the leading rows whose token equals the draft. With the same
keys the tokens are even the ones plain decoding draws: a seeded request gives the same completion with
or without speculation. A proposal with a law of its own goes through
`rejection_sample`, with p written out by `Sampler.probabilities` (a draft model: engine/draft_model.py).
"""
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from nanovllm.layers.sampler import Sampler, SamplerOutput, SamplingTensors
from nanovllm.utils.transfer import to_device

NO_DRAFT = -1   # a bonus row's draft: no token equals it


@dataclass
class DraftRows:
    """Where each row of a verification step stands: R rows, B sequences."""
    draft_token_ids: torch.Tensor   # [R] int64: the draft a row's token is checked against; NO_DRAFT on bonus rows
    seq_of_row: torch.Tensor        # [R] int64: the row's sequence
    offsets: torch.Tensor           # [R] int64: the row's place among its sequence's rows
    num_seqs: int

    @classmethod
    def from_drafts(cls, drafts: list[list[int]], device: torch.device) -> "DraftRows":
        counts = np.array([len(d) + 1 for d in drafts], dtype=np.int64)
        seq_of_row = np.repeat(np.arange(len(drafts), dtype=np.int64), counts)
        offsets = np.arange(len(seq_of_row), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        checked = np.full(len(seq_of_row), NO_DRAFT, dtype=np.int64)
        checked[offsets < np.repeat(counts - 1, counts)] = [t for d in drafts for t in d]
        rows = to_device(np.stack([checked, seq_of_row, offsets]), device)
        return cls(rows[0], rows[1], rows[2], len(drafts))


def num_accepted(rows: DraftRows, accepted: torch.Tensor) -> torch.Tensor:
    """[B] int64: per sequence, how many of its leading rows accepted their draft (a bonus row never
    does, so this is at most its number of drafts). No host sync."""
    stop = torch.where(accepted, torch.iinfo(torch.int64).max, rows.offsets)
    first = torch.full((rows.num_seqs,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=stop.device)
    return first.scatter_reduce_(0, rows.seq_of_row, stop, "amin")


def uniforms_from_keys(keys: torch.Tensor) -> torch.Tensor:
    """[rows] float64 in (0, 1), a function of each row's int64 key alone (so a seeded request's accept
    decisions repeat): two rounds of a 32-bit integer hash over the key's halves, in int64 arithmetic
    that never overflows."""
    mask = 0xFFFFFFFF

    def mix(x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
        return x ^ (x >> 16)

    low, high = keys & mask, (keys >> 32) & mask
    h = mix(low ^ mix(high ^ 0x9E3779B9))
    return (h.double() + 0.5) / 2.0 ** 32


def rejection_sample(target_probs: torch.Tensor, rows: DraftRows, draft_probs: torch.Tensor | None,
                     uniforms: torch.Tensor, keys: torch.Tensor, draw) -> tuple[torch.Tensor, torch.Tensor]:
    """The general rule, with p written out: target_probs [R, V] (p of each row), draft_probs [R, V] (q of
    each row's draft; None: one-hot at the draft), uniforms [R] in (0, 1), keys [R] for the draws,
    draw(logits, temperatures, keys) a keyed draw (Sampler.draw). Returns each row's token [R] (its draft
    where accepted, else its draw from the residual, or from p on a bonus row) and num_accepted [B]."""
    draft = rows.draft_token_ids
    has_draft = draft != NO_DRAFT
    safe = draft.clamp(min=0).unsqueeze(1)
    p_d = target_probs.gather(1, safe).squeeze(1).double()
    if draft_probs is None:
        q = torch.zeros_like(target_probs).scatter_(1, safe, 1.0)
    else:
        q = draft_probs.to(target_probs.dtype)
    q_d = q.gather(1, safe).squeeze(1).double()
    accepted = has_draft & (uniforms * q_d < p_d)          # u < p(d) / q(d), without dividing
    residual = torch.where(has_draft.unsqueeze(1), (target_probs - q).clamp(min=0), target_probs)
    # p <= q everywhere (p == q) leaves no residual, and then no rejection either, bar rounding: draw from p
    empty = residual.sum(1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs, residual)
    drawn = draw(residual.log(), torch.ones(len(residual), device=residual.device), keys)
    token_ids = torch.where(accepted, draft, drawn)
    return token_ids, num_accepted(rows, accepted)


class RejectionSampler(nn.Module):
    """Verifies drafts against the target's logits of every row (see the module's docstring)."""

    def __init__(self, sampler: Sampler):
        super().__init__()
        self.sampler = sampler

    def forward(self, logits: torch.Tensor, tensors: SamplingTensors, rows: DraftRows,
                draft_probs: torch.Tensor | None = None) -> tuple[SamplerOutput, torch.Tensor]:
        """(each row's output, num_accepted [B]). The emitted tokens of sequence b are the tokens of its
        rows 0..num_accepted[b]: its accepted drafts, then the token at its first rejection or its bonus.
        draft_probs None: a deterministic proposal (one-hot q), verified by the sampler's own draws, with
        the log-probs it gives; else the general rule (log-probs as the sampler gives them, of the raw logits)."""
        if draft_probs is None:
            output = self.sampler(logits, tensors)
            return output, num_accepted(rows, output.token_ids == rows.draft_token_ids)
        probs = self.sampler.probabilities(logits, tensors)
        token_ids, accepted = rejection_sample(probs, rows, draft_probs, uniforms_from_keys(tensors.keys),
                                               tensors.keys, self.sampler.draw)
        return self.sampler.with_logprobs(logits, tensors, token_ids), accepted
