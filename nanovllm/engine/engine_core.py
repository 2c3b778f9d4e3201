"""The engine's own process behind AsyncLLM: an LLMEngine stepping as long as there is work, taking
requests, aborts and stop-string finishes between steps, and sending each step's token updates back in
one message (messages.py names them all).

It lives in a process of its own so that the server's Python (HTTP, JSON, detokenization) never holds
the GIL the step loop needs: the loop launches step t+1 before it collects step t, and any wait on the
host shows up as an idle GPU. It never detokenizes: text and stop strings are the frontend's
OutputProcessor's, which sends FinishCompletion when a stop string ends a completion.
"""
import signal
import time
import traceback
from multiprocessing.connection import Connection

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.messages import (REFUSALS, AbortRequest, AddRequest, EngineInfo, Fatal, FinishCompletion,
                                      Ready, Refused, Shutdown, Stats, StepOutputs)

STATS_INTERVAL = 0.1     # seconds between the figures sent with outputs


class EngineCore:
    """Owns one LLMEngine and the map between its request ids (first sequence ids) and the frontend's."""

    def __init__(self, engine: LLMEngine, conn: Connection):
        self.engine = engine
        self.conn = conn
        self.request_ids: dict[int, str] = {}      # the engine's request id -> the frontend's
        self.engine_ids: dict[str, int] = {}       # and back
        self.num_unfinished: dict[str, int] = {}   # completions still running, per request
        self._stats_sent = float("-inf")            # when the figures last went out

    def info(self) -> EngineInfo:
        return EngineInfo(self.engine.config.model, self.engine.limits)

    def run(self) -> None:
        """Step while there is work; block on the pipe while there is none. Returns on shutdown or when the
        frontend is gone (the pipe breaks)."""
        while True:
            idle = self.engine.is_finished()
            while idle or self.conn.poll():
                if not self._handle(self.conn.recv()):
                    return
                idle = self.engine.is_finished()
            self.engine.step()
            updates = self._updates()
            # the figures walk the running batch: a few times a second is enough for /metrics, and always
            # once the engine runs out of work (its blocks all free again), even from a step that collected
            # nothing new (a stop string ended the last completion while its next step was in flight)
            now, out_of_work = time.monotonic(), self.engine.is_finished()
            fresh = now - self._stats_sent >= STATS_INTERVAL or out_of_work
            if fresh and (updates or out_of_work):
                self._stats_sent = now
            if updates:
                self.conn.send(StepOutputs(updates, self.stats() if fresh else None))
            elif out_of_work:
                self.conn.send(Stats(self.stats()))

    def _handle(self, message) -> bool:
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequest):
            self._abort(message.request_id)
            self.conn.send(Stats(self.stats()))     # its blocks are free now, whether or not a step follows
        elif isinstance(message, FinishCompletion):
            self._finish_completion(message.request_id, message.index)
            if self.engine.is_finished():       # no step follows to send the figures (none is in flight where
                self.conn.send(Stats(self.stats()))     # each step was collected before the next: speculation)
        elif isinstance(message, Shutdown):
            return False
        return True

    def _add(self, message: AddRequest) -> None:
        try:
            engine_id = self.engine.add_checked_request(message.prompt_token_ids, message.params)
        except REFUSALS as error:
            self.conn.send(Refused(message.request_id, type(error).__name__, str(error)))
            return
        self.request_ids[engine_id] = message.request_id
        self.engine_ids[message.request_id] = engine_id
        self.num_unfinished[message.request_id] = message.params.n

    def _abort(self, request_id: str) -> None:
        engine_id = self.engine_ids.get(request_id)
        if engine_id is None:        # finished (or refused) before the abort arrived
            return
        self.engine.abort_request(engine_id)
        self._forget(request_id)

    def _finish_completion(self, request_id: str, index: int) -> None:
        engine_id = self.engine_ids.get(request_id)
        if engine_id is None:
            return
        if self.engine.finish_completion(engine_id, index):
            self._count_finished(request_id)

    def _count_finished(self, request_id: str) -> None:
        self.num_unfinished[request_id] -= 1
        if not self.num_unfinished[request_id]:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        del self.request_ids[self.engine_ids.pop(request_id)]
        del self.num_unfinished[request_id]

    def _updates(self) -> list:
        """The last step's updates, under the frontend's request ids."""
        updates = []
        for update in self.engine.updates:
            request_id = self.request_ids.get(update.request_id)
            if request_id is None:
                continue
            update.request_id = request_id
            updates.append(update)
            if update.finish_reason is not None:
                self._count_finished(request_id)
        return updates

    def stats(self) -> dict:
        scheduler = self.engine.scheduler
        return {**self.engine.stats, "num_running": len(self.request_ids) - self._num_waiting_requests(),
                "num_waiting": self._num_waiting_requests(),
                "num_used_blocks": len(scheduler.block_manager.used_block_ids),
                "num_kvcache_blocks": len(scheduler.block_manager.blocks)}

    def _num_waiting_requests(self) -> int:
        """Requests none of whose completions has started (a prompt waiting for room or still prefilling)."""
        started = {seq.parent_id for seq in self.engine.scheduler.running}
        started.update(seq.parent_id for seq in self.engine.scheduler.finishing)
        return sum(1 for engine_id in self.request_ids if engine_id not in started)


def run_engine_core(conn: Connection, model: str, llm_kwargs: dict) -> None:
    """The engine process's body: build the engine, say Ready (or why not), serve until told to stop."""
    # Ctrl-C reaches every process of the terminal's group, and so does a SIGTERM to the group (systemd's
    # default, timeout(1), kill -TERM -PGID): the frontend decides when the engine stops (its pipe closing
    # ends the engine too, should the frontend itself die), so its shutdown ends the streams cleanly
    # rather than reporting the engine dead
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = LLMEngine(model, **llm_kwargs)
    except BaseException as error:
        conn.send(Fatal(type(error).__name__, _describe(error)))
        return
    try:
        core = EngineCore(engine, conn)
        conn.send(Ready(core.info()))
        core.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass                            # the frontend is gone: nobody to answer
    except BaseException as error:
        try:
            conn.send(Fatal(type(error).__name__, _describe(error)))
        except (BrokenPipeError, ConnectionResetError):
            pass
    finally:
        engine.exit()


def _describe(error: BaseException) -> str:
    if isinstance(error, REFUSALS):
        return str(error)
    return f"{error}\n--- in the engine process ---\n{''.join(traceback.format_exception(error))}"
