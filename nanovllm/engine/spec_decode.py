"""Speculative decoding, the engine's side of a decode step: propose -> reserve slots -> verify -> accept.

1. `propose`: drafts for the scheduled decode batch (ngram_proposer.py), each cut so that its sequence can
   never pass max_tokens or max_model_len whatever is accepted, to the step's token budget (every row is
   a token the model computes), and to the KV slots free blocks can give (BlockManager.reserve_lookahead:
   drafts never preempt anything; a sequence without room decodes one token).
2. The engine has every rank run ModelRunner.verify: each sequence computes its last token and its drafts
   in one prefill-shaped pass over its cached KV, and the rejection sampler says how many drafts hold
   (layers/rejection_sampler.py).
3. `accept`: each sequence gains its accepted drafts and the target's token after them, one by one, as
   plain decoding would have gained them: eos or a stop token ends it there (the tokens after it are
   dropped), and so does the length limit. num_cached_tokens counts the accepted tokens' KV only, so
   BlockManager.hash_blocks never publishes a block that holds a rejected draft's KV; the blocks reserved
   past the sequence's tokens go back (release_lookahead), and a rejected draft's slot in a kept block
   is overwritten when the token really there is computed, next step.

The step is collected before the next one is scheduled (the accepted counts decide where the next step
writes, and the next drafts come from the tokens just accepted), so with speculation on the engine runs
every step in lockstep, without the one-step pipelining of plain decoding.
"""
from nanovllm.config import Config
from nanovllm.engine.ngram_proposer import NgramProposer
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_outputs import record_logprobs


class SpeculativeDecoding:
    """Drafts for decode steps and the bookkeeping of what the target accepts; counts for llm.stats."""

    def __init__(self, config: Config, scheduler: Scheduler):
        spec = config.speculative_config
        self.proposer = NgramProposer(spec["num_speculative_tokens"], spec["prompt_lookup_min"],
                                      spec["prompt_lookup_max"])
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.max_model_len = config.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.num_drafts = 0             # (sequence, step) pairs verified with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each scheduled decode sequence's drafts (maybe none), with KV slots reserved for them."""
        room = [min(seq.max_tokens - seq.num_completion_tokens, self.max_model_len - seq.num_tokens) - 1
                for seq in seqs]
        drafts = self.proposer.propose(seqs, room)
        budget = self.max_num_batched_tokens - len(seqs)     # the step's rows beyond one per sequence
        for i, (seq, draft) in enumerate(zip(seqs, drafts)):
            if draft:
                keep = self.block_manager.reserve_lookahead(seq, min(len(draft), max(budget, 0)))
                drafts[i] = draft[:keep]
                budget -= keep
        return drafts

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
                if self.scheduler.stops_on(seq, token_id):
                    stop_token = token_id
                    break
            seq.num_cached_tokens = min(computed, seq.num_tokens)
            if logprobs is not None and seq.logprobs is not None:
                rows = tuple(column[first:first + count] for column in logprobs)
                record_logprobs([seq] * count, gained[:count], rows)
            self.block_manager.release_lookahead(seq)
            self.block_manager.hash_blocks(seq)
            if stop_token is not None:
                seq.stop_reason = stop_token if stop_token in seq.stop_token_ids else None
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
