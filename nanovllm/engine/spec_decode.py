"""Speculative decoding, the engine's side of a decode step: propose -> reserve slots -> verify -> accept.

1. `propose`: drafts for the scheduled decode batch (ngram_proposer.py, or the draft model on every rank:
   draft_model.py), each cut so that its sequence can never pass max_tokens or max_model_len whatever is
   accepted, to the step's rows (the token budget, and the largest decode graph), and to the KV slots free
   blocks can give (BlockManager.reserve_lookahead: drafts never preempt anything; a sequence without room
   decodes one token). A draft model writes its own K/V as it drafts, so its slots are reserved first.
2. The engine has every rank run ModelRunner.verify: each sequence computes its last token and its drafts
   as a decode step of one row per token (replayed in the decode graphs), and the rejection sampler says how
   many drafts hold (layers/rejection_sampler.py).
3. `accept`: each sequence gains its accepted drafts and the target's token after them, one by one, as
   plain decoding would have gained them: eos or a stop token ends it there (the tokens after it are
   dropped), and so does the length limit. num_cached_tokens counts the accepted tokens' KV only, so
   BlockManager.hash_blocks never publishes a block that holds a rejected draft's KV; the blocks reserved
   past the sequence's tokens go back (release_lookahead), and a rejected draft's slot in a kept block
   is overwritten when the token really there is computed, next step.

A verification is collected before the next step is scheduled (the accepted counts decide where the next
step writes, and the next drafts come from the tokens just accepted). A step without drafts is left in flight,
and while n-gram lookup finds nothing to draft from the tokens known (one step stale), the next step is
launched beside it, as plain decoding pipelines its steps; where a match appears, the step in flight is
collected first and the next one drafted from every token. Whether it speculates is SpeculationPolicy's
call, by measurement: per decode batch size, the tokens a second each mode has given, so that speculation
switches itself off where it does not pay (large batches, text that n-gram lookup cannot predict) and
back on where it does. Outputs do not depend on the choice: greedy tokens are the same either way, and a
seeded request draws with keys of its own positions.
"""
from collections.abc import Callable

from nanovllm.config import Config
from nanovllm.engine.cuda_graphs import cuda_graph_batch_sizes, decode_graph_rows
from nanovllm.engine.ngram_proposer import NgramProposer
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_outputs import record_logprobs


def count_accepted(token_ids: list[int], drafts: list[list[int]]) -> list[int]:
    """Per sequence, how many of its drafts hold where its rows' tokens are the target's own choices (a
    verification's greedy rows, ModelRunner.verify): the leading drafts equal to the tokens of their rows."""
    counts, row = [], 0
    for draft in drafts:
        accepted = 0
        while accepted < len(draft) and token_ids[row + accepted] == draft[accepted]:
            accepted += 1
        counts.append(accepted)
        row += len(draft) + 1
    return counts


class SpeculationPolicy:
    """Speculate or decode plainly, per decode batch size (bucketed to powers of two): whichever mode has
    given more tokens a second there (an exponential average of the engine's steps: tokens emitted over the
    step's wall time), the unmeasured one first (speculation before plain decoding), and the other mode every
    `retry_every`-th step of the bucket, so that an estimate never goes stale. A mode's first step in a bucket
    is not measured: it may carry one-time costs (a kernel variant compiling, the allocator growing) that would
    otherwise stand as the whole estimate and keep the mode off for many retries. Not adaptive: always."""

    def __init__(self, adaptive: bool = True, retry_every: int = 64, weight: float = 0.2):
        self.adaptive, self.retry_every, self.weight = adaptive, retry_every, weight
        self.rates: dict[tuple[int, bool], float] = {}     # (bucket, speculated) -> tokens a second
        self.steps: dict[int, int] = {}
        self.unmeasured_first: set[tuple[int, bool]] = set()   # modes whose first step in a bucket has passed

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()

    def speculate(self, batch_size: int) -> bool:
        if not self.adaptive:
            return True
        bucket = self.bucket(batch_size)
        count = self.steps[bucket] = self.steps.get(bucket, 0) + 1
        spec, plain = self.rates.get((bucket, True)), self.rates.get((bucket, False))
        if spec is None or plain is None:
            return spec is None
        return (spec >= plain) != (count % self.retry_every == 0)

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode step's figures: its batch, its mode, the tokens it emitted, its wall time."""
        if seconds <= 0:
            return
        key, rate = (self.bucket(batch_size), speculated), tokens / seconds
        if key not in self.unmeasured_first:
            self.unmeasured_first.add(key)
            return
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else old + self.weight * (rate - old)


class SpeculativeDecoding:
    """Drafts for decode steps and the bookkeeping of what the target accepts; counts for llm.stats."""

    def __init__(self, config: Config, scheduler: Scheduler,
                 draft_model: Callable[[list[Sequence], list[int], list[list[int]]], list[list[int]]] | None = None):
        """draft_model(seqs, lengths, first_tokens): the draft model's lengths[i] drafts for seqs[i], run on every rank
        (method "draft_model"; the engine hands in its ModelRunner.propose_drafts call)."""
        spec = config.speculative_config
        self.k = spec["num_speculative_tokens"]
        self.draft_model = draft_model
        self.proposer = None if spec["method"] != "ngram" else NgramProposer(
            self.k, spec["prompt_lookup_min"], spec["prompt_lookup_max"])
        self.draft_leaves_last = spec["method"] == "draft_model"     # its last accepted draft's K/V unwritten
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.max_model_len = config.max_model_len
        # every row is a token the model computes: at most the token budget, and where the verification
        # replays a decode graph, the rows of the largest one (more would run eagerly)
        self.max_rows = config.max_num_batched_tokens
        if not (config.enforce_eager or config.device == "cpu"):
            largest = cuda_graph_batch_sizes(decode_graph_rows(config.max_num_seqs, self.k))[-1]
            self.max_rows = min(self.max_rows, largest)
        self.policy = SpeculationPolicy(spec["adaptive"])
        self.num_drafts = 0             # (sequence, step) pairs verified with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each scheduled decode sequence's drafts (maybe none), with KV slots reserved for them."""
        room = [min(seq.max_tokens - seq.num_completion_tokens, self.max_model_len - seq.num_tokens) - 1
                for seq in seqs]
        budget = self.max_rows - len(seqs)      # the step's rows beyond one per sequence
        if self.proposer is None:       # the draft model: slots first, then exactly that many drafts
            lengths = []
            for seq, most in zip(seqs, room):
                wanted = min(self.k, most, budget)
                lengths.append(self.block_manager.reserve_lookahead(seq, wanted) if wanted > 0 else 0)
                budget -= lengths[-1]
            if not any(lengths):
                return [[] for _ in seqs]
            # the tokens the draft computes first (draft_model.py): one back from the target's cached ones, or
            # from its unwritten position if plain steps came after it (theirs attended to it: computed again)
            starts = []
            for seq in seqs:
                hole = self.block_manager.unwritten_position(seq)
                starts.append(seq.num_cached_tokens - 1 if hole is None else min(seq.num_cached_tokens - 1, hole))
            drafts = self.draft_model(seqs, lengths, [seq.token_ids[start:] for seq, start in zip(seqs, starts)])
            for seq, n, start in zip(seqs, lengths, starts):
                if n:
                    self.block_manager.drafter_wrote_from(seq, start)
            return drafts
        drafts = self.proposer.propose(seqs, room)
        for i, (seq, draft) in enumerate(zip(seqs, drafts)):
            if draft:
                keep = self.block_manager.reserve_lookahead(seq, min(len(draft), max(budget, 0)))
                drafts[i] = draft[:keep]
                budget -= keep
        return drafts

    def may_propose(self, seqs: list[Sequence]) -> bool:
        """Whether drafts may follow the step in flight: n-gram lookup finds a match in some sequence's known
        tokens (a draft model always drafts)."""
        return self.proposer is None or self.proposer.may_propose(seqs)

    def accept(self, seqs: list[Sequence], drafts: list[list[int]], token_ids: list[int], num_accepted: list[int],
               logprobs) -> list[Sequence]:
        """A verification step's results (every row's token, each sequence's accepted count, the rows'
        log-probs or None): append what each sequence gained, end what is done; returns the finished."""
        finished = []
        row = 0
        for seq, draft, accepted in zip(seqs, drafts, num_accepted):
            first, row = row, row + len(draft) + 1
            if draft:
                self.num_drafts += 1
                self.num_draft_tokens += len(draft)
                self.num_accepted_tokens += accepted
            seq.num_scheduled_tokens = 0
            computed = seq.num_tokens + accepted        # the last token's KV and the accepted drafts'
            stop_token = None
            gained = token_ids[first:first + accepted + 1]
            for count, token_id in enumerate(gained, 1):
                seq.append_token(token_id)
                if seq.grammar is not None:
                    seq.grammar.accept(token_id)
                if self.scheduler.stops_on(seq, token_id):
                    stop_token = token_id
                    break
            seq.num_cached_tokens = min(computed, seq.num_tokens)
            self.scheduler.num_decoded_tokens += count - 1      # the accepted drafts kept (the row counted one)
            if self.draft_leaves_last and draft and accepted == len(draft):
                # the draft model never computed its last draft's K/V: its next proposal does (draft_model.py)
                self.block_manager.hold_back(seq, computed - 1)
            if logprobs is not None and seq.logprobs is not None:
                rows = tuple(column[first:first + count] for column in logprobs)
                record_logprobs([seq] * count, gained[:count], rows)
            self.block_manager.release_lookahead(seq)
            self.block_manager.hash_blocks(seq)
            if stop_token is not None:
                seq.stop_reason = self.scheduler.stop_reason(seq, stop_token)
                reason = "stop"
            elif seq.num_completion_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
            else:
                continue
            self.scheduler.finish(seq, reason)
            finished.append(seq)
        return finished

    def stats(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_draft_tokens": self.num_draft_tokens,
                "spec_decode_accepted_tokens": self.num_accepted_tokens}
