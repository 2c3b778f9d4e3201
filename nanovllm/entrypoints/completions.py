"""POST /v1/completions: one prompt or several (texts or token ids), n completions each, all running at
once. Choice i * n + j is prompt i's completion j, as OpenAI numbers them.

`echo` puts the prompt in front of each choice's text (and, with `logprobs`, the prompt's tokens with
their log-probs in front of the completion's); `max_tokens=0` with `echo` gives the prompt alone. The
engine cannot generate nothing, so it generates one token that is dropped. response_format and
structured_outputs constrain each completion (structured_requests.py)."""
from collections.abc import AsyncIterator
from contextlib import aclosing
from types import SimpleNamespace

from fastapi.responses import JSONResponse, Response

from nanovllm.entrypoints.logprobs import TokenTexts, append_completion_logprobs
from nanovllm.entrypoints.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, \
    CompletionResponse, UsageInfo
from nanovllm.entrypoints.server_state import Job, Serving, new_id, now, outputs_of, stream_error
from nanovllm.entrypoints.streams import SSE_DONE, EventStream, sse
from nanovllm.entrypoints.structured_requests import requested_structured_outputs


class _Completions:
    """One request's state while its choices are built, streamed or not."""

    def __init__(self, serving: Serving, body: CompletionRequest):
        self.body, self.tokenizer = body, serving.engine.tokenizer
        self.id, self.created, self.model = new_id("cmpl"), now(), serving.model_name
        self.prompt_only = body.max_tokens == 0     # echo of the prompt and its log-probs, nothing else
        self.texts = TokenTexts(self.tokenizer)
        engine, defaults = serving.engine, serving.engine.get_default_sampling_params()
        echo_logprobs = body.logprobs if body.echo else None
        structured_outputs, _ = requested_structured_outputs(body)

        def make_params(max_tokens: int | None):
            return body.sampling_params(defaults, max_tokens, None if self.prompt_only else body.logprobs,
                                        prompt_logprobs=echo_logprobs, structured_outputs=structured_outputs)

        prompts = body.prompts
        # only a max_tokens the client sent must fit: the default (16) is capped to the room, as before
        checked = "max_tokens" if "max_tokens" in body.model_fields_set and not self.prompt_only else None
        self.jobs: list[Job] = [serving.job(p, make_params, 1 if self.prompt_only else body.max_tokens, checked)
                                for p in prompts]
        # what echo shows: the prompt as given, or its tokens' text
        self.echo_texts = [p if isinstance(p, str) else engine.tokenizer.decode(job.prompt_token_ids)
                           for p, job in zip(prompts, self.jobs)] if body.echo else None

    def choice(self, prompt_index: int, piece, prompt_logprobs: list | None, first: bool,
               offset: int) -> tuple[CompletionChoice, int]:
        """The choice made of `piece`: a completion's new tokens (an engine delta), or unstreamed the
        whole completion, both with index, text, token_ids, logprobs, finish_reason and stop_reason.
        `first`: the choice's first piece, where the echo goes; `offset`: where the piece's text starts
        in the choice's. Returns the choice and the offset after it."""
        body, job = self.body, self.jobs[prompt_index]
        text, token_ids, logprobs = piece.text, piece.token_ids, piece.logprobs
        finish_reason, stop_reason = piece.finish_reason, piece.stop_reason
        if self.prompt_only:
            text, token_ids = "", []
            finish_reason, stop_reason = (finish_reason and "length"), None
        out = CompletionLogprobs() if body.logprobs is not None else None
        if body.echo and first:
            prompt_text = self.echo_texts[prompt_index]
            if out is not None:
                entries = prompt_logprobs or [None] * len(job.prompt_token_ids)
                append_completion_logprobs(out, self.texts, job.prompt_token_ids, entries, offset)
            text, offset = prompt_text + text, offset + len(prompt_text)
        if out is not None:
            offset = append_completion_logprobs(out, self.texts, token_ids, logprobs or [None] * len(token_ids),
                                                offset)
        choice = CompletionChoice(index=prompt_index * body.n + piece.index, text=text, logprobs=out,
                                  finish_reason=finish_reason, stop_reason=stop_reason)
        return choice, offset

    def usage(self, completion_tokens: int) -> UsageInfo:
        prompt_tokens = sum(len(job.prompt_token_ids) for job in self.jobs)
        return UsageInfo.of(prompt_tokens, 0 if self.prompt_only else completion_tokens)

    def response(self, finals: list[dict]) -> CompletionResponse:
        choices, completion_tokens = [], 0
        for i, final in enumerate(finals):
            for j, completion in enumerate(final["outputs"]):
                piece = SimpleNamespace(**{**completion, "index": j})
                choice, _ = self.choice(i, piece, final.get("prompt_logprobs"), True, 0)
                choices.append(choice)
                completion_tokens += len(completion["token_ids"])
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=self.usage(completion_tokens))

    async def events(self, outputs: AsyncIterator) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}            # choice index -> text offset of its next token
        prompt_logprobs: dict[int, list] = {}
        completion_tokens = 0
        try:
            async with aclosing(outputs):
                async for i, out in outputs:
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[i] = out.prompt_logprobs
                    for delta in out.deltas:
                        index = i * self.body.n + delta.index
                        first = index not in offsets
                        choice, offsets[index] = self.choice(i, delta, prompt_logprobs.get(i), first,
                                                             offsets.get(index, 0))
                        completion_tokens += len(delta.token_ids)
                        if choice.text or choice.finish_reason or (choice.logprobs and choice.logprobs.tokens):
                            yield sse(self.chunk([choice]).model_dump_json())
            if self.body.include_usage:
                yield sse(self.chunk([], self.usage(completion_tokens)).model_dump_json())
        except Exception as error:
            yield stream_error(error)
        yield SSE_DONE

    def chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)


async def create_completion(serving: Serving, body: CompletionRequest) -> Response:
    serving.check_model(body.model)
    request = _Completions(serving, body)
    first, rest = await serving.start(request.id, request.jobs)
    outputs = outputs_of(first, rest)
    if body.stream:
        return EventStream(request.events(outputs), source=outputs)
    finals: list[dict | None] = [None] * len(request.jobs)
    async with aclosing(outputs):
        async for i, out in outputs:
            if out.finished:
                finals[i] = out.output
    return JSONResponse(request.response(finals).model_dump())
