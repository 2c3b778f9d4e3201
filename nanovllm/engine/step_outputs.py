"""A collected step, token by token: the sampled tokens' log-prob dicts and the prompt's, kept on their
sequences, and what the step tells each completion (messages.CompletionUpdate), for the OutputProcessor
in this process (LLM.generate) or in AsyncLLM's."""
from nanovllm.engine.messages import CompletionUpdate
from nanovllm.engine.sequence import Sequence


def completion_updates(collected: list[Sequence | None]) -> list[CompletionUpdate]:
    """What a step's collected tokens tell each completion (the rows' sequences; None: a prompt's chunk,
    which samples nothing): its new tokens, their log-probs, its end. A sequence that ended on eos comes
    back once more, a step late, and says nothing then."""
    updates = []
    for seq in collected:
        if seq is None or seq.finish_reported:
            continue
        sent = seq.num_reported_tokens
        known = seq.num_tokens - seq.num_pending_tokens - seq.num_prompt_tokens
        finished = seq.is_finished
        if known <= sent and not finished:
            continue
        start = seq.num_prompt_tokens
        prompt_logprobs = seq.prompt_logprobs if sent == 0 and seq.index == 0 else None
        updates.append(CompletionUpdate(
            seq.parent_id, seq.index, seq.token_ids[start + sent:start + known],
            seq.logprobs[sent:known] if seq.logprobs is not None else None,
            seq.finish_reason if finished else None, seq.stop_reason if finished else None, prompt_logprobs))
        seq.num_reported_tokens = known
        seq.finish_reported = finished
    return updates


def record_logprobs(awaiting: list[Sequence | None], token_ids: list[int], logprobs) -> None:
    """Each sampled token's log-prob dict ({token id: log-prob}: the sampled token and the k most likely,
    from the raw logits) for the rows whose sequences asked and still run."""
    sampled_logprobs, top_ids, top_logprobs = logprobs
    for row, seq in enumerate(awaiting):
        if seq is None or seq.is_finished or seq.logprobs is None:
            continue
        k = seq.sampling_params.logprobs
        entry = dict(zip(top_ids[row][:k], top_logprobs[row][:k]))
        entry[token_ids[row]] = sampled_logprobs[row]
        seq.logprobs.append(entry)
        seq.cumulative_logprob += sampled_logprobs[row]


def record_prompt_logprobs(seqs: list[Sequence], spans: list[tuple[int, int, int]], rows) -> None:
    """Each prompt token's log-prob dict ({token id: log-prob}: the token itself and the k most likely),
    from a prefill step's rows (see ModelRunner._prompt_logprobs): span i covers seqs[i]'s prompt tokens
    first..first + count - 1. A recomputed chunk (after preemption) writes the same places."""
    if rows is None:
        return
    targets, top_ids, top_logprobs = rows
    row = 0
    for seq, (first, count, k) in zip(seqs, spans):
        entries = seq.prompt_logprobs
        for j in range(count):
            entry = dict(zip(top_ids[row + j][:k], top_logprobs[row + j][:k]))
            entry[seq.token_ids[first + j]] = targets[row + j]
            entries[first + j] = entry
        row += count
