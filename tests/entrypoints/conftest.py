"""Fixtures of the entrypoint tests: a fake engine with AsyncLLM's interface (for the app's unit tests,
no model needed), and a real `nanovllm serve` subprocess on the tiny checkpoint (started once per module)."""
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from nanovllm.sampling_params import SamplingParams

SERVER_START_TIMEOUT = 120.0
SERVER_ENGINE_ARGS = ["--device", "cpu", "--enforce-eager", "--max-model-len", "512",
                      "--kvcache-block-size", "16", "--num-kvcache-blocks", "512"]


# ---- a fake engine ------------------------------------------------------------------------------------
@dataclass
class FakeDelta:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class FakeOutput:
    request_id: str
    prompt_token_ids: list[int]
    deltas: list[FakeDelta]
    finished: bool
    prompt_logprobs: list | None = None
    output: dict | None = None


class FakeEngine:
    """AsyncLLM's interface over a byte-level tokenizer: completion j of a prompt spells
    f"{j}: the quick brown fox ..." one byte-token per output; log-probs are made up (the chosen token
    -0.5, then -1.5, -2.5, ... for the next ids). A prompt containing "refuse-later" is refused by
    generate() although check_request() passes it. Every request's end is recorded in `ended`. die(reason)
    plays the engine process's death: requests in flight and later ones raise EngineDeadError. `script`,
    when set, is what every completion spells instead, ending there with finish_reason "stop" (as on eos)."""
    TEXT = ": the quick brown fox jumps over the lazy dog. "

    def __init__(self, delay: float = 0.0, max_model_len: int = 64):
        from benchmarks.random_checkpoint import byte_level_tokenizer
        self.tokenizer = byte_level_tokenizer(512)
        self.model = "/models/fake"
        self.max_model_len = max_model_len
        self.delay = delay
        self.defaults = SamplingParams(temperature=0.7, top_p=0.9)
        self.requests: dict[str, SamplingParams] = {}     # every request generate() took, with its params
        self.ended: dict[str, str] = {}                   # request id -> "finished" | "aborted" | "closed"
        self.checks: list = []                            # the prompt of every check, as check_request got it
        self._abort: set[str] = set()
        self.is_running = True
        self.dead_reason: str | None = None
        self._dead_callbacks: list = []
        self.script: str | None = None

    def get_default_sampling_params(self) -> SamplingParams:
        return self.defaults

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None, continue_final_message: bool = False) -> list[int]:
        if not messages:
            raise ValueError("messages is empty")
        from nanovllm.engine.chat_template import render_chat
        return render_chat(self.tokenizer, "fake", messages, add_generation_prompt, tools, chat_template_kwargs,
                           continue_final_message)

    def check_request(self, prompt, params: SamplingParams) -> list[int]:
        self.checks.append(prompt)
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt has no tokens")
        if any(not 0 <= t < 512 for t in ids):
            raise ValueError("token id outside the vocabulary [0, 512)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room to generate within "
                             f"max_model_len={self.max_model_len}")
        return ids

    def _logprobs(self, token_id: int, k: int) -> dict[int, float]:
        entry = {(token_id + 1 + i) % 512: -1.5 - i for i in range(k)}
        entry[token_id] = -0.5
        return entry

    async def generate(self, prompt, params: SamplingParams, request_id: str, *,
                       checked_token_ids: list[int] | None = None):
        from nanovllm.async_llm import EngineDeadError
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead_reason}")
        ids = checked_token_ids if checked_token_ids is not None else self.check_request(prompt, params)
        if "refuse-later" in self.tokenizer.decode(ids):
            raise ValueError("refused by the engine")
        self.requests[request_id] = params
        texts = [self.script if self.script is not None else f"{j}{self.TEXT}" * 4 for j in range(params.n)]
        done = [False] * params.n
        made: list[list[int]] = [[] for _ in range(params.n)]
        prompt_logprobs = None
        if getattr(params, "prompt_logprobs", None) is not None:
            prompt_logprobs = [None] + [self._logprobs(t, params.prompt_logprobs) for t in ids[1:]]
        finals: list[dict] = [{} for _ in range(params.n)]
        try:
            step = 0
            while not all(done):
                await asyncio.sleep(self.delay)
                if self.dead_reason is not None:
                    raise EngineDeadError(f"the engine has stopped: {self.dead_reason}")
                deltas = []
                for j in range(params.n):
                    if done[j]:
                        continue
                    if request_id in self._abort:
                        done[j] = True
                        deltas.append(FakeDelta(j, [], "", None, "abort"))
                        finals[j] = dict(finish_reason="abort", stop_reason=None)
                        continue
                    token = self.tokenizer.encode(texts[j][step])[0]
                    made[j].append(token)
                    text = self.tokenizer.decode(made[j])
                    finish = stop_reason = None
                    hit = [s for s in params.stop if s in text]
                    if hit:
                        finish, stop_reason = "stop", hit[0]
                    elif len(made[j]) == params.max_tokens:
                        finish = "length"
                    elif len(made[j]) == len(texts[j]):
                        finish = "stop"
                    logprobs = [self._logprobs(token, params.logprobs)] if params.logprobs is not None else None
                    piece = texts[j][step] if not hit else ""
                    deltas.append(FakeDelta(j, [token], piece, logprobs, finish, stop_reason))
                    if finish:
                        done[j] = True
                        full = text[:text.index(hit[0])] if hit else text
                        finals[j] = dict(text=full, finish_reason=finish, stop_reason=stop_reason)
                step += 1
                finished = all(done)
                output = None
                if finished:
                    outputs = [{"text": finals[j].get("text", self.tokenizer.decode(made[j])), "token_ids": made[j],
                                "finish_reason": finals[j]["finish_reason"], "stop_reason": finals[j]["stop_reason"],
                                "logprobs": [self._logprobs(t, params.logprobs) for t in made[j]]
                                if params.logprobs is not None else None, "cumulative_logprob": None}
                               for j in range(params.n)]
                    output = {**outputs[0], "prompt_token_ids": ids, "prompt_logprobs": prompt_logprobs,
                              "outputs": outputs}
                yield FakeOutput(request_id, ids, deltas, finished, prompt_logprobs if step == 1 else None, output)
            self.ended[request_id] = "aborted" if request_id in self._abort else "finished"
        finally:
            self.ended.setdefault(request_id, "closed")

    async def abort(self, request_id: str) -> None:
        self._abort.add(request_id)

    def stats(self) -> dict:
        histogram = {"buckets": [0.01, 0.1, 1.0], "counts": [1, 2, 3], "sum": 1.5, "count": 4}
        return {"num_running": 1, "num_waiting": 2, "num_used_blocks": 3, "num_kvcache_blocks": 12,
                "prefix_cache_hit_rate": 0.25, "num_preemptions": 0, "prompt_tokens_total": 100,
                "generation_tokens_total": 50, "requests_finished_total": 7,
                "histograms": {"time_to_first_token_seconds": histogram, "inter_token_latency_seconds": histogram,
                               "e2e_request_latency_seconds": histogram}}

    def shutdown(self) -> None:
        self.is_running = False

    def on_dead(self, callback) -> None:
        self._dead_callbacks.append(callback)

    def die(self, reason: str) -> None:
        self.dead_reason, self.is_running = reason, False
        for callback in self._dead_callbacks:
            callback(reason)


@pytest.fixture
def fake_engine():
    return FakeEngine()


# ---- a real server ------------------------------------------------------------------------------------
# --port 0: the kernel picks a free port as the server binds it, and uvicorn says which. A port found free
# here and handed over would be free only until then: seconds of engine start-up, in which another xdist
# worker's server, engine (its rendezvous store) or client could take it, and then perhaps answer our
# health checks while this server fails to bind.
LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+) ")


class Server:
    """`python -m nanovllm.serve MODEL --port 0 ...` as a subprocess; its output goes to a log file."""
    ENGINE_ARGS = SERVER_ENGINE_ARGS

    def __init__(self, model: str, extra_args: list[str], log_path: Path, api_key: str | None = None,
                 threads: int | None = None):
        self.port: int | None = None        # and url: once the server listens (_wait_ready)
        self.url = ""
        self.api_key = api_key
        args = [sys.executable, "-m", "nanovllm.serve", str(model), "--port", "0", *extra_args]
        if api_key:
            args += ["--api-key", api_key]
        self.log_path = log_path
        self.log = open(log_path, "w")
        # as users run it: the tests' TRITON_INTERPRET (for kernel tests on CPU) would only slow it down
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        env["PYTHONUNBUFFERED"] = "1"
        if threads is not None:     # torch's threads in the server's processes (its engine's included)
            env["OMP_NUM_THREADS"] = str(threads)
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self) -> None:
        import httpx
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.output()}")
            if self.port is None and (listening := LISTENING.search(self.output())):
                self.port = int(listening[1])
                self.url = f"http://127.0.0.1:{self.port}"
            try:
                if self.port is not None and httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not start within {SERVER_START_TIMEOUT} s:\n{self.output()}")

    def descendants(self) -> set[int]:
        """The server's processes below it now (the engine's, ...), from /proc."""
        parents: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        found, frontier = set(), {self.process.pid}
        while frontier:
            frontier = {child for child, parent in parents.items() if parent in frontier} - found
            found |= frontier
        return found

    @staticmethod
    def alive(pid: int) -> bool:
        """Running (not gone, not a zombie)."""
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM, then (should it hang) SIGKILL for it and every process below it."""
        if self.process.poll() is None:
            below = self.descendants()
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                for pid in [self.process.pid, *below]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.process.wait(5)
        self.log.close()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    server = Server(tiny_model, SERVER_ENGINE_ARGS, tmp_path_factory.mktemp("server") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow_server(slow_model, tmp_path_factory):
    """A server whose steps are slow enough to leave a request mid-way (SLOW_MODEL_SHAPE)."""
    server = Server(slow_model, SERVER_ENGINE_ARGS, tmp_path_factory.mktemp("slow") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_server(tiny_model, tmp_path_factory):
    """A server that wants `Authorization: Bearer sesame`."""
    server = Server(tiny_model, SERVER_ENGINE_ARGS, tmp_path_factory.mktemp("keyed") / "server.log", api_key="sesame")
    yield server
    server.stop()


@pytest.fixture
def start_server(tiny_model, tmp_path, request):
    """start(engine_args=SERVER_ENGINE_ARGS, slow=False, model=None) -> a server of this test's own on the tiny
    checkpoint (slow: SLOW_MODEL_SHAPE's, for a test that kills or loads it; or `model`), stopped after the
    test."""
    servers = []

    def start(engine_args: list[str] = SERVER_ENGINE_ARGS, slow: bool = False, model: str | None = None) -> Server:
        model = model or (request.getfixturevalue("slow_model") if slow else tiny_model)
        servers.append(Server(model, engine_args, tmp_path / f"server{len(servers)}.log"))
        return servers[-1]
    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def start_module_server(tmp_path_factory):
    """start(model, engine_args, threads=None) -> a server of the module's own (any checkpoint, any flags),
    stopped after the module's last test."""
    servers = []

    def start(model: str, engine_args: list[str], threads: int | None = None) -> Server:
        log_path = tmp_path_factory.mktemp("module_server") / "server.log"
        servers.append(Server(model, engine_args, log_path, threads=threads))
        return servers[-1]
    yield start
    for server in servers:
        server.stop()
