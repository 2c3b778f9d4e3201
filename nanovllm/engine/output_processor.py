"""The one place where a request's tokens become what the user gets back: text, stop strings, finish
reasons, streamed deltas and LLM.generate's output dict, for LLM.generate (in its process) and for
AsyncLLM and the server (in theirs) alike.

The engine works in tokens: each step it reports, per completion, the tokens it gained, their log-probs
and whether it ended on eos, a stop token or its length (messages.CompletionUpdate). Here the tokens are
detokenized (detokenizer.py: one definition of the text, however the tokens are grouped) and stop strings
found; a completion that completes one ends here, and the caller tells the engine to stop computing it
(FinishCompletion). Streamed requests are detokenized as their tokens arrive; the others only where stop
strings need it, and otherwise once, at the end, in one call.
"""
from dataclasses import dataclass

from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.messages import CompletionUpdate
from nanovllm.sampling_params import SamplingParams


class OutputDict(dict):
    """LLM.generate's output dicts, whose keys read as attributes too, so that code written for vLLM's output
    objects (`out.outputs[0].text`, `out.prompt_token_ids`) runs on them unchanged; still plain dicts (equal to
    them, JSON as they are, pickled between processes)."""
    __slots__ = ()

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"an output has no {name!r}; it has {sorted(self)}") from None


@dataclass
class CompletionDelta:
    """What one of a request's n completions gained since the request's last output."""
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None        # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str | int
    prompt_token_ids: list[int]
    deltas: list[CompletionDelta]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None   # with the first output that has them
    output: dict | None = None      # once finished: what LLM.generate returns for this request


class _Completion:
    """One completion: its tokens, log-probs and text so far."""

    def __init__(self, detokenizer: IncrementalDetokenizer, wants_logprobs: bool):
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if wants_logprobs else None
        self.num_detokenized = 0        # tokens given to the detokenizer
        self.num_taken = 0              # tokens already in an output
        self.num_text_taken = 0         # characters already in an output
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Request:
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, stream: bool,
                 completions: list[_Completion]):
        self.prompt_token_ids, self.params, self.stream = prompt_token_ids, params, stream
        self.completions = completions
        self.changed: set[int] = set()          # completions with news since the last output
        self.prompt_logprobs: list | None = None
        self.prompt_logprobs_taken = False

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)


class OutputProcessor:
    """Requests' outputs from the engine's token updates. `process` takes a step's updates as they come;
    `take` folds whatever arrived for a request since its last output into one RequestOutput."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str | int, _Request] = {}

    def add_request(self, request_id: str | int, prompt_token_ids: list[int], params: SamplingParams,
                    stream: bool) -> None:
        """stream: outputs carry text deltas as tokens arrive (AsyncLLM); otherwise only the finished
        output matters, and text without stop strings is detokenized once, at the end."""
        completions = [_Completion(self._detokenizer(prompt_token_ids, params), params.logprobs is not None)
                       for _ in range(params.n)]
        self.requests[request_id] = _Request(prompt_token_ids, params, stream, completions)

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                      params.include_stop_str_in_output, params.skip_special_tokens,
                                      params.min_tokens)

    def process(self, updates: list[CompletionUpdate]) -> tuple[list, list[tuple]]:
        """Fold a step's updates in. Returns the request ids they touched (each once, in order) and the
        (request id, index) of completions that a stop string ended here: the engine must stop them.
        Updates for unknown requests (aborted, or left by their caller) and for completions that ended
        already (the engine runs a step or two past a stop string it has not heard of yet) are ignored."""
        touched: dict = {}
        stopped = []
        for update in updates:
            request = self.requests.get(update.request_id)
            if request is None:
                continue
            if update.prompt_logprobs is not None:
                request.prompt_logprobs = update.prompt_logprobs
                touched[update.request_id] = None
            completion = request.completions[update.index]
            if completion.finished:
                continue
            touched[update.request_id] = None
            request.changed.add(update.index)
            if self._extend(request, completion, update):
                stopped.append((update.request_id, update.index))
        return list(touched), stopped

    def _extend(self, request: _Request, completion: _Completion, update: CompletionUpdate) -> bool:
        """Add the update's tokens to the completion; True if a stop string ended it."""
        params = request.params
        start = len(completion.token_ids)
        completion.token_ids.extend(update.token_ids)
        if completion.logprobs is not None and update.logprobs is not None:
            completion.logprobs.extend(update.logprobs)
        if update.finish_reason is not None:
            completion.finish_reason, completion.stop_reason = update.finish_reason, update.stop_reason
        # eos and stop tokens stay in token_ids but are not text (as vLLM), unless asked
        shown = len(completion.token_ids)
        if (update.finish_reason == "stop" and not params.include_stop_str_in_output) and shown > start:
            shown -= 1
        if params.stop:
            # token by token, as min_tokens counts them: the text stops where a stop string completes
            for i in range(completion.num_detokenized, shown):
                stop = completion.detokenizer.append(completion.token_ids[i:i + 1])
                completion.num_detokenized = i + 1
                if stop is not None:
                    del completion.token_ids[i + 1:]
                    if completion.logprobs is not None:
                        del completion.logprobs[i + 1:]
                    completion.finish_reason, completion.stop_reason = "stop", stop
                    return True
        elif request.stream or completion.finished:
            completion.detokenizer.append(completion.token_ids[completion.num_detokenized:shown])
            completion.num_detokenized = max(completion.num_detokenized, shown)
        return False

    def abort(self, request_id: str | int) -> None:
        """End the request's unfinished completions with finish_reason "abort"; its next output is its last."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for index, completion in enumerate(request.completions):
            if not completion.finished:
                completion.finish_reason = "abort"
                request.changed.add(index)
                if not request.params.stop:     # its text so far (a streamed one has it already)
                    completion.detokenizer.append(completion.token_ids[completion.num_detokenized:])
                    completion.num_detokenized = len(completion.token_ids)

    def wants(self, update: CompletionUpdate) -> bool:
        """Whether process() would take the update's tokens (its completion is known and still running)."""
        request = self.requests.get(update.request_id)
        return request is not None and not request.completions[update.index].finished

    def forget(self, request_id: str | int) -> None:
        self.requests.pop(request_id, None)

    def is_finished(self, request_id: str | int) -> bool:
        request = self.requests.get(request_id)
        return request is None or request.finished

    def take(self, request_id: str | int) -> RequestOutput:
        """What the request gained since its last output, one delta per completion that changed; once it
        has finished, its output dict too, and the request is forgotten."""
        request = self.requests[request_id]
        deltas = [self._delta(index, request.completions[index], request.stream)
                  for index in sorted(request.changed)]
        request.changed.clear()
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_taken:
            prompt_logprobs, request.prompt_logprobs_taken = request.prompt_logprobs, True
        finished = request.finished
        output = RequestOutput(request_id, request.prompt_token_ids, deltas, finished, prompt_logprobs)
        if finished:
            output.output = self._final(request)
            del self.requests[request_id]
        return output

    @staticmethod
    def _delta(index: int, completion: _Completion, stream: bool) -> CompletionDelta:
        """The completion's new tokens and log-probs, and the new text that is final: short of a stop
        string that may still be forming (IncrementalDetokenizer.stable_length) until it has ended."""
        detokenizer = completion.detokenizer
        text = ""
        if stream:
            end = len(detokenizer.text) if completion.finished else detokenizer.stable_length
            if end > completion.num_text_taken:
                text = detokenizer.text_from(completion.num_text_taken)[:end - completion.num_text_taken]
                completion.num_text_taken = end
        before, completion.num_taken = completion.num_taken, len(completion.token_ids)
        logprobs = completion.logprobs[before:] if completion.logprobs is not None else None
        return CompletionDelta(index, completion.token_ids[before:], text, logprobs,
                               completion.finish_reason, completion.stop_reason)

    @staticmethod
    def _final(request: _Request) -> "OutputDict":
        """The finished request as LLM.generate returns it: its completions in order under "outputs", the
        first one's fields on top (keys readable as attributes: OutputDict)."""
        outputs = []
        for completion in request.completions:
            logprobs, cumulative = completion.logprobs, None
            if logprobs is not None:
                cumulative = sum(entry[token] for entry, token in zip(logprobs, completion.token_ids))
            outputs.append(OutputDict(text=completion.detokenizer.text, token_ids=completion.token_ids,
                                      finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                                      logprobs=logprobs, cumulative_logprob=cumulative))
        return OutputDict(**outputs[0], prompt_token_ids=request.prompt_token_ids,
                          prompt_logprobs=request.prompt_logprobs, outputs=outputs)
