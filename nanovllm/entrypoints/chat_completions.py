"""POST /v1/chat/completions: the conversation (and tools) through the tokenizer's chat template, n
choices. A choice's text is split by chat_output.py into reasoning (the server's --reasoning-parser),
content and tool calls (tool_choice "auto" through --tool-call-parser; "required" and named functions forced
by a JSON schema, structured_requests.py). Streamed, each choice's first chunk carries the role, as
OpenAI's do, and the deltas add up to the non-streamed choice."""
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import JSONResponse, Response

from nanovllm.entrypoints.chat_output import ChatOutputParser, ParsedDelta, ParsedMessage
from nanovllm.entrypoints.chat_protocol import ChatChoice, ChatCompletionChunk, ChatCompletionRequest, \
    ChatCompletionResponse, ChatResponseMessage, ChatStreamChoice, ChatTemplateInputs, DeltaFunctionCall, \
    DeltaMessage, DeltaToolCall, FunctionCall, ToolCall
from nanovllm.entrypoints.errors import APIError
from nanovllm.entrypoints.logprobs import TokenTexts, chat_logprobs
from nanovllm.entrypoints.protocol import ChatLogprobs, UsageInfo
from nanovllm.entrypoints.reasoning_parsers import reasoning_parser
from nanovllm.entrypoints.server_state import Serving, new_id, now, outputs_of, stream_error
from nanovllm.entrypoints.streams import SSE_DONE, EventStream, sse
from nanovllm.entrypoints.structured_requests import chat_structured_outputs, tool_plan

PROMPT_TAIL_TOKENS = 16     # enough of the prompt's end to see whether the template opened a <think>


def render_prompt(engine, conversation: list[dict], inputs: ChatTemplateInputs) -> list[int]:
    """The prompt's token ids; tools, chat_template_kwargs, add_generation_prompt and continue_final_message
    go to the template."""
    return engine.chat_prompt(conversation, inputs.add_generation_prompt, inputs.template_tools(),
                              inputs.chat_template_kwargs, inputs.continue_final_message)


class _ChatCompletion:
    def __init__(self, serving: Serving, body: ChatCompletionRequest):
        engine, options = serving.engine, serving.chat_options
        self.body, self.texts, self.options = body, TokenTexts(engine.tokenizer), options
        self.id, self.created, self.model = new_id("chatcmpl"), now(), serving.model_name
        self.plan = tool_plan(body, options.enable_auto_tool_choice, options.tool_call_parser)
        structured_outputs = chat_structured_outputs(body, self.plan)
        try:
            prompt = render_prompt(engine, body.conversation(), body)
        except (ValueError, TypeError) as error:
            raise APIError(str(error), param="messages") from None
        defaults = engine.get_default_sampling_params()
        self.job = serving.job(prompt, lambda max_tokens: body.sampling_params(
            defaults, max_tokens, body.num_logprobs, structured_outputs=structured_outputs), body.max_new_tokens,
            body.max_new_tokens_param)
        self.prompt_text = ""      # what the reasoning parser reads of the prompt: its end, or all of it
        if options.reasoning_parser:
            ids = self.job.prompt_token_ids
            if not reasoning_parser(options.reasoning_parser).reads_whole_prompt:
                ids = ids[-PROMPT_TAIL_TOKENS:]
            # decoded as the engine's ReasoningGate decodes the prompt (special tokens kept), so both agree
            self.prompt_text = engine.tokenizer.decode(ids, skip_special_tokens=False)

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser.for_request(self.options.reasoning_parser, self.prompt_text, self.plan.mode,
                                            self.options.tool_call_parser, self.plan.function)

    def logprobs(self, token_ids: list[int], logprobs: list | None) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return ChatLogprobs(content=chat_logprobs(self.texts, token_ids, logprobs or [], self.body.top_logprobs or 0))

    def usage(self, completion_tokens: int) -> UsageInfo:
        return UsageInfo.of(len(self.job.prompt_token_ids), completion_tokens)

    def message(self, parsed: ParsedMessage) -> ChatResponseMessage:
        fields = {"content": parsed.content}
        if self.options.reasoning_parser:
            fields.update(reasoning=parsed.reasoning, reasoning_content=parsed.reasoning)
        if self.body.tools:
            fields["tool_calls"] = [
                ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                for call in parsed.tool_calls]
        return ChatResponseMessage(**fields)

    def response(self, final: dict) -> ChatCompletionResponse:
        choices = []
        for j, completion in enumerate(final["outputs"]):
            parser = self.parser()
            choices.append(ChatChoice(index=j, message=self.message(parser.parse(completion["text"])),
                                      logprobs=self.logprobs(completion["token_ids"], completion["logprobs"]),
                                      finish_reason=parser.finish_reason(completion["finish_reason"]),
                                      stop_reason=completion["stop_reason"]))
        completion_tokens = sum(len(completion["token_ids"]) for completion in final["outputs"])
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage(completion_tokens))

    def delta_message(self, parsed: ParsedDelta) -> DeltaMessage:
        reasoning = parsed.reasoning or None
        calls = [DeltaToolCall(index=call.index, id=call.id, type="function" if call.id else None,
                               function=DeltaFunctionCall(name=call.name, arguments=call.arguments))
                 for call in parsed.tool_calls]
        return DeltaMessage(content=parsed.content or None, reasoning=reasoning, reasoning_content=reasoning,
                            tool_calls=calls or None)

    def chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                       usage=usage).model_dump_json())

    async def events(self, outputs: AsyncIterator) -> AsyncIterator[str]:
        completion_tokens = 0
        parsers = [self.parser() for _ in range(self.body.n)]
        try:
            for j in range(self.body.n):
                yield self.chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=""))])
            async with aclosing(outputs):
                async for _, out in outputs:
                    for delta in out.deltas:
                        completion_tokens += len(delta.token_ids)
                        logprobs = self.logprobs(delta.token_ids, delta.logprobs)
                        parser = parsers[delta.index]
                        if parser.passthrough:
                            message, sent = DeltaMessage(content=delta.text), bool(delta.text)
                        else:
                            parsed = parser.feed(delta.text)
                            if delta.finish_reason:
                                rest = parser.finish()
                                parsed = ParsedDelta(parsed.reasoning + rest.reasoning, parsed.content + rest.content,
                                                     parsed.tool_calls + rest.tool_calls)
                            message, sent = self.delta_message(parsed), bool(parsed)
                        if sent or delta.finish_reason or (logprobs and logprobs.content):
                            yield self.chunk([ChatStreamChoice(
                                index=delta.index, delta=message, logprobs=logprobs,
                                finish_reason=parser.finish_reason(delta.finish_reason),
                                stop_reason=delta.stop_reason)])
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
