"""What the user gets back: log-prob dicts as tokens arrive, stop strings found in the growing text
(only for requests that have them), and each request's output dict with its n completions, whose text is
detokenized in the prompt's context the same way with or without stop strings (detokenizer.py)."""
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.sequence import Sequence


class OutputProcessor:

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @staticmethod
    def record_logprobs(awaiting: list[Sequence | None], token_ids: list[int], logprobs) -> None:
        """Each sampled token's log-prob dict ({token id: log-prob}: the sampled token and the k most
        likely, from the raw logits) for the rows whose sequences asked and still run."""
        sampled_logprobs, top_ids, top_logprobs = logprobs
        for row, seq in enumerate(awaiting):
            if seq is None or seq.is_finished or seq.logprobs is None:
                continue
            k = seq.sampling_params.logprobs
            entry = dict(zip(top_ids[row][:k], top_logprobs[row][:k]))
            entry[token_ids[row]] = sampled_logprobs[row]
            seq.logprobs.append(entry)
            seq.cumulative_logprob += sampled_logprobs[row]

    def detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        """seq's text as its tokens arrive: the one place a completion's text is defined (detokenizer.py)."""
        params = seq.sampling_params
        return IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.stop,
                                      params.include_stop_str_in_output, params.skip_special_tokens,
                                      params.min_tokens)

    @staticmethod
    def record_prompt_logprobs(seqs: list[Sequence], spans: list[tuple[int, int, int]], rows) -> None:
        """Each prompt token's log-prob dict ({token id: log-prob}: the token itself and the k most likely),
        from a prefill step's rows (see ModelRunner._prompt_logprobs): span i covers seqs[i]'s prompt
        tokens first..first + count - 1. A recomputed chunk (after preemption) writes the same places."""
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

    def stop_check(self, seq: Sequence) -> bool:
        """Feed seq's newly known tokens to its detokenizer; True when they completed a stop string."""
        if seq.detokenizer is None:
            seq.detokenizer = self.detokenizer(seq)
        known = seq.num_tokens - seq.num_pending_tokens
        new = seq.token_ids[seq.num_prompt_tokens + seq.detokenizer.num_tokens:known]
        stop = seq.detokenizer.append(new)
        if stop is not None:
            seq.stop_reason = stop
        return stop is not None

    def completion(self, seq: Sequence) -> dict:
        params, token_ids = seq.sampling_params, seq.completion_token_ids
        # eos and stop tokens stay in token_ids but not in the text (as vLLM), unless asked
        hidden = (seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
                  and not params.include_stop_str_in_output)
        shown = len(token_ids) - 1 if hidden else len(token_ids)
        # Requests without stop strings had no detokenizer while they ran: theirs reads all their tokens
        # in one call, which gives the text token-by-token calls would (detokenizer.py says why).
        detokenizer = seq.detokenizer or self.detokenizer(seq)
        detokenizer.append(token_ids[detokenizer.num_tokens:shown])    # ignored past a stop string
        return {"text": detokenizer.text, "token_ids": token_ids, "finish_reason": seq.finish_reason,
                "stop_reason": seq.stop_reason, "logprobs": seq.logprobs,
                "cumulative_logprob": seq.cumulative_logprob if seq.logprobs is not None else None}

    def request_output(self, seqs: list[Sequence]) -> dict:
        """One request's output: its completions in order under "outputs", the first one's fields on top."""
        seqs = sorted(seqs, key=lambda s: s.index)
        outputs = [self.completion(seq) for seq in seqs]
        return {**outputs[0], "prompt_token_ids": seqs[0].prompt_token_ids,
                "prompt_logprobs": seqs[0].prompt_logprobs, "outputs": outputs}
