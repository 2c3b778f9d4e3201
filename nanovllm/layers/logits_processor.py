"""Logits processing before the draw, in torch (on any device): penalties, banned tokens, and the
per-row threshold that min_p, top_k and top_p leave (tokens below it are dropped).

The filters are all thresholds on the (penalized) logit: min_p keeps x >= max + T * log(min_p); top_k
keeps x >= the k-th largest (ties with it stay, as in transformers); top_p then keeps the smallest set
of most likely survivors whose probability reaches p (ties with the boundary token stay too). So a row
needs only its largest logits, never a sort of the vocabulary.
"""
import math

import torch


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, state_rows: torch.Tensor, prompt_mask: torch.Tensor,
                    output_counts: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> None:
    """In place, for logits[rows]: repetition over prompt + output (positive logits divided, negative
    multiplied), then frequency (times the count) and presence (once) over the output. prompt_mask
    (bool) and output_counts (int32) are the state tables, [state rows, vocab]: logits row rows[i] takes
    their row state_rows[i]. The GPU's one-pass version is nanovllm.kernels.penalties (same roundings)."""
    x = logits[rows].float()
    state_counts = output_counts[state_rows]
    counts = state_counts.float()
    seen = prompt_mask[state_rows] | (state_counts > 0)
    repetition = repetition.unsqueeze(1)
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0)
    logits[rows] = x.to(logits.dtype)


def keep_only(logits: torch.Tensor, rows: torch.Tensor, sets: torch.Tensor, set_index: torch.Tensor,
              token_ids: torch.Tensor) -> None:
    """allowed_token_ids: every logit of row rows[i] -inf but those of the tokens in its set sets[i], where set s
    lists token_ids[j] for each set_index[j] == s (a set a distinct SamplingParams: rows that share one share it,
    so the host sends each list once)."""
    listed = torch.zeros(rows.numel(), logits.size(1), dtype=torch.bool, device=logits.device)   # sets <= rows
    listed[set_index, token_ids] = True
    logits[rows] = logits[rows].masked_fill(~listed[sets], float("-inf"))


def add_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor) -> None:
    """logit_bias: logits[rows[i], token_ids[i]] += values[i] (in the logits' dtype; each pair once)."""
    logits[rows, token_ids] += values.to(logits.dtype)


def ban_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """logits[rows[i], token_ids[i]] = -inf (eos and stop tokens before min_tokens)."""
    logits[rows, token_ids] = float("-inf")


def min_p_thresholds(row_max: torch.Tensor, temperatures: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """p >= min_p * p_max  <=>  x / T >= max / T + log(min_p); -inf where min_p is 0."""
    t = torch.where(temperatures > 0, temperatures, 1.0)
    log_min_p = torch.where(min_p > 0, min_p, 1.0).log()
    return torch.where(min_p > 0, row_max + t * log_min_p, -math.inf)


def thresholds_from_candidates(values: torch.Tensor, floors: torch.Tensor, complete: torch.Tensor,
                               z_t: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor,
                               top_p: torch.Tensor, min_p: torch.Tensor, max_top_k: int):
    """Each row's threshold from its largest logits.

    values: [rows, C] descending (-inf pads), every logit >= floors[row] when complete[row]; max_top_k:
    the largest top_k the candidates are known to hold; z_t: sum(exp((x - max) / T)) over the row.
    Returns (thresholds, min_p thresholds, settled): a row is not settled when its candidates cannot
    decide it (a top_p boundary below them, a top_k beyond them); those need the exact search."""
    row_max = values[:, 0]
    t = torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
    floor_min_p = min_p_thresholds(row_max, temperatures, min_p)
    num = values.size(1)
    kth = values.gather(1, (top_k.long() - 1).clamp(0, num - 1).unsqueeze(1)).squeeze(1)
    has_k = top_k > 0
    threshold = torch.where(has_k, torch.maximum(floor_min_p, kth), floor_min_p)
    k_ok = ~has_k | ((top_k <= max_top_k) & complete)
    # the survivors' probabilities, by mass relative to the row max
    weights = torch.where(values >= threshold.unsqueeze(1), torch.exp((values - row_max.unsqueeze(1)) / t), 0.0)
    cumulative = weights.cumsum(1)
    inside = complete & (threshold >= floors)           # every survivor is a candidate
    total = torch.where(inside, cumulative[:, -1], z_t)  # z_t is the survivors' mass only with no floor at all
    boundary = (cumulative < (top_p * total).unsqueeze(1)).sum(1).clamp(max=num - 1)
    has_p = top_p < 1
    p_ok = ~has_p | inside | (torch.isneginf(threshold) & complete & (cumulative[:, -1] >= top_p * total))
    threshold = torch.where(has_p & p_ok, torch.maximum(threshold, values.gather(1, boundary.unsqueeze(1)).squeeze(1)),
                            threshold)
    return threshold, floor_min_p, k_ok & p_ok


def keep_at_least(logits: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """logits with every entry below its row's threshold set to -inf (float32)."""
    x = logits.float()
    return x.masked_fill(x < thresholds.unsqueeze(1), float("-inf"))
