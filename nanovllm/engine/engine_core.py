"""The engine's own process behind AsyncLLM: an LLMEngine stepping as long as there is work, taking
requests and aborts between steps, and sending each step's new tokens back in one message.

It lives in a process of its own so that the server's Python (HTTP, JSON, detokenization) never holds
the GIL the step loop needs: the loop launches step t+1 before it collects step t, and any wait on the
host shows up as an idle GPU. Messages are pickled tuples over a multiprocessing Pipe:

    to the engine:   ("add", request_id, prompt token ids, SamplingParams) | ("abort", request_id) | ("shutdown",)
    from the engine: ("ready", info) | ("error", request_id, exception type name, message)
                     | ("outputs", [delta, ...], stats or None) | ("stats", stats) | ("fatal", exception type name, message)

where a delta is (request_id, completion index, new token ids, their log-prob dicts or None, finish_reason,
stop_reason, prompt log-probs or None), sent whenever a completion gains tokens or finishes.
"""
import signal
import time
import traceback
from multiprocessing.connection import Connection

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.sequence import Sequence

REFUSALS = (ValueError, TypeError, FileNotFoundError)
STATS_INTERVAL = 0.1     # seconds between the figures sent with outputs   # a request's or a setting's fault, raised as they are


class EngineCore:
    """Owns one LLMEngine and the map between its sequences and the frontend's request ids."""

    def __init__(self, engine: LLMEngine, conn: Connection):
        self.engine = engine
        self.conn = conn
        self.request_ids: dict[int, str] = {}      # a request's first sequence id -> its request id
        self.first_seq_ids: dict[str, int] = {}    # and back
        self.num_unfinished: dict[str, int] = {}   # completions still running, per request
        self.num_sent: dict[int, int] = {}         # completion tokens sent, per sequence
        self._stats_sent = float("-inf")            # when the figures last went out
        self.done_seq_ids: set[int] = set()

    def info(self) -> dict:
        config, block_manager = self.engine.config, self.engine.scheduler.block_manager
        return {"model": config.model, "max_model_len": config.max_model_len, "vocab_size": self.engine.vocab_size,
                "kvcache_block_size": config.kvcache_block_size, "num_kvcache_blocks": len(block_manager.blocks)}

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
            deltas = self._deltas(self.engine.last_collected)
            if deltas:
                # the figures walk the running batch: a few times a second is enough for /metrics, and
                # always once the engine runs out of work (its blocks all free again)
                now = time.monotonic()
                fresh = now - self._stats_sent >= STATS_INTERVAL or self.engine.is_finished()
                if fresh:
                    self._stats_sent = now
                self.conn.send(("outputs", deltas, self.stats() if fresh else None))

    def _handle(self, message: tuple) -> bool:
        kind = message[0]
        if kind == "add":
            self._add(*message[1:])
        elif kind == "abort":
            self._abort(message[1])
            self.conn.send(("stats", self.stats()))     # its blocks are free now, whether or not a step follows
        elif kind == "shutdown":
            return False
        return True

    def _add(self, request_id: str, token_ids: list[int], sampling_params) -> None:
        try:
            seq_id = self.engine.add_request(token_ids, sampling_params)
        except REFUSALS as error:
            self.conn.send(("error", request_id, type(error).__name__, str(error)))
            return
        self.request_ids[seq_id] = request_id
        self.first_seq_ids[request_id] = seq_id
        self.num_unfinished[request_id] = sampling_params.n

    def _abort(self, request_id: str) -> None:
        first_seq_id = self.first_seq_ids.get(request_id)
        if first_seq_id is None:        # finished (or refused) before the abort arrived
            return
        for seq in self.engine.abort_request(first_seq_id):
            self.num_sent.pop(seq.seq_id, None)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        del self.request_ids[self.first_seq_ids.pop(request_id)]
        del self.num_unfinished[request_id]

    def _deltas(self, seqs: list[Sequence | None]) -> list[tuple]:
        """The new tokens of every sequence whose placeholders were filled by the last step (None: a row
        of a prompt's chunk, which samples nothing)."""
        deltas = []
        for seq in seqs:
            if seq is None or seq.seq_id in self.done_seq_ids:
                continue        # a chunk's row, or a completion that ended a step ago (eos is found one step late)
            request_id = self.request_ids.get(seq.parent_id)
            if request_id is None:
                continue
            sent = self.num_sent.get(seq.seq_id, 0)
            known = seq.num_tokens - seq.num_pending_tokens - seq.num_prompt_tokens
            finished = seq.is_finished
            if known <= sent and not finished:
                continue
            start = seq.num_prompt_tokens
            new_ids = seq.token_ids[start + sent:start + known]
            logprobs = seq.logprobs[sent:known] if seq.logprobs is not None else None
            prompt_logprobs = getattr(seq, "prompt_logprobs", None) if sent == 0 and seq.index == 0 else None
            deltas.append((request_id, seq.index, new_ids, logprobs,
                           seq.finish_reason if finished else None, seq.stop_reason if finished else None,
                           prompt_logprobs))
            if finished:
                self.done_seq_ids.add(seq.seq_id)
                self.num_sent.pop(seq.seq_id, None)
                self.num_unfinished[request_id] -= 1
                if not self.num_unfinished[request_id]:
                    self._forget(request_id)
            else:
                self.num_sent[seq.seq_id] = known
        return deltas

    def stats(self) -> dict:
        scheduler = self.engine.scheduler
        return {**scheduler.stats(), "num_running": len(self.request_ids) - self._num_waiting_requests(),
                "num_waiting": self._num_waiting_requests(),
                "num_used_blocks": len(scheduler.block_manager.used_block_ids),
                "num_kvcache_blocks": len(scheduler.block_manager.blocks)}

    def _num_waiting_requests(self) -> int:
        """Requests none of whose completions has started (a prompt waiting for room or still prefilling)."""
        started = {seq.parent_id for seq in self.engine.scheduler.running}
        started.update(seq.parent_id for seq in self.engine.scheduler.finishing)
        return sum(1 for seq_id in self.request_ids if seq_id not in started)


def run_engine_core(conn: Connection, model: str, llm_kwargs: dict) -> None:
    """The engine process's body: build the engine, say "ready" (or why not), serve until told to stop."""
    # Ctrl-C reaches every process of the terminal's group: the frontend decides when the engine stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = LLMEngine(model, **llm_kwargs)
    except BaseException as error:
        conn.send(("fatal", type(error).__name__, _describe(error)))
        return
    try:
        core = EngineCore(engine, conn)
        conn.send(("ready", core.info()))
        core.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass                            # the frontend is gone: nobody to answer
    except BaseException as error:
        try:
            conn.send(("fatal", type(error).__name__, _describe(error)))
        except (BrokenPipeError, ConnectionResetError):
            pass
    finally:
        engine.exit()


def _describe(error: BaseException) -> str:
    if isinstance(error, REFUSALS):
        return str(error)
    return f"{error}\n--- in the engine process ---\n{''.join(traceback.format_exception(error))}"
