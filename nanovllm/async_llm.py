"""AsyncLLM: the engine for servers. Requests come and go while others run (continuous batching across
callers); each request's outputs stream as they are computed.

    engine = AsyncLLM(model_dir, **llm_kwargs)
    async for out in engine.generate(prompt, sampling_params, request_id):
        for delta in out.deltas: print(delta.text, end="")

The engine steps in a process of its own (engine/engine_core.py); this process keeps the tokenizer,
turns token ids into text and finds stop strings (engine/output_processor.py, as LLM.generate does), and
wakes each caller. A caller that reads slower than the engine computes
gets several steps' tokens in one output: the engine never waits for it.
"""
import asyncio
import itertools
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator, Callable

from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.distributed.workers import refuse_in_spawn_bootstrap
from nanovllm.engine.chat_template import default_sampling_params, render_chat
from nanovllm.engine.engine_core import run_engine_core
from nanovllm.engine.messages import (AbortRequest, AddRequest, CompletionUpdate, Fatal, FinishCompletion, Ready,
                                      Refused, Shutdown, Stats, StepOutputs, refusal)
from nanovllm.engine.output_processor import CompletionDelta, OutputProcessor, RequestOutput
from nanovllm.engine.request_check import RequestLimits, checked_request
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.histogram import Histogram

__all__ = ["AsyncLLM", "CompletionDelta", "EngineDeadError", "RequestOutput"]

START_TIMEOUT = 1800.0      # seconds for the engine to load and warm up (a large checkpoint, a cold cache)
SHUT_DOWN = "shut down (AsyncLLM.shutdown(), or the end of its `with` block)"     # dead_reason after shutdown()


class EngineDeadError(RuntimeError):
    """The engine process died (or failed), or was shut down: every request in flight, and every later one,
    gets this."""


class _Request:
    """A request as this process waits for it: when its caller should wake, and its timings."""

    def __init__(self, params: SamplingParams, arrival: float):
        self.params, self.arrival = params, arrival
        self.ready = asyncio.Event()
        self.error: BaseException | None = None
        self.aborted = False
        self.last_token_time: float | None = None
        self.counted_finished = False


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
        self.model: str = info.model
        self.max_model_len: int = info.limits.max_model_len
        self.limits: RequestLimits = info.limits
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.processor = OutputProcessor(self.tokenizer)
        self._requests: dict[str, _Request] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead_reason: str | None = None     # why the engine is gone, once it is
        self._dead_callbacks: list[Callable[[str], None]] = []
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
    def _wait_ready(self):
        deadline = time.monotonic() + START_TIMEOUT
        while not self._conn.poll(0.1):
            if not self._process.is_alive():
                raise RuntimeError(self._start_failure())
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine did not start within {START_TIMEOUT:.0f} s")
        try:
            message = self._conn.recv()
        except EOFError:        # it ended without a word: run_engine_core, which reports its failures, never ran
            raise RuntimeError(self._start_failure()) from None
        if isinstance(message, Ready):
            return message.info
        raise refusal(message.kind, message.message)

    def _start_failure(self) -> str:
        """Why the engine process ended before it was ready, as far as this process can tell."""
        self._process.join(5.0)
        code = self._process.exitcode
        message = f"the engine process exited while starting (exit code {code})"
        if code == 1:       # an exception before run_engine_core (it sends its own as Fatal): spawn's bootstrap
            message += (" before the engine began to load; its error is on stderr. Most often the cause: the "
                        "engine process is spawned and imports your script again, and a script that builds an "
                        "AsyncLLM (or LLM) when imported fails there. Put the script's work under "
                        '`if __name__ == "__main__":`')
        return message

    def _stopped(self) -> EngineDeadError | None:
        """The error for any call once the engine is gone (died, failed, or shut down), else None."""
        # _closed as well as dead_reason: shutdown() sets the first at once, _die the second in the loop's thread
        reason = self.dead_reason or (SHUT_DOWN if self._closed else None)
        return None if reason is None else EngineDeadError(f"the engine has stopped: {reason}")

    def _send(self, message, best_effort: bool = False) -> None:
        """best_effort: a message that only saves the engine work (an abort, a completion's end), dropped
        once the engine is gone rather than raising."""
        with self._send_lock:       # shutdown() closes under it: nothing is sent after its Shutdown
            if (error := self._stopped()) is not None:
                if best_effort:
                    return
                raise error
            self._conn.send(message)

    def _read(self) -> None:
        """The reader thread: every engine message is handed to the event loop as it comes."""
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, StepOutputs) and message.stats is not None:
                    self._stats = message.stats         # read by stats() from any thread: one assignment
                elif isinstance(message, Stats):
                    self._stats = message.stats
                    continue
                self._call_in_loop(self._dispatch, message)
                if isinstance(message, Fatal):
                    return
        except (EOFError, OSError):
            if not self._closed:
                code = self._process.exitcode if not self._process.is_alive() else None
                how = f" (exit code {code})" if code is not None else ""
                self._call_in_loop(self._dispatch, Fatal("EngineDeadError", f"the engine process exited{how}"))

    def _call_in_loop(self, callback, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            callback(*args)         # nobody awaits yet (or any more): no loop to hop to
        else:
            try:
                loop.call_soon_threadsafe(callback, *args)
            except RuntimeError:    # the loop closed between the check and the call
                callback(*args)

    def _dispatch(self, message) -> None:
        if isinstance(message, StepOutputs):
            now = time.monotonic()
            for update in message.updates:
                request = self._requests.get(update.request_id)
                if request is not None and self.processor.wants(update):
                    self._time(request, update, now)
            touched, stopped = self.processor.process(message.updates)
            for request_id, index in stopped:       # a stop string: the engine stops computing it
                self._send(FinishCompletion(request_id, index), best_effort=True)
            for request_id in touched:
                request = self._requests.get(request_id)
                if request is None:
                    continue
                if self.processor.is_finished(request_id) and not request.counted_finished:
                    request.counted_finished = True
                    self.requests_finished_total += 1
                    self.histograms["e2e_request_latency_seconds"].observe(now - request.arrival)
                request.ready.set()
        elif isinstance(message, Refused):
            request = self._requests.get(message.request_id)
            if request is not None:
                request.error = refusal(message.kind, message.message)
                request.ready.set()
        elif isinstance(message, Fatal):
            self._die(f"{message.kind}: {message.message}")

    def _die(self, reason: str, died: bool = True) -> None:
        """The engine is gone: every request in flight fails with EngineDeadError, then, if it died (rather
        than being shut down), the callbacks run. In the event loop's thread (request.ready is not
        thread-safe)."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        for request in self._requests.values():
            request.error = EngineDeadError(f"the engine has stopped: {reason}")
            request.ready.set()
        for callback in self._dead_callbacks if died else ():
            callback(reason)

    def on_dead(self, callback: Callable[[str], None]) -> None:
        """Call callback(reason) once, in the event loop's thread, when the engine process dies or fails
        (at once, through the running loop, if it has already)."""
        self._dead_callbacks.append(callback)
        if self.dead_reason not in (None, SHUT_DOWN):      # shut down is not dead: nothing to report
            try:
                asyncio.get_running_loop().call_soon(callback, self.dead_reason)
            except RuntimeError:
                callback(self.dead_reason)

    def _time(self, request: _Request, update: CompletionUpdate, now: float) -> None:
        """Metrics as the tokens reach this process: time to first token, between tokens."""
        num_new = len(update.token_ids)
        if num_new:
            self.generation_tokens_total += num_new
            if request.last_token_time is None:
                self.histograms["time_to_first_token_seconds"].observe(now - request.arrival)
            elif update.index == 0:     # one completion's pace stands for the request's
                self.histograms["inter_token_latency_seconds"].observe((now - request.last_token_time) / num_new)
            if update.index == 0 or request.last_token_time is None:
                request.last_token_time = now

    # ---- requests ----------------------------------------------------------------------------------------
    def check_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> list[int]:
        """The prompt's token ids; raises ValueError/TypeError where LLM.generate would refuse it."""
        return checked_request(self.tokenizer, prompt, sampling_params, self.limits)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None, continue_final_message: bool = False) -> list[int]:
        """One conversation's prompt token ids, through the tokenizer's chat template (tools and extra
        template arguments, such as enable_thinking, go to it), as LLM.chat_prompt's."""
        return render_chat(self.tokenizer, self.model, messages, add_generation_prompt, tools, chat_template_kwargs,
                           continue_final_message)

    def get_default_sampling_params(self) -> SamplingParams:
        return default_sampling_params(self.model)

    async def generate(self, prompt: str | list[int] | dict, sampling_params: SamplingParams,
                       request_id: str | None = None, *, checked_token_ids: list[int] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as its tokens come; the last has finished=True and the whole output.
        Raises ValueError/TypeError (before yielding) for a request the engine refuses, EngineDeadError
        once the engine has died or been shut down. checked_token_ids: the prompt's ids from check_request(prompt,
        sampling_params) (a server that checked the request already; it is not checked again)."""
        if (error := self._stopped()) is not None:
            raise error
        if request_id is None:
            request_id = f"request-{next(self._request_counter)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        token_ids = checked_token_ids if checked_token_ids is not None else self.check_request(prompt, sampling_params)
        self._loop = asyncio.get_running_loop()
        request = _Request(sampling_params, time.monotonic())
        self._requests[request_id] = request
        self.processor.add_request(request_id, token_ids, sampling_params, stream=True)
        finished = False
        try:
            self._send(AddRequest(request_id, token_ids, sampling_params))
            self.prompt_tokens_total += len(token_ids)
            while not finished:
                await request.ready.wait()
                request.ready.clear()
                if request.error is not None:
                    raise request.error
                output = self.processor.take(request_id)
                finished = output.finished
                yield output
        finally:
            del self._requests[request_id]
            self.processor.forget(request_id)
            if not finished and not request.aborted:     # the caller left early: free its blocks
                self._send(AbortRequest(request_id), best_effort=True)

    async def abort(self, request_id: str) -> None:
        """Stop a request now: the engine frees its blocks before its next step, and the request's
        `generate` ends with one more output, finished, its unfinished completions' reason "abort"."""
        request = self._requests.get(request_id)
        if request is None or request.aborted:
            return
        request.aborted = True
        self.processor.abort(request_id)
        self._send(AbortRequest(request_id))
        request.ready.set()

    # ---- state --------------------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self.dead_reason is None and not self._closed

    def stats(self) -> dict:
        """The engine's latest figures, this process's counters and latency histograms."""
        return {**self._stats, "num_requests": len(self._requests),
                "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total,
                "requests_finished_total": self.requests_finished_total,
                "histograms": {name: h.snapshot() for name, h in self.histograms.items()}}

    # ---- shutdown -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine process (its TP workers with it); safe to call twice, from any thread. Streams in
        flight end with EngineDeadError, and so does every later call."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._conn.send(Shutdown())
            except OSError:
                pass
        # the streams in flight end now, with EngineDeadError (the reader ignores the pipe's end from here on)
        self._call_in_loop(self._die, SHUT_DOWN, False)
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
