"""Log-probs of a prompt's own tokens (SamplingParams.prompt_logprobs): the logits of every prompt
position over the whole vocabulary, from the raw logits as every log-prob here, a slice of rows at a
time so that a long prompt's [tokens, vocab] float32 never exists at once."""
import torch

ROWS_PER_SLICE = 1024


def prompt_logprobs(lm_head, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                    k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """For the hidden states hidden[rows], each predicting the token in `targets`: (the target's log-prob
    [n], the k most likely ids [n, k], their log-probs [n, k]) on the first tensor-parallel rank; None on
    the others, which take part in the logits' gather."""
    parts = []
    for start in range(0, len(rows), ROWS_PER_SLICE):
        logits = lm_head.logits_of(hidden[rows[start:start + ROWS_PER_SLICE]])
        if logits is None:
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        target = logprobs.gather(1, targets[start:start + ROWS_PER_SLICE].unsqueeze(1)).squeeze(1)
        top = logprobs.topk(k, dim=1)
        parts.append((target, top.indices, top.values))
    if not parts:
        return None
    return tuple(torch.cat(column) for column in zip(*parts))
