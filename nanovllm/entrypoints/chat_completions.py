"""POST /v1/chat/completions: the conversation through the tokenizer's chat template, n choices.
Streamed, each choice's first chunk carries the role, as OpenAI's do."""
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import JSONResponse, Response

from nanovllm.entrypoints.errors import APIError
from nanovllm.entrypoints.logprobs import TokenTexts, chat_logprobs
from nanovllm.entrypoints.protocol import ChatChoice, ChatCompletionChunk, ChatCompletionRequest, \
    ChatCompletionResponse, ChatLogprobs, ChatResponseMessage, ChatStreamChoice, DeltaMessage, UsageInfo
from nanovllm.entrypoints.server_state import Serving, new_id, now, outputs_of, stream_error
from nanovllm.entrypoints.streams import SSE_DONE, EventStream, sse


class _ChatCompletion:
    def __init__(self, serving: Serving, body: ChatCompletionRequest):
        engine = serving.engine
        self.body, self.texts = body, TokenTexts(engine.tokenizer)
        self.id, self.created, self.model = new_id("chatcmpl"), now(), serving.model_name
        try:
            prompt = engine.chat_prompt(body.conversation(), body.add_generation_prompt)
        except (ValueError, TypeError) as error:
            raise APIError(str(error), param="messages") from None
        defaults = engine.get_default_sampling_params()
        self.job = serving.job(prompt, lambda max_tokens: body.sampling_params(defaults, max_tokens, body.num_logprobs),
                               body.max_new_tokens)

    def logprobs(self, token_ids: list[int], logprobs: list | None) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return ChatLogprobs(content=chat_logprobs(self.texts, token_ids, logprobs or [], self.body.top_logprobs or 0))

    def usage(self, completion_tokens: int) -> UsageInfo:
        return UsageInfo.of(len(self.job.prompt_token_ids), completion_tokens)

    def response(self, final: dict) -> ChatCompletionResponse:
        choices = [ChatChoice(index=j, message=ChatResponseMessage(content=completion["text"]),
                              logprobs=self.logprobs(completion["token_ids"], completion["logprobs"]),
                              finish_reason=completion["finish_reason"], stop_reason=completion["stop_reason"])
                   for j, completion in enumerate(final["outputs"])]
        completion_tokens = sum(len(completion["token_ids"]) for completion in final["outputs"])
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage(completion_tokens))

    def chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                       usage=usage).model_dump_json())

    async def events(self, outputs: AsyncIterator) -> AsyncIterator[str]:
        completion_tokens = 0
        try:
            for j in range(self.body.n):
                yield self.chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=""))])
            async with aclosing(outputs):
                async for _, out in outputs:
                    for delta in out.deltas:
                        completion_tokens += len(delta.token_ids)
                        logprobs = self.logprobs(delta.token_ids, delta.logprobs)
                        if delta.text or delta.finish_reason or (logprobs and logprobs.content):
                            yield self.chunk([ChatStreamChoice(
                                index=delta.index, delta=DeltaMessage(content=delta.text), logprobs=logprobs,
                                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)])
            if self.body.include_usage:
                yield self.chunk([], self.usage(completion_tokens))
        except Exception as error:
            yield stream_error(error)
        yield SSE_DONE


async def create_chat_completion(serving: Serving, body: ChatCompletionRequest) -> Response:
    serving.check_model(body.model)
    request = _ChatCompletion(serving, body)
    first, rest = await serving.start(request.id, [request.job])
    outputs = outputs_of(first, rest)
    if body.stream:
        return EventStream(request.events(outputs), source=outputs)
    final = None
    async with aclosing(outputs):
        async for _, out in outputs:
            if out.finished:
                final = out.output
    return JSONResponse(request.response(final).model_dump())
