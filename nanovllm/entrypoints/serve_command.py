"""`nanovllm serve MODEL`: the OpenAI-compatible server (openai_app.py) under uvicorn.

    nanovllm serve MODEL [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME]
                         [--enable-auto-tool-choice --tool-call-parser {hermes,llama3_json}]
                         [every LLM argument: --max-model-len 8192 --reasoning-parser qwen3 ...]

The engine starts first (a bad argument or model fails here, before any port is bound). SIGTERM or
Ctrl-C: the server stops accepting connections, ends the requests in flight (each finishes with
finish_reason "abort", so its response ends normally), stops the engine process and exits (code 0).
If the engine process dies, the requests in flight fail at once (a 503 in OpenAI's error shape, or in a
stream an error event, then [DONE]), the log says why, and the server stops the same way and exits with
code 1, for a supervisor to restart it: a server without its engine would only answer 503s.
"""
import argparse
import asyncio
import logging
import signal
import sys

from nanovllm.config import Config
from nanovllm.entrypoints.tool_parsers import TOOL_PARSERS
from nanovllm.utils.cli_args import add_dataclass_options, dataclass_kwargs

# seconds a request in flight has to finish once aborted, before uvicorn cancels it
GRACEFUL_SHUTDOWN_SECONDS = 5
ENGINE_DEAD_EXIT_CODE = 1

logger = logging.getLogger("nanovllm.serve")


def build_parser(prog: str = "nanovllm serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Serve MODEL over an OpenAI-compatible HTTP API: "
                                     "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, "
                                     "/tokenize, /detokenize.")
    parser.add_argument("model", help="a Hugging Face checkpoint directory")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="the address to bind (default: %(default)s; "
                        "0.0.0.0 for every interface)")
    server.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    server.add_argument("--api-key", help="if set, /v1 requests need `Authorization: Bearer KEY`")
    server.add_argument("--served-model-name", help="the model's name in the API (default: MODEL as given)")
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='tool_choice "auto" (the default with tools): tool calls parsed from what the model '
                        "writes, by --tool-call-parser")
    server.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                        help="how the model writes tool calls (hermes: Qwen2.5/Qwen3's <tool_call> blocks; "
                        "llama3_json: Llama 3's JSON)")
    add_dataclass_options(parser, Config, "engine (any LLM argument)", skip=("model",))
    return parser


def _serve(app, engine, host: str, port: int, log_level: str) -> str | None:
    """Run the app until SIGTERM, Ctrl-C or the engine's death; returns why the engine died, if it did."""
    import uvicorn

    class Server(uvicorn.Server):
        engine_died: str | None = None

        async def startup(self, sockets=None) -> None:
            loop = asyncio.get_running_loop()

            def died(reason: str) -> None:      # called in the loop's thread, or any other: hop to the loop
                try:
                    loop.call_soon_threadsafe(self.stop_without_engine, reason)
                except RuntimeError:            # the loop is closed: the server has stopped already
                    pass
            engine.on_dead(died)
            await super().startup(sockets)

        def stop_without_engine(self, reason: str) -> None:
            if self.engine_died is None:
                self.engine_died = reason
                logger.error("the engine process died (%s); the server stops and exits with code %d",
                             reason, ENGINE_DEAD_EXIT_CODE)
                self.should_exit = True

        async def shutdown(self, sockets=None) -> None:
            for server in self.servers:     # stop accepting first, then end what runs
                server.close()
            await app.state.end_requests()
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
    server = Server(config)
    server.run()
    return server.engine_died


def main(argv: list[str] | None = None, prog: str = "nanovllm serve") -> None:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    try:
        from nanovllm.entrypoints.openai_app import build_app
    except ImportError as error:
        if (error.name or "").split(".")[0] not in ("fastapi", "starlette", "pydantic", "uvicorn"):
            raise
        parser.error(f"{error}; the server needs the serve extra: pip install 'nano-vllm[serve]'")
    from nanovllm import AsyncLLM
    from nanovllm.entrypoints.server_state import ChatOptions

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM ends the process through `finally` blocks (its default action skips them and leaves the
    # engine process behind): while the engine starts, and when uvicorn, done, re-raises the signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        engine = AsyncLLM(args.model, **dataclass_kwargs(args, Config, skip=("model",)))
    except (ValueError, TypeError, FileNotFoundError) as error:
        parser.error(str(error))
    engine_died = None
    try:
        options = ChatOptions(args.enable_auto_tool_choice, args.tool_call_parser,
                              getattr(args, "reasoning_parser", None))     # the engine's, when given
        app = build_app(engine, args.served_model_name or args.model, args.api_key, options)
        engine_died = _serve(app, engine, args.host, args.port, args.log_level)
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    if engine_died is not None:
        sys.exit(ENGINE_DEAD_EXIT_CODE)


if __name__ == "__main__":
    main()
