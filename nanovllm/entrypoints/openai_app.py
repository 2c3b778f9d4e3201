"""The OpenAI-compatible HTTP server as a FastAPI app over one AsyncLLM:

    POST /v1/completions, /v1/chat/completions (streamed as server-sent events with "stream": true)
    GET  /v1/models, /health, /metrics (Prometheus)
    POST /tokenize, /detokenize (vLLM's)

With an API key, every /v1 path wants `Authorization: Bearer KEY` (the others stay open, as in vLLM).
`build_app` only builds the app; `nanovllm serve` (serve_command.py) runs it."""
import hmac

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from nanovllm.entrypoints.chat_completions import create_chat_completion, render_prompt
from nanovllm.entrypoints.chat_protocol import ChatCompletionRequest, TokenizeRequest
from nanovllm.entrypoints.completions import create_completion
from nanovllm.entrypoints.errors import APIError, install_error_handlers
from nanovllm.entrypoints.metrics import CONTENT_TYPE, render_metrics
from nanovllm.entrypoints.protocol import CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard, \
    ModelList, TokenizeResponse
from nanovllm.entrypoints.server_state import ChatOptions, Serving, now
from nanovllm.entrypoints.streams import unless_disconnected


class APIKeyMiddleware:
    """Every /v1 path wants `Authorization: Bearer KEY` (vLLM's rule: the other paths stay open; a CORS
    preflight, OPTIONS, is let through). Checked here, before routing, so that a request without the key
    is a 401 whatever its body: a route's dependency would run only after FastAPI read and validated the
    body, answering a malformed one with 400 first and telling a stranger about the API."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not self._guarded(scope):
            return await self.app(scope, receive, send)
        given = Headers(scope=scope).get("authorization", "").encode()
        if not hmac.compare_digest(given, self.expected):     # in constant time: no guessing it byte by byte
            response = APIError("missing or wrong API key: send the header `Authorization: Bearer <key>`",
                                status=401, code="invalid_api_key").response()
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    @staticmethod
    def _guarded(scope: Scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        return path == "/v1" or path.startswith("/v1/")


def build_app(engine, served_model_name: str, api_key: str | None = None,
              chat_options: ChatOptions | None = None) -> FastAPI:
    """The app over `engine` (an AsyncLLM), answering to the model name `served_model_name`; chat answers
    parsed as `chat_options` say (tool calls, reasoning). `app.state.end_requests()` aborts every request in
    flight (a shutting-down server calls it)."""
    serving = Serving(engine, served_model_name, chat_options or ChatOptions())
    app = FastAPI(title="nanovllm", summary="an OpenAI-compatible server over nanovllm.AsyncLLM")
    app.state.end_requests = serving.in_flight.abort_all
    install_error_handlers(app)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    v1 = APIRouter(prefix="/v1")
    created = now()

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, created=created, root=str(engine.model),
                                         max_model_len=engine.max_model_len)])

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await unless_disconnected(request, create_completion(serving, body))

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await unless_disconnected(request, create_chat_completion(serving, body))

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if not getattr(engine, "is_running", True):
            raise APIError("the engine has stopped", status=503, type="server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(engine.stats(), served_model_name), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        serving.check_model(body.model)
        try:
            if body.messages is not None:
                conversation = [message.as_dict() for message in body.messages]
                tokens = render_prompt(engine, conversation, body)
            else:
                tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except (ValueError, TypeError) as error:
            raise APIError(str(error)) from None
        strs = engine.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens,
                                token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(body.model)
        vocab_size = len(engine.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))

    return app
