"""Speculative decoding with an EAGLE-3 head (speculative_config method "eagle3"): a one-layer draft head
(models/eagle3.py) that reads the target's residual stream entering three of its layers, so that one cheap
layer drafts nearly as the whole target would.

The head's K/V at position p come from token p + 1 and the target's hidden state at p, so they can be written
only once token p + 1 is known: after each target step samples. ModelRunner.run hands every prefill and decode
step to `after_forward` (the tokens each position is followed by: the prompt's next ones, and at the end the
token the step samples) and, once sampled, to `after_sampling`; ModelRunner.verify hands a verification to
`after_verify` (each row followed by the token emitted there; rows past a rejection write K/V that later steps
overwrite, as the target's). Either way the head's K/V are complete wherever the target's are, in a second
paged cache under the target's block ids (as a draft model's: draft_model.py), and the head's output at each
sequence's last computed position L - 2 (read with its last token, L tokens in all) is kept (a table of rows
per sequence, on every rank): that output drafts token 1. Drafting token j + 1 then runs the head on draft j
at position L + j - 2 (the last token's slot, then reserved ones) with the head's own previous output as the
hidden state.

Two places where a token after a block matters: completions split off a prompt (n > 1) each read their own
first token at the prompt's last position, so each gets a copy of the block holding it (BlockManager.fork) and
the head computes that position again for each, into its copy, once the copies are made (`after_block_copies`);
and a block's K/V at its last position read the token after the block, which its hash does not cover, so the
BlockManager (`reads_next_token`) lets a prefix-cache hit share a block only where that token matches, and
otherwise copies the block and has the step compute its last position again.

A head with a vocabulary of its own (d2t) drafts in it; drafts and their laws q are mapped onto the target's
vocabulary for the rejection sampler (draft_model.draw_drafts)."""
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.distributed.group import TensorParallelGroup
from nanovllm.engine.draft_model import Drafter
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_inputs import prepare_segments
from nanovllm.models.eagle3 import Eagle3Head, aux_hidden_layer_ids
from nanovllm.utils.context import get_context, reset_context
from nanovllm.utils.transfer import list_to_device, to_device

NEXT_SAMPLED = -1      # a position followed by the token its step samples


class StepRecord(NamedTuple):
    """What the head keeps of a target step until its tokens are sampled (Eagle3Proposer.after_forward)."""
    positions: torch.Tensor
    num_tokens: int
    # each position's following token, NEXT_SAMPLED where the step samples it, and the row of its sample
    # (None, None: a decode step, whose positions are all followed by their samples)
    following: torch.Tensor | None
    rows_of: torch.Tensor | None
    ends: list[int] | None      # the rows whose output drafts next (None: every row, a decode step's) ...
    owners: list[int]           # ... for these sequences
    # completions split off a prompt: (the completion, its sample's row, its parent's end row, the position)
    splits: list[tuple[Sequence, int, int, int]]


class Eagle3Proposer(Drafter):
    """An EAGLE-3 head beside the target on one rank, its KV cache, and each sequence's last output."""

    reads_verification = True       # its K/V need the tokens a verification emits

    def __init__(self, config: Config, target: nn.Module, device: torch.device, group: TensorParallelGroup,
                 rank: int, ops):
        head_config, target_config = config.draft_hf_config, config.hf_config
        super().__init__(config, device, group, rank, ops, lambda hf: Eagle3Head(hf, target_config.hidden_size))
        self.model.embed_tokens.append(target.model.embed_tokens)
        layer_ids = aux_hidden_layer_ids(head_config, target_config.num_hidden_layers)
        target.model.set_aux_hidden_layers(layer_ids, max(config.max_num_batched_tokens, config.max_num_seqs))
        self.aux = target.model
        self.vocab_size = target_config.vocab_size
        # each live sequence's row in `last`: the head's output (before its norm) at its last position
        self.rows: dict[int, int] = {}
        self.free: list[int] = []
        self.last = torch.zeros(0, head_config.hidden_size, dtype=config.dtype, device=device)
        self._rows, self._hidden = [], None     # a proposal's drafting sequences and their last outputs

    # ---- each sequence's last output ---------------------------------------------------------------
    def _rows_for(self, seq_ids: list[int]) -> torch.Tensor:
        for seq_id in seq_ids:
            if seq_id not in self.rows:
                if not self.free:
                    old = len(self.last)
                    self.last = torch.cat([self.last, self.last.new_zeros(max(8, old), self.last.size(1))])
                    self.free.extend(range(len(self.last) - 1, old - 1, -1))
                self.rows[seq_id] = self.free.pop()
        return to_device(np.array([self.rows[s] for s in seq_ids], dtype=np.int64), self.device)

    def _release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            row = self.rows.pop(seq_id, None)
            if row is not None:
                self.free.append(row)

    # ---- after the target's steps ----------------------------------------------------------------------
    def after_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seqs: list[Sequence],
                      computed: list[Sequence], finished_seq_ids: list[int]) -> StepRecord:
        """What the head needs of a prefill or decode step (taken under its metadata, before the scheduler
        counts it computed): each position's following token (a decode's are all the tokens it samples), the
        rows whose output each sequence keeps, and the completions split off a prompt in this step."""
        self._release(finished_seq_ids)
        if not get_context().is_prefill:            # decode: each position is followed by its sampled token
            return StepRecord(positions, len(input_ids), None, None, None, [seq.seq_id for seq in seqs], [])
        index = {seq.seq_id: i for i, seq in enumerate(seqs)}
        following, ends, owners, offset = [], [], [], 0
        for seq in computed:
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
            following.extend(seq[start + 1:end])
            following.append(NEXT_SAMPLED if end == seq.num_tokens else seq[end])
            offset += end - start
            if end == seq.num_tokens:           # the prompt is done: its last output drafts next
                ends.append(offset - 1)
                owners.append(seq.seq_id)
        following = to_device(np.array(following, dtype=np.int64), self.device)
        rows_of = to_device(np.repeat([index[s.seq_id] for s in computed],
                                      [s.num_scheduled_tokens for s in computed]).astype(np.int64), self.device)
        # a completion split off a prompt in this step (n > 1) follows its parent in the batch (as its logits
        # row does): its own first token follows the prompt's last position (after_block_copies)
        end_of, splits, parent = dict(zip(owners, ends)), [], None
        for i, seq in enumerate(seqs):
            if seq.num_scheduled_tokens:
                parent = seq
            elif parent is not None and parent.seq_id in end_of:
                splits.append((seq, i, end_of[parent.seq_id], seq.num_tokens - 1))
        return StepRecord(positions, len(input_ids), following, rows_of, ends, owners, splits)

    @torch.inference_mode()
    def after_sampling(self, record: StepRecord, sampled: torch.Tensor) -> None:
        """The head's K/V of the step's positions (under its metadata), each read with the token after it;
        the output at each sequence's last position kept."""
        following = sampled if record.following is None else \
            torch.where(record.following == NEXT_SAMPLED, sampled[record.rows_of], record.following)
        _, before_norm = self.model(following, record.positions, self.aux.aux_hidden_states[:record.num_tokens],
                                    True)
        if record.owners:
            rows = self._rows_for(record.owners)      # may grow the table: before indexing it
            self.last[rows] = before_norm if record.ends is None else \
                before_norm[list_to_device(record.ends, torch.int64, self.device)]

    @torch.inference_mode()
    def after_block_copies(self, record: StepRecord, sampled: torch.Tensor) -> None:
        """Completions split off a prompt, once each has its copy of the block holding the prompt's last
        position (BlockManager.fork): the head at that position again, reading each one's own first token,
        its K/V into the copy, its output kept."""
        if not record.splits:
            return
        children, rows, parent_ends, last_positions = zip(*record.splits)
        positions = prepare_segments(list(children), list(last_positions), [1] * len(children), self.block_size,
                                     self.device)
        hidden = self.aux.aux_hidden_states[list_to_device(parent_ends, torch.int64, self.device)]
        _, before_norm = self.model(sampled[list_to_device(rows, torch.int64, self.device)], positions, hidden, True)
        reset_context()
        rows = self._rows_for([child.seq_id for child in children])     # may grow the table: before indexing it
        self.last[rows] = before_norm

    @torch.inference_mode()
    def after_verify(self, positions: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                     token_ids: torch.Tensor, accepted: torch.Tensor, finished_seq_ids: list[int]) -> None:
        """The head's K/V of a verification's rows, each read with the token emitted there; each sequence's
        output at its last accepted position kept."""
        self._release(finished_seq_ids)
        _, before_norm = self.model(token_ids, positions, self.aux.aux_hidden_states[:len(token_ids)], True)
        firsts = to_device(np.concatenate([[0], np.cumsum([len(d) + 1 for d in drafts])[:-1]]).astype(np.int64),
                           self.device)
        rows = self._rows_for([s.seq_id for s in seqs])
        self.last[rows] = before_norm[firsts + accepted]

    # ---- drafting ------------------------------------------------------------------------------------------
    def _round_logits(self, j: int, rows: list[int], seqs: list[Sequence], first_tokens: list[list[int]],
                      drafted: torch.Tensor) -> torch.Tensor | None:
        """Round 0: from each sequence's kept output (at position L - 2, read with its last token); round j:
        the head on draft j at position L + j - 2, with its own output before it as the hidden state
        (first_tokens: unused, the head's K/V are complete)."""
        if j == 0:
            index = self._rows_for([seqs[i].seq_id for i in rows])     # may grow the table: before indexing it
            self._rows, self._hidden = rows, self.last[index]
            normed = self.model.norm(self._hidden)
        else:
            where = {i: k for k, i in enumerate(self._rows)}     # a row's place in the round before
            keep = to_device(np.array([where[i] for i in rows], dtype=np.int64), self.device)
            batch = [seqs[i] for i in rows]
            # draft j follows the last token (position L - 1, whose K/V the target computes next): the head
            # reads it at position L + j - 2, the position before it (the head's position p reads token p + 1)
            positions = prepare_segments(batch, [seq.num_tokens + j - 2 for seq in batch], [1] * len(batch),
                                         self.block_size, self.device)
            normed, self._hidden = self.model(drafted[rows, j - 1], positions, self._hidden[keep], False)
            reset_context()
            self._rows = rows
        return self.model.lm_head.logits_of(normed)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.model.to_target_ids(draft_ids)
