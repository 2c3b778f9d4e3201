"""`nanovllm chat`: a conversation in the terminal, the reply printed as its tokens come.

    nanovllm chat                       # the default model (SmolLM2-135M-Instruct), in this process
    nanovllm chat MODEL [LLM options]   # any checkpoint directory, in this process (an AsyncLLM)
    nanovllm chat --url http://127.0.0.1:8000 [--api-key KEY]    # a running `nanovllm serve` (or any
                                                                 # OpenAI-compatible server)

The conversation is kept and sent whole each turn. `/reset` starts it over, `/exit` (or Ctrl-D) quits;
Ctrl-C stops a reply (that turn is forgotten), or quits at the prompt.
"""
import argparse
import asyncio
import dataclasses
import itertools
import json
import signal
import sys
import urllib.error
import urllib.request
from collections.abc import Callable

from nanovllm.config import Config
from nanovllm.utils.cli_args import add_dataclass_options, dataclass_kwargs

SAMPLING_OPTIONS = {"temperature": float, "top_p": float, "top_k": int, "max_tokens": int, "seed": int}


class ChatError(Exception):
    """A turn that could not be answered (the message says why); the chat goes on."""


class LocalChat:
    """Replies from an AsyncLLM in this process, on an event loop of its own run one turn at a time."""

    def __init__(self, engine):
        self.engine = engine
        self.name = engine.model
        self.loop = asyncio.new_event_loop()
        self._ids = itertools.count()

    def reply(self, messages: list[dict], sampling: dict, on_text: Callable[[str], None]) -> str:
        engine = self.engine
        try:
            prompt = engine.chat_prompt(messages)
            max_tokens = sampling.get("max_tokens") or engine.max_model_len - len(prompt)
            params = dataclasses.replace(engine.get_default_sampling_params(), **{**sampling, "max_tokens": max_tokens})
        except (ValueError, TypeError) as error:
            raise ChatError(str(error)) from None
        task = self.loop.create_task(self._generate(prompt, params, on_text))
        # Ctrl-C cancels the turn's task: leaving its `async for` aborts the request in the engine
        self.loop.add_signal_handler(signal.SIGINT, task.cancel)
        try:
            return self.loop.run_until_complete(task)
        except asyncio.CancelledError:
            raise KeyboardInterrupt from None
        except (ValueError, TypeError) as error:
            raise ChatError(str(error)) from None
        finally:
            self.loop.remove_signal_handler(signal.SIGINT)

    async def _generate(self, prompt: list[int], params, on_text: Callable[[str], None]) -> str:
        pieces = []
        async for out in self.engine.generate(prompt, params, f"chat-{next(self._ids)}"):
            for delta in out.deltas:
                if delta.text:
                    on_text(delta.text)
                    pieces.append(delta.text)
        return "".join(pieces)

    def close(self) -> None:
        self.loop.close()
        self.engine.shutdown()


class RemoteChat:
    """Replies from an OpenAI-compatible server, streamed over HTTP (the standard library's client: the
    chat needs no extra package)."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None):
        url = url.rstrip("/")
        self.base = url if url.endswith("/v1") else f"{url}/v1"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.name = model or self._first_model()

    def _open(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers=self.headers)
        try:
            return urllib.request.urlopen(request)
        except urllib.error.HTTPError as error:
            try:
                message = json.loads(error.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = str(error)
            raise ChatError(f"the server answered {error.code}: {message}") from None
        except urllib.error.URLError as error:
            raise ChatError(f"cannot reach {self.base}: {error.reason}") from None

    def _first_model(self) -> str:
        with self._open("/models") as response:
            models = json.load(response)["data"]
        if not models:
            raise ChatError(f"{self.base} serves no model")
        return models[0]["id"]

    def reply(self, messages: list[dict], sampling: dict, on_text: Callable[[str], None]) -> str:
        body = {"model": self.name, "messages": messages, "stream": True, **sampling}
        pieces = []
        # Ctrl-C lands in the read below; closing the response (leaving `with`) drops the connection,
        # and the server aborts the request
        with self._open("/chat/completions", body) as response:
            for line in response:
                line = line.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise ChatError(event["error"].get("message", str(event["error"])))
                for choice in event.get("choices", []):
                    text = (choice.get("delta") or {}).get("content")
                    if text and choice.get("index", 0) == 0:
                        on_text(text)
                        pieces.append(text)
        return "".join(pieces)

    def close(self) -> None:
        pass


def converse(backend, sampling: dict, system: str | None = None, read: Callable[[str], str] = input,
             out=sys.stdout) -> None:
    """The read-reply loop, until /exit, end of input or Ctrl-C at the prompt."""
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    while True:
        try:
            line = read("> ").strip()
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            messages = list(start)
            write("(the conversation starts over)\n")
            continue
        if line.startswith("/"):
            write(f"unknown command {line.split()[0]}: /reset starts over, /exit quits\n")
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = backend.reply(messages, sampling, write)
        except KeyboardInterrupt:
            write("\n(stopped; that turn is forgotten)\n")
            messages.pop()
            continue
        except ChatError as error:
            write(f"\nerror: {error}\n")
            messages.pop()
            continue
        write("\n")
        messages.append({"role": "assistant", "content": reply})


def build_parser(prog: str = "nanovllm chat") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("model", nargs="?", help="a checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--url", help="chat with this server instead of a model in this process")
    parser.add_argument("--api-key", help="the server's API key (with --url)")
    parser.add_argument("--model-name", help="the model to ask the server for (default: the first it serves)")
    parser.add_argument("--system", help="a system message to start the conversation with")
    group = parser.add_argument_group("sampling (default: the model's generation_config.json)")
    for name, kind in SAMPLING_OPTIONS.items():
        group.add_argument(f"--{name.replace('_', '-')}", type=kind, metavar=kind.__name__.upper())
    add_dataclass_options(parser, Config, "engine, for a model in this process (any LLM argument)", skip=("model",))
    return parser


def main(argv: list[str] | None = None, prog: str = "nanovllm chat") -> None:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    llm_kwargs = dataclass_kwargs(args, Config, skip=("model",))
    sampling = {name: getattr(args, name) for name in SAMPLING_OPTIONS if getattr(args, name) is not None}
    try:
        if args.url:
            if args.model or llm_kwargs:
                parser.error("--url chats with a server: give no MODEL or engine options with it")
            backend = RemoteChat(args.url, args.api_key, args.model_name)
        else:
            from nanovllm import AsyncLLM
            from nanovllm.utils.gguf_checkpoint import default_model
            backend = LocalChat(AsyncLLM(args.model or default_model(), **llm_kwargs))
    except (ChatError, ValueError, TypeError, FileNotFoundError) as error:
        parser.exit(1, f"{prog}: error: {error}\n")
    try:
        print(f"Chatting with {backend.name}. /reset starts over, /exit or Ctrl-D quits, Ctrl-C stops a reply.",
              file=sys.stderr)
        converse(backend, sampling, args.system)
    finally:
        backend.close()


if __name__ == "__main__":
    main()
