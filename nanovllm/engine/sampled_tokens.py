"""A step's sampled tokens (and log-probs) on their way from the device to the host (rank 0)."""
import torch

from nanovllm.layers.sampler import SamplerOutput


class SampledTokens:
    """A step's sampled token ids (and log-probs, if asked) on their way to the host: the copies are
    queued behind the step, and only reading them waits, so the host can launch the next step meanwhile."""

    def __init__(self, output: SamplerOutput, prompt_logprobs=None):
        self.ready = None
        # (spans, (target log-probs, top ids, top log-probs) or None), see ModelRunner._prompt_logprobs
        self.prompt_spans, prompt_tensors = prompt_logprobs or ([], None)
        tensors = [output.token_ids, output.logprobs, output.top_token_ids, output.top_logprobs,
                   *(prompt_tensors or (None, None, None))]
        if output.token_ids.is_cuda:
            self.host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
                t, non_blocking=True) for t in tensors]
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host = tensors

    def tolist(self) -> list[int]:
        """The token ids."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host[0].tolist()

    def logprobs(self) -> tuple[list[float], list[list[int]], list[list[float]]] | None:
        """Per row: the sampled token's log-prob, and the most likely tokens' ids and log-probs."""
        if self.host[1] is None:
            return None
        if self.ready is not None:
            self.ready.synchronize()
        return tuple(t.tolist() for t in self.host[1:4])

    def prompt_logprobs(self) -> tuple[list[tuple[int, int, int]], tuple[list, list, list] | None]:
        """(spans, rows): per sequence that asked, (first prompt index, count, k); the rows' target
        log-probs, top ids and top log-probs, the spans' rows one after another."""
        if self.host[4] is None:
            return self.prompt_spans, None
        if self.ready is not None:
            self.ready.synchronize()
        return self.prompt_spans, tuple(t.tolist() for t in self.host[4:])
