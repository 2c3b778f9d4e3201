"""Hugging Face references for the sampling tests: raw log-probs by teacher forcing, greedy decoding with
vLLM's penalties written out by hand, and transformers' own generate() with its repetition penalty."""
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def teacher_forced_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """[len(completion_ids), vocab] float32: log_softmax of the raw logits at each completion position,
    with the prompt and the completion so far fed in (row i is the distribution completion_ids[i] came from)."""
    ids = torch.tensor([prompt_ids + completion_ids], device=_device(model))
    logits = model(input_ids=ids).logits[0].float()
    start = len(prompt_ids) - 1
    return torch.log_softmax(logits[start:start + len(completion_ids)], dim=-1).cpu()


def penalize(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], repetition: float = 1.0,
             presence: float = 0.0, frequency: float = 0.0) -> torch.Tensor:
    """vLLM's penalties on one row of logits (a new tensor): repetition over prompt + output tokens
    (positive logits divided by it, negative ones multiplied), then frequency (times the token's count)
    and presence (once) over the output tokens only."""
    x = logits.float().clone()
    seen = sorted(set(prompt_ids) | set(output_ids))
    if repetition != 1.0 and seen:
        picked = x[seen]
        x[seen] = torch.where(picked > 0, picked / repetition, picked * repetition)
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=x.numel()).float() \
        if output_ids else torch.zeros_like(x)
    x -= frequency * counts + presence * (counts > 0).float()
    return x


@torch.inference_mode()
def greedy_with_penalties(model, prompt_ids: list[int], max_tokens: int, repetition: float = 1.0,
                          presence: float = 0.0, frequency: float = 0.0) -> list[int]:
    """Argmax decoding, the whole context recomputed every step, each step's last logits penalized."""
    output: list[int] = []
    for _ in range(max_tokens):
        ids = torch.tensor([prompt_ids + output], device=_device(model))
        logits = model(input_ids=ids).logits[0, -1].cpu()
        output.append(int(penalize(logits, prompt_ids, output, repetition, presence, frequency).argmax()))
    return output


@torch.inference_mode()
def hf_generate_greedy(model, prompt_ids: list[int], max_new_tokens: int, **processors) -> list[int]:
    """transformers' generate(): do_sample=False with the given logits processors (repetition_penalty=...),
    exactly max_new_tokens tokens: no eos stops it and nothing bans eos."""
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                              pad_token_id=0, bos_token_id=None, **processors)
    ids = torch.tensor([prompt_ids], device=_device(model))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_ids):].tolist()


def hf_probabilities(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0) -> torch.Tensor:
    """transformers' warpers in vLLM's order (min_p, top_k, top_p) on logits / T ([rows, vocab] or one
    row), renormalized."""
    scores = logits.float().cpu() / temperature
    one_row = scores.dim() == 1
    if one_row:
        scores = scores[None]
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    probabilities = torch.softmax(scores, -1)
    return probabilities[0] if one_row else probabilities


def chi_square_p_value(samples: list[int], law: torch.Tensor) -> float:
    """Pearson's chi-square of token samples against `law` ([vocab] float64), the cells expecting fewer than
    5 pooled into one; its p-value. A sample where the law is 0 fails at once."""
    counts = torch.bincount(torch.tensor(samples), minlength=len(law)).double()
    assert counts[law == 0].sum() == 0
    expected = law * len(samples)
    big = expected >= 5
    observed = torch.cat([counts[big], counts[(law > 0) & ~big].sum().reshape(1)])
    expected = torch.cat([expected[big], expected[(law > 0) & ~big].sum().reshape(1)])
    statistic = ((observed - expected) ** 2 / expected.clamp(min=1e-12)).sum()
    return float(torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2, dtype=torch.float64), statistic / 2))


def drafted_position_law(first: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The second token's law under speculation and the rate its drafts are accepted: first [V] the first
    token's law, p [V, V] the target's law of the second given the first, q [V, V] the drafter's. The law is
    plain decoding's, first @ p; a draft drawn from q is accepted at sum over t1 of first(t1) sum_x min(p, q)."""
    return first @ p, float(first @ torch.minimum(p, q).sum(-1))


def assert_drafted_position_law(completions: list[list[int]], stats: dict, law: torch.Tensor, rate: float) -> None:
    """N three-token completions, each drafted for once at its second token (speculative decoding's law
    tests): every one drafted, some drafts accepted and some not, at `rate` within 4 standard deviations, and
    the second tokens following `law` (chi-square, p > 1e-3)."""
    n = len(completions)
    assert all(len(c) == 3 for c in completions)
    assert stats["spec_decode_num_drafts"] == stats["spec_decode_draft_tokens"] == n
    accepted = stats["spec_decode_accepted_tokens"]
    assert 0 < accepted < n
    assert abs(accepted / n - rate) < 4 * (rate * (1 - rate) / n) ** 0.5, (accepted / n, rate)
    assert chi_square_p_value([c[1] for c in completions], law) > 1e-3
