"""AsyncLLM: the engine for servers. Requests come and go while others run (continuous batching across
callers); each request's outputs stream as they are computed.

    engine = AsyncLLM(model_dir, **llm_kwargs)
    async for out in engine.generate(prompt, sampling_params, request_id):
        for delta in out.deltas: print(delta.text, end="")

The engine steps in a process of its own (engine/engine_core.py); this process keeps the tokenizer,
turns token ids into text, and wakes each caller. A caller that reads slower than the engine computes
gets several steps' tokens in one output: the engine never waits for it.
"""
import asyncio
import itertools
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.engine_core import run_engine_core
from nanovllm.engine.request_check import RequestLimits, checked_request
from nanovllm.engine.tensor_parallel import refuse_in_spawn_bootstrap
from nanovllm.llm import default_sampling_params, render_chat
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.histogram import Histogram

START_TIMEOUT = 1800.0      # seconds for the engine to load and warm up (a large checkpoint, a cold cache)
EXCEPTIONS = {cls.__name__: cls for cls in (ValueError, TypeError, FileNotFoundError)}


@dataclass
class CompletionDelta:
    """What one of a request's n completions gained since the request's last output."""
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None        # "stop" | "length" once finished
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    deltas: list[CompletionDelta]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None   # with the first output that has them
    output: dict | None = None      # once finished: what LLM.generate returns for this request


@dataclass
class _Completion:
    """One completion as this process knows it: its tokens so far and its text."""
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    num_detokenized: int = 0        # tokens given to the detokenizer
    num_text_sent: int = 0          # characters of its text already in a delta
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Request:
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, arrival: float):
        self.prompt_token_ids, self.params, self.arrival = prompt_token_ids, params, arrival
        self.arrivals: list = []            # engine deltas not yet turned into an output
        self.ready = asyncio.Event()
        self.error: BaseException | None = None
        self.aborted = False
        self.prompt_logprobs: list | None = None
        self.last_token_time: float | None = None
        self.num_finished = 0


class AsyncLLM:
    """The engine in its own process, driven from asyncio. `generate` yields RequestOutputs; leaving its
    `async for` early aborts the request."""

    def __init__(self, model: str, **llm_kwargs):
        refuse_in_spawn_bootstrap()
        Config.check_arguments(llm_kwargs)
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(target=run_engine_core, args=(child_conn, model, llm_kwargs),
                                    name="nanovllm-engine")
        self._process.start()
        child_conn.close()          # ours closed: the engine's death reads as EOF here
        self._closed = False
        self._send_lock = threading.Lock()
        try:
            info = self._wait_ready()
        except BaseException:
            self._stop_process()
            raise
        self.model: str = info["model"]
        self.max_model_len: int = info["max_model_len"]
        self.limits = RequestLimits(info["vocab_size"], info["max_model_len"], info["kvcache_block_size"],
                                    info["num_kvcache_blocks"])
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self._requests: dict[str, _Request] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None       # why the engine is gone, once it is
        self._request_counter = itertools.count()
        self._stats: dict = {"num_running": 0, "num_waiting": 0, "num_used_blocks": 0,
                             "num_kvcache_blocks": self.limits.num_blocks, "prefix_cache_hit_rate": 0.0,
                             "num_preemptions": 0}
        self.prompt_tokens_total = self.generation_tokens_total = self.requests_finished_total = 0
        self.histograms = {"time_to_first_token_seconds": Histogram.latency(),
                           "inter_token_latency_seconds": Histogram.latency(),
                           "e2e_request_latency_seconds": Histogram.latency(longest=600.0)}
        self._reader = threading.Thread(target=self._read, name="nanovllm-engine-reader", daemon=True)
        self._reader.start()

    # ---- the engine process ----------------------------------------------------------------------------
    def _wait_ready(self) -> dict:
        deadline = time.monotonic() + START_TIMEOUT
        while not self._conn.poll(0.1):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine process exited while starting (exit code {self._process.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine did not start within {START_TIMEOUT:.0f} s")
        message = self._conn.recv()
        if message[0] == "ready":
            return message[1]
        _, name, text = message
        raise EXCEPTIONS.get(name, RuntimeError)(text)

    def _send(self, message: tuple) -> None:
        if self._dead is not None:
            raise RuntimeError(f"the engine has stopped: {self._dead}")
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        """The reader thread: every engine message is handed to the event loop as it comes."""
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "outputs" and message[2] is not None:
                    self._stats = message[2]        # read by stats() from any thread: one assignment
                elif message[0] == "stats":
                    self._stats = message[1]
                    continue
                self._call_in_loop(self._dispatch, message)
                if message[0] == "fatal":
                    return
        except (EOFError, OSError):
            if not self._closed:
                self._call_in_loop(self._dispatch, ("fatal", "RuntimeError", "the engine process exited"))

    def _call_in_loop(self, callback, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            callback(*args)         # nobody awaits yet (or any more): no loop to hop to
        else:
            try:
                loop.call_soon_threadsafe(callback, *args)
            except RuntimeError:    # the loop closed between the check and the call
                callback(*args)

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            now = time.monotonic()
            for delta in message[1]:
                request = self._requests.get(delta[0])
                if request is None:             # aborted here, its last tokens still on the way
                    continue
                self._time(request, delta, now)
                request.arrivals.append(delta)
                request.ready.set()
        elif kind == "error":
            _, request_id, name, text = message
            request = self._requests.get(request_id)
            if request is not None:
                request.error = EXCEPTIONS.get(name, RuntimeError)(text)
                request.ready.set()
        elif kind == "fatal":
            self._dead = f"{message[1]}: {message[2]}"
            for request in self._requests.values():
                request.error = RuntimeError(f"the engine has stopped: {self._dead}")
                request.ready.set()

    def _time(self, request: _Request, delta: tuple, now: float) -> None:
        """Metrics as the tokens reach this process: time to first token, between tokens, end to end."""
        num_new = len(delta[2])
        if num_new:
            self.generation_tokens_total += num_new
            if request.last_token_time is None:
                self.histograms["time_to_first_token_seconds"].observe(now - request.arrival)
            elif delta[1] == 0:     # one completion's pace stands for the request's
                self.histograms["inter_token_latency_seconds"].observe((now - request.last_token_time) / num_new)
            if delta[1] == 0 or request.last_token_time is None:
                request.last_token_time = now
        if delta[4] is not None:
            request.num_finished += 1
            if request.num_finished == request.params.n:
                self.requests_finished_total += 1
                self.histograms["e2e_request_latency_seconds"].observe(now - request.arrival)

    # ---- requests ----------------------------------------------------------------------------------------
    def check_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> list[int]:
        """The prompt's token ids; raises ValueError/TypeError where LLM.generate would refuse it."""
        return checked_request(self.tokenizer, prompt, sampling_params, self.limits)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """One conversation's prompt token ids, through the tokenizer's chat template."""
        return render_chat(self.tokenizer, self.model, messages, add_generation_prompt)

    def get_default_sampling_params(self) -> SamplingParams:
        return default_sampling_params(self.model)

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as its tokens come; the last has finished=True and the whole output.
        Raises ValueError/TypeError (before yielding) for a request the engine refuses."""
        if request_id is None:
            request_id = f"request-{next(self._request_counter)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        token_ids = self.check_request(prompt, sampling_params)
        self._loop = asyncio.get_running_loop()
        request = _Request(token_ids, sampling_params, time.monotonic())
        completions = [_Completion(IncrementalDetokenizer(
            self.tokenizer, token_ids, sampling_params.stop, sampling_params.include_stop_str_in_output,
            sampling_params.skip_special_tokens, sampling_params.min_tokens),
            logprobs=[] if sampling_params.logprobs is not None else None) for _ in range(sampling_params.n)]
        self._requests[request_id] = request
        finished = False
        try:
            self._send(("add", request_id, token_ids, sampling_params))
            self.prompt_tokens_total += len(token_ids)
            while not finished:
                await request.ready.wait()
                request.ready.clear()
                if request.error is not None:
                    raise request.error
                arrivals, request.arrivals = request.arrivals, []
                output = self._output(request_id, request, completions, arrivals)
                finished = output.finished
                yield output
        finally:
            del self._requests[request_id]
            if not finished and not request.aborted and self._dead is None and not self._closed:
                self._send(("abort", request_id))     # the caller left early: free its blocks

    def _output(self, request_id: str, request: _Request, completions: list[_Completion],
                arrivals: list[tuple]) -> RequestOutput:
        """Fold the engine's deltas (one per step and completion) into one delta per completion."""
        prompt_logprobs = None
        touched: dict[int, int] = {}        # completion index -> tokens it had before these arrivals
        for _, index, token_ids, logprobs, finish_reason, stop_reason, step_prompt_logprobs in arrivals:
            completion = completions[index]
            touched.setdefault(index, len(completion.token_ids))
            completion.token_ids.extend(token_ids)
            if logprobs is not None and completion.logprobs is not None:
                completion.logprobs.extend(logprobs)
            if finish_reason is not None:
                completion.finish_reason, completion.stop_reason = finish_reason, stop_reason
            if step_prompt_logprobs is not None:
                prompt_logprobs = step_prompt_logprobs
        if request.aborted:         # its last output: what is unfinished ends here
            for index, completion in enumerate(completions):
                if completion.finish_reason is None:
                    completion.finish_reason = "abort"
                    touched.setdefault(index, len(completion.token_ids))
        deltas = [self._delta(index, completions[index], request.params, before)
                  for index, before in sorted(touched.items())]
        finished = all(c.finish_reason is not None for c in completions)
        output = RequestOutput(request_id, request.prompt_token_ids, deltas, finished, prompt_logprobs)
        if prompt_logprobs is not None:
            request.prompt_logprobs = prompt_logprobs
        if finished:
            output.output = self._final(request, completions)
        return output

    @staticmethod
    def _delta(index: int, completion: _Completion, params: SamplingParams, before: int) -> CompletionDelta:
        """Detokenize what arrived (as OutputProcessor does: eos and stop tokens are not text); the text sent
        stops short of a stop string that may still be forming (IncrementalDetokenizer.stable_length)."""
        detokenizer, done = completion.detokenizer, completion.finish_reason is not None
        shown = len(completion.token_ids)
        if done and completion.finish_reason == "stop" and not isinstance(completion.stop_reason, str) \
                and not params.include_stop_str_in_output:
            shown -= 1          # eos or a stop token: in token_ids, not in the text (as LLM.generate)
        if params.stop:     # token by token, as the engine looked for them (min_tokens counts tokens)
            for token_id in completion.token_ids[completion.num_detokenized:shown]:
                detokenizer.append([token_id])
        elif shown > completion.num_detokenized:
            detokenizer.append(completion.token_ids[completion.num_detokenized:shown])
        completion.num_detokenized = max(completion.num_detokenized, shown)
        end = detokenizer.stable_length if not done else len(detokenizer.text)
        new_text = detokenizer.text_from(completion.num_text_sent)[:end - completion.num_text_sent] \
            if end > completion.num_text_sent else ""
        completion.num_text_sent = max(completion.num_text_sent, end)
        logprobs = completion.logprobs[before:] if completion.logprobs is not None else None
        return CompletionDelta(index, completion.token_ids[before:], new_text, logprobs,
                               completion.finish_reason, completion.stop_reason)

    @staticmethod
    def _final(request: _Request, completions: list[_Completion]) -> dict:
        """The finished request as LLM.generate returns it."""
        outputs = []
        for completion in completions:
            logprobs = completion.logprobs
            cumulative = None
            if logprobs is not None:
                cumulative = sum(entry[token] for entry, token in zip(logprobs, completion.token_ids))
            outputs.append({"text": completion.detokenizer.text, "token_ids": completion.token_ids,
                            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                            "logprobs": logprobs, "cumulative_logprob": cumulative})
        return {**outputs[0], "prompt_token_ids": request.prompt_token_ids,
                "prompt_logprobs": request.prompt_logprobs, "outputs": outputs}

    async def abort(self, request_id: str) -> None:
        """Stop a request now: the engine frees its blocks before its next step, and the request's
        `generate` ends with one more output, finished, its unfinished completions' reason "abort"."""
        request = self._requests.get(request_id)
        if request is None or request.aborted:
            return
        request.aborted = True
        self._send(("abort", request_id))
        request.ready.set()

    # ---- state --------------------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._closed

    def stats(self) -> dict:
        """The engine's latest figures, this process's counters and latency histograms."""
        return {**self._stats, "num_requests": len(self._requests),
                "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total,
                "requests_finished_total": self.requests_finished_total,
                "histograms": {name: h.snapshot() for name, h in self.histograms.items()}}

    # ---- shutdown -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine process (its TP workers with it); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            with self._send_lock:
                self._conn.send(("shutdown",))
        except OSError:
            pass
        self._stop_process()

    def _stop_process(self) -> None:
        self._closed = True
        self._process.join(30.0)
        if self._process.is_alive():        # stuck: it holds GPU memory and workers, so it is killed
            self._process.kill()
            self._process.join(5.0)
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)
