import logging
from collections import deque
from collections.abc import Iterable

import torch

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus

WATERMARK = 0.01    # of the KV blocks, kept free when a waiting sequence starts beside running ones (vLLM v0's)

logger = logging.getLogger(__name__)


def kv_room_hint(config: Config, num_kvcache_blocks: int) -> str:
    """What an engine logs at its first preemption: the KV cache's size, and the settings that give it more room
    (those that apply to this config)."""
    block_size = config.kvcache_block_size
    ways = []
    if block_size > 16 and getattr(config, "attention_backend", None) != "flash_attn":
        ways.append(f"kvcache_block_size=16 (in {block_size}-token pages each running sequence leaves about "
                    f"{block_size // 2} tokens of its last page unused)")
    if getattr(config, "num_kvcache_blocks", -1) > 0:
        ways.append("a larger num_kvcache_blocks")
    elif getattr(config, "device", None) == "cuda":
        ways.append(f"a larger gpu_memory_utilization (now {config.gpu_memory_utilization}) where the GPU runs "
                    f"nothing else")
    if getattr(config, "kv_cache_dtype", None) not in (None, torch.float8_e4m3fn):
        ways.append("kv_cache_dtype='fp8' (half the bytes a token)")
    ways.append("a larger tensor_parallel_size, or a smaller max_num_seqs")
    return (f"the KV cache is full ({num_kvcache_blocks} blocks of {block_size} tokens, "
            f"{num_kvcache_blocks * block_size} tokens): running sequences are preempted and recomputed later, "
            f"which costs throughput (the engine's stats count them as num_preemptions; logged once). "
            f"More room: " + "; ".join(ways) + ".")


class Scheduler:
    """Continuous batching: each step is either a prefill batch (new prompts first) or a decode batch.

    A step is `schedule()`, then `launched()` once the device has it, then `postprocess()` when its
    sampled tokens arrive. In between the engine may schedule and launch the next step: `launched()`
    gives each sampling sequence a PENDING placeholder, so the next step's positions and blocks are
    known before the token is. A sequence that stops on eos is found one step late and its extra step
    dropped; one that reaches its length limit is known at launch and never scheduled past it.

    Prompts longer than the step's token budget are prefilled in chunks; a partly prefilled sequence
    stays at the head of `waiting`, holding its blocks, and goes on next step. When decode runs out of
    blocks, the newest running sequences are preempted: their blocks are freed and they are recomputed
    later (their own freed blocks often come back through the prefix cache). While anything runs, a waiting
    sequence starts only if WATERMARK of the blocks stay free after it: else the decode steps right after
    would preempt it again, each time recomputing it in a prefill step of its own (bench.py's standard
    workload in Qwen3-30B-A3B's 128k tokens of KV: 141 preemptions without, 42 with; benchmarks/simulate_scheduler.py).

    A request's n completions start from its prompt's last chunk: as many as have a running slot and
    a block are split off then; the others wait as one sequence holding the prompt's full blocks, and
    start in waves as room frees up (`_fork`). Waiting sequences that hold blocks give them back when
    nothing else could ever move (`_release_waiting_blocks`).
    """

    def __init__(self, config: Config, num_kvcache_blocks: int):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = config.eos_token_ids
        # an EAGLE-3 head's K/V at a position read the token after it (eagle3_proposer.py)
        reads_next_token = (config.speculative_config or {}).get("method") == "eagle3"
        self.block_manager = BlockManager(num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching, reads_next_token)
        self._config = config                   # for the first preemption's hint
        self.watermark_blocks = int(WATERMARK * num_kvcache_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.finishing: set[Sequence] = set()   # launched up to their last token, which is still pending
        # (source, destination) block copies of the step scheduled last: after it (n > 1: a partial last
        # block the step writes) and before it (partial prefix-cache hits: blocks an earlier step wrote)
        self.block_copies: list[tuple[int, int]] = []
        self.prefix_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0
        self.num_lookup_tokens = 0       # prompt tokens checked against the prefix cache
        self.num_hit_tokens = 0          # ... of which were found there
        self.num_prefilled_tokens = 0
        self.num_decoded_tokens = 0
        self.num_peak_used_blocks = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.finishing

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        self.block_copies, self.prefix_copies = [], []
        self.block_manager.start_step()
        scheduled = self._schedule_prefill()
        is_prefill = bool(scheduled)
        if not is_prefill:
            scheduled = self._schedule_decode()
        self.num_peak_used_blocks = max(self.num_peak_used_blocks, len(self.block_manager.used_block_ids))
        return scheduled, is_prefill

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # new, preempted, or a completion holding only its prompt's full blocks; a prompt partly
            # prefilled holds all of its blocks already
            if len(seq.block_table) < seq.num_blocks and not self._allocate(seq):
                break
            num_new_tokens = seq.num_tokens - seq.num_cached_tokens
            last_chunk = num_new_tokens <= budget
            seq.num_scheduled_tokens = min(num_new_tokens, budget)
            # prompts scheduled after this one in the same step can already share what it computes
            self.block_manager.hash_blocks(seq, seq.num_cached_tokens + seq.num_scheduled_tokens)
            budget -= seq.num_scheduled_tokens
            self.num_prefilled_tokens += seq.num_scheduled_tokens
            scheduled.append(seq)
            if not last_chunk:
                break                       # a chunk: the rest of this prompt goes next step
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            if seq.num_forks:
                scheduled.extend(self._fork(seq))
        return scheduled

    def _allocate(self, seq: Sequence) -> bool:
        """Give the head of `waiting` the blocks it lacks. If there are too few and nothing runs that
        could free some, the blocks other waiting sequences hold are all there is to take. Beside running
        sequences, it must leave the watermark's blocks free. A prompt whose partial prefix-cache hit of at
        least half a page is on a block this step writes waits for the next step, which copies it
        (BlockManager.partial_hit); a shorter one (a short system prompt shared by a burst of requests) is
        not worth a step's wait: those tokens are computed again."""
        fresh = not seq.block_table
        if fresh and (partial := self.block_manager.partial_hit(seq)) is not None and partial[2] \
                and 2 * partial[1] >= self.block_manager.block_size:
            return False
        reserve = self.watermark_blocks if self.running or self.finishing else 0
        if not self.block_manager.can_allocate(seq, reserve):
            if self.running or self.finishing or not self._release_waiting_blocks():
                return False
            if not self.block_manager.can_allocate(seq):
                return False
        copy = self.block_manager.allocate(seq)
        if copy is not None:
            self.prefix_copies.append(copy)
        if fresh:                           # a lookup in the prefix cache, not blocks held by reference
            self.num_lookup_tokens += seq.num_tokens
            self.num_hit_tokens += seq.num_cached_tokens
        return True

    def _release_waiting_blocks(self) -> bool:
        """Waiting sequences that hold blocks (completions holding their prompt's full blocks, a prompt
        partly prefilled) give them back; they recompute them, or find them in the prefix cache, when
        they start. Called only when nothing else can move: held blocks must never keep the cache too
        full for whatever waits, or is alone running, to go on. Returns whether any were held."""
        holders = [seq for seq in self.waiting if seq.block_table]
        for seq in holders:
            self.block_manager.deallocate(seq)
        return bool(holders)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Split the request's other completions off seq, whose prompt's last chunk is scheduled now: as
        many as have a running slot and a block for their copy of a partial last block. They share its
        blocks (a partial last block is copied once this step has written it) and sample from its logits
        in this same step.

        The rest wait at the head of `waiting` as one sequence: the next completion, holding the prompt's
        full blocks by reference (not recomputed, prefix cache or not) and carrying the others. When it
        starts it computes only the prompt's tail and splits them off in turn, so a request of any n runs
        in waves, each completion drawing by its own index whatever wave it starts in."""
        room = self.max_num_seqs - len(self.running)
        num_children = self.block_manager.num_forkable(seq, min(seq.num_forks, room))
        children = []
        for index in range(seq.index + 1, seq.index + 1 + num_children):
            child = seq.fork(index)
            child.num_cached_tokens = seq.num_tokens     # computed by the parent in this step
            copy = self.block_manager.fork(seq, child)
            if copy is not None:
                self.block_copies.append(copy)
            self.running.append(child)
            children.append(child)
        num_left = seq.num_forks - num_children
        seq.num_forks = 0
        if num_left:
            rest = seq.fork(seq.index + num_children + 1)
            rest.status = SequenceStatus.WAITING
            rest.num_forks = num_left - 1
            copy = self.block_manager.share_prompt(seq, rest)
            if copy is not None:
                self.block_copies.append(copy)
            self.waiting.appendleft(rest)
        return children

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                elif not scheduled and not self.finishing and self._release_waiting_blocks():
                    continue                # alone, and only what waits held the blocks it needs
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.num_decoded_tokens += len(scheduled)
        self.running.extendleft(reversed(scheduled))
        # longest context first: the attention kernel's programs start in batch order, so its last
        # wave is then made of short sequences instead of a long one that the whole GPU waits for
        return sorted(scheduled, key=len, reverse=True)

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        if self.num_preemptions == 1:
            logger.warning(kv_room_hint(self._config, len(self.block_manager.blocks)))

    def launched(self, seqs: list[Sequence]) -> list[Sequence | None]:
        """The step is on the device: count its tokens as computed and give every sequence it samples
        for a placeholder. Returns, row by row, the sequence waiting for that row's sampled token."""
        awaiting: list[Sequence | None] = []
        for seq in seqs:
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if not seq.num_pending_tokens:  # every token known (a prefill): later prompts may hit its
                self.block_manager.hash_blocks(seq)     # blocks now; a decode's wait for postprocess
            if seq.num_cached_tokens < seq.num_tokens:
                awaiting.append(None)       # a prefill chunk: its sampled token means nothing
                continue
            seq.append_pending()
            awaiting.append(seq)
            if seq.num_completion_tokens == seq.max_tokens or seq.num_tokens >= self.max_model_len:
                self.running.remove(seq)    # nothing more to compute: it ends when this token arrives
                self.finishing.add(seq)
        return awaiting

    def postprocess(self, awaiting: list[Sequence | None], token_ids: list[int]) -> list[Sequence]:
        """A launched step's tokens arrived: fill the placeholders and finish what is done: on eos or a
        stop token ("stop"), or at the length limit ("length"). Stop strings are found in the text, by
        the OutputProcessor, which then has the engine call finish()."""
        finished = []
        for seq, token_id in zip(awaiting, token_ids):
            if seq is None or seq.is_finished:  # a chunk, or stopped on eos one step before
                continue
            seq.fill_pending(token_id)
            if seq.grammar is not None:
                seq.grammar.accept(token_id)
            self.block_manager.hash_blocks(seq)
            if self.stops_on(seq, token_id):
                seq.finish_reason = "stop"
                seq.stop_reason = self.stop_reason(seq, token_id)
            elif seq in self.finishing and not seq.num_pending_tokens:
                seq.finish_reason = "length"
            else:
                continue
            self._finish(seq)
            finished.append(seq)
        return finished

    def stops_on(self, seq: Sequence, token_id: int) -> bool:
        """Whether seq, whose latest known token is token_id, ends on it: eos (unless ignored) or a stop
        token, once min_tokens completion tokens came before it."""
        known = seq.num_tokens - seq.num_pending_tokens - seq.num_prompt_tokens   # completion tokens, this one too
        return known > seq.sampling_params.min_tokens and (
            token_id in seq.stop_token_ids or self._ends_on_eos(seq, token_id))

    def stop_reason(self, seq: Sequence, token_id: int) -> int | None:
        """The stop_reason of seq, which stops on token_id (stops_on said so): None for eos (checked first, as
        vLLM does, so also where eos is listed in stop_token_ids), else the stop token."""
        return None if self._ends_on_eos(seq, token_id) else token_id

    def _ends_on_eos(self, seq: Sequence, token_id: int) -> bool:
        return not seq.ignore_eos and token_id in self.eos_token_ids

    def finish(self, seq: Sequence, finish_reason: str) -> None:
        """End seq now, between steps (a stop string found in its text): like eos found a step late, a
        step in flight may still hold its row, which postprocess skips."""
        seq.finish_reason = finish_reason
        self._finish(seq)

    def find(self, request_id: int, index: int) -> Sequence | None:
        """Completion `index` of the request whose first sequence is request_id, if it has started and
        not ended."""
        for seq in (*self.running, *self.finishing, *self.waiting):
            if seq.parent_id == request_id and seq.index == index:
                return seq
        return None

    def _finish(self, seq: Sequence) -> None:
        seq.drop_pending()
        if seq in self.finishing:
            self.finishing.remove(seq)
        elif seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)        # preempted while its last step was still in flight
        seq.status = SequenceStatus.FINISHED
        if seq.block_table:
            self.block_manager.deallocate(seq)

    def abort(self, request_ids: Iterable[int]) -> list[Sequence]:
        """Drop every sequence of these requests (ids as `parent_id`: all n completions) wherever it is,
        free its blocks now, and return the dropped sequences; completions not yet split off never
        start. Call it between steps: a launched step may still hold rows for them, and postprocess
        skips finished sequences."""
        request_ids = set(request_ids)
        dropped = [seq for seq in (*self.running, *self.waiting, *self.finishing)
                   if seq.parent_id in request_ids]
        self._drop(dropped)
        kept_running = [seq for seq in self.running if not seq.is_finished]
        kept_waiting = [seq for seq in self.waiting if not seq.is_finished]
        self.running.clear()
        self.running.extend(kept_running)
        self.waiting.clear()
        self.waiting.extend(kept_waiting)
        self.finishing.difference_update(dropped)
        return dropped

    def abort_all(self) -> list[Sequence]:
        """Drop every request and free its blocks (after a failed step); returns the dropped ones."""
        dropped = [*self.running, *self.waiting, *self.finishing]
        self._drop(dropped)
        self.running.clear()
        self.waiting.clear()
        self.finishing.clear()
        return dropped

    def _drop(self, seqs: list[Sequence]) -> None:
        """Finish seqs as aborted and free their blocks; the caller takes them out of the queues."""
        for seq in seqs:
            if seq.num_scheduled_tokens:    # scheduled, never launched: what it registered was not written
                self.block_manager.forget_unwritten(seq)
        for seq in seqs:
            if seq.block_table:
                self.block_manager.deallocate(seq)
            seq.drop_pending()
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"     # as vLLM names it
            seq.num_scheduled_tokens = 0
            seq.num_forks = 0               # completions not split off yet never start

    def stats(self) -> dict:
        return {
            "num_preemptions": self.num_preemptions,
            "num_prefilled_tokens": self.num_prefilled_tokens,
            "num_decoded_tokens": self.num_decoded_tokens,
            "num_prefix_cache_hit_tokens": self.num_hit_tokens,
            "num_peak_used_blocks": self.num_peak_used_blocks,
            "prefix_cache_hit_rate": self.num_hit_tokens / self.num_lookup_tokens if self.num_lookup_tokens else 0.0,
        }
