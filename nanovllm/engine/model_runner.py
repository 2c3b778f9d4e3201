import gc
import itertools

import torch

from nanovllm.config import Config
from nanovllm.distributed.group import TensorParallelGroup, rank_device
from nanovllm.engine import kv_cache as kv, step_inputs, warmup
from nanovllm.engine.cuda_graphs import CudaGraphs, decode_graph_rows, prefill_graph_lengths
from nanovllm.engine.draft_model import DraftModel
from nanovllm.engine.eagle3_proposer import Eagle3Proposer
from nanovllm.engine.model_loading import build_model
from nanovllm.engine.penalty_state import PenaltyState
from nanovllm.engine.sampled_tokens import SampledTokens
from nanovllm.engine.sampling_inputs import argmax_suffices, build_sampling_tensors, build_verify_tensors
from nanovllm.engine.sequence import Sequence
from nanovllm.kernels.decode_attention import SHARED_PREFIX_ROWS
from nanovllm.layers.attention import Attention, attention_ops
from nanovllm.layers.prompt_logprobs import prompt_logprobs
from nanovllm.layers.rejection_sampler import DraftRows, RejectionSampler
from nanovllm.layers.sampler import Sampler, SamplerOutput
from nanovllm.utils.context import get_context, reset_context, using_context
from nanovllm.utils.transfer import list_to_device

# decode graphs of up to this many rows compute the logits too: a small batch's step is bound by the host's
# launches (an LM head of these rows in the graph costs a static buffer of 64 x vocab_size values)
LOGITS_IN_GRAPH_ROWS = 64


class ModelRunner:
    """Runs the model for one rank, coordinating the rooms that do the work: builds the model and loads
    its weights, warms it up (warmup.py), sizes and owns the KV cache (kv_cache.py), prepares each step's
    inputs and attention metadata (step_inputs.py) and, on rank 0, its sampling inputs
    (sampling_inputs.py; penalty_state.py), runs the step (replaying CUDA graphs where captured, cuda_graphs.py), and
    (rank 0) samples.

    With tensor parallelism every rank has one, in its own process (rank 0 in the caller's), and the
    engine has each rank call the same methods in the same order (distributed/workers.py).
    """

    def __init__(self, config: Config, rank: int = 0, group: TensorParallelGroup | None = None):
        self.config = config
        self.block_size = config.kvcache_block_size
        self.enforce_eager = config.enforce_eager or config.device == "cpu"
        self.world_size = config.tensor_parallel_size
        self.rank = rank
        self.device = rank_device(config.device, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            gc.collect()                # a dropped engine caught in a reference cycle (a failed start's traceback)
            torch.cuda.empty_cache()    # else the weights land in a freed engine's cached KV segment and pin it
        self.tp = group or TensorParallelGroup()
        self.graphs: CudaGraphs | None = None   # captured last, unless eager
        self.draft: DraftModel | Eagle3Proposer | None = None   # speculative decoding's drafter, if configured
        self._draft_probs = None                # rank 0: the laws of the drafts proposed last, for verify
        try:
            self._build()
        except BaseException:
            self.exit()
            raise

    def _build(self) -> None:
        """The model, its weights, the KV cache and (unless eager) the decode graphs."""
        config, hf_config = self.config, self.config.hf_config
        if self.device.type == "cuda" and self.world_size > 1 and not config.disable_custom_all_reduce:
            self.tp.enable_peer_all_reduce(self.device, [rank_device(config.device, r) for r in range(self.world_size)])
        self.model = build_model(config, hf_config, config.model, self.device, self.tp, config.quant_method)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.penalty_state = PenaltyState(hf_config.vocab_size, self.device) if self.rank == 0 else None
        # the last step's sampled tokens (on every rank) and each sequence's row in them: a decode input
        # whose token is still PENDING on the host is taken from here, on the device
        self.sampled = torch.empty(0, dtype=torch.int64, device=self.device)
        self.sampled_rows: dict[int, int] = {}
        self._deferred = None       # a step whose sampling waits for sample_deferred()
        self.ops = attention_ops(config.attention_backend)
        # decode steps group the rows that share pages where the backend reads them once for a group (ours)
        self.share_prefixes = self.ops.decode_order
        for layer in self._attention_layers():
            layer.ops = self.ops
        if config.draft_hf_config is not None:
            drafter = Eagle3Proposer if config.speculative_config["method"] == "eagle3" else DraftModel
            self.draft = drafter(config, self.model, self.device, self.tp, self.rank, self.ops)
        if self.device.type == "cuda":
            self.warmup_model()
            if self.rank == 0:
                self.sampler.warmup(self.config.hf_config.vocab_size, self.config.dtype, self.device)
        self.allocate_kv_cache()
        if self.device.type == "cuda":
            self.warmup_cached_paths()
        if not self.enforce_eager:
            self.capture_cudagraph()

    # ---- teardown ------------------------------------------------------------------------------------
    def exit(self) -> None:
        """Release everything this rank holds, device memory included: another engine may start in
        this process next, and memory left in the allocator's cache would look used to it."""
        if hasattr(self, "model"):
            for layer in self._attention_layers():
                layer.k_cache = layer.v_cache = torch.tensor([])
        if getattr(self, "draft", None) is not None:
            self.draft.exit()
        self.graphs = None
        for name in ("kv_cache", "sampled", "model", "penalty_state", "draft", "_draft_probs"):
            self.__dict__.pop(name, None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # cuBLAS keeps a workspace per stream in the allocator: a live one pins its whole segment,
            # and the next engine in this process would find that memory taken
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()
        if self.tp is not None:
            self.tp.close()
            self.tp = None

    # ---- setup --------------------------------------------------------------------------------------
    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def warmup_model(self) -> None:
        """Before the KV cache: the full token budget's prefill and every reachable kernel variant (warmup.py)."""
        warmup.warmup_model(self)

    def warmup_cached_paths(self) -> None:
        """After the KV cache: the paths that read K/V through the block table (warmup.py)."""
        warmup.warmup_cached_paths(self)

    def allocate_kv_cache(self) -> None:
        """As many blocks as fit on every rank (kv_cache.py), bound into the attention layers."""
        num_blocks = kv.num_blocks_that_fit(self.config, self.device)
        self.num_kvcache_blocks = kv.agreed_num_blocks(num_blocks, self.tp, self.device)
        self.kv_cache = kv.allocate_kv_cache(self.config, self.num_kvcache_blocks, self.device,
                                             self._attention_layers())
        if self.draft is not None:
            self.draft.allocate_kv_cache(self.num_kvcache_blocks)

    # ---- per-step inputs (step_inputs.py) ---------------------------------------------------------------
    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        return step_inputs.prepare_prefill(seqs, self.block_size, self.device)

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        return step_inputs.prepare_decode(seqs, self.block_size, self.device, self.sampled, self.sampled_rows,
                                          SHARED_PREFIX_ROWS if self.share_prefixes else 0)

    # ---- running ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, is_prefill: bool,
                  num_seqs: int) -> torch.Tensor:
        hidden = None
        if self.graphs is not None and not self.enforce_eager:     # tests set enforce_eager to compare
            if is_prefill:
                hidden = self.graphs.prefill(input_ids, positions, num_seqs)
            else:
                hidden, logits = self.graphs.decode(input_ids, positions) or (None, None)
                if logits is not None:          # a small batch's graph computes its logits too
                    return logits
        if hidden is None:
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool, block_copies: list[tuple[int, int]] = (),
            finished_seq_ids: list[int] = (), prompt_logprob_rows: list[tuple[int, int]] = (),
            defer_sampling: bool = False, prefix_copies: list[tuple[int, int]] = ()) -> SampledTokens | None:
        """Launch one step; rank 0 gets its sampled tokens (one per seq) as they will arrive.

        A prefill may carry completions split off a prompt computed in this very step (n > 1): they
        compute nothing, sample from their parent's logits, and get copies of its partial last block
        (block_copies: (source, destination); of a full one too under an EAGLE-3 head) once its KV is
        written. finished_seq_ids: sequences that
        ended since the last step (their sampling state is freed). prompt_logprob_rows: (index in seqs,
        k) of the prefilled sequences that want their prompt's log-probs (SampledTokens carries them).
        defer_sampling: launch the forward pass alone; sample_deferred() samples it later (structured
        outputs: the host fills the step's token masks while the device runs the forward pass).
        prefix_copies: (source, destination) blocks to copy before the forward pass (partial prefix-cache
        hits, whose sources earlier steps wrote)."""
        if prefix_copies:
            self.copy_blocks(prefix_copies)
        computed = [seq for seq in seqs if seq.num_scheduled_tokens] if is_prefill else seqs
        logits_rows = None
        if len(computed) < len(seqs):   # each split-off completion follows its parent: sample the parent's row
            logits_rows = list(itertools.accumulate(1 if seq.num_scheduled_tokens else 0 for seq in seqs))
            logits_rows = [row - 1 for row in logits_rows]
        input_ids, positions = self.prepare_prefill(computed) if is_prefill else self.prepare_decode(computed)
        prompt_logprobs = None
        if prompt_logprob_rows:     # eager: they want the hidden state of every position
            hidden = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden)
            prompt_logprobs = self._prompt_logprobs(hidden, seqs, computed, prompt_logprob_rows)
        else:
            logits = self.run_model(input_ids, positions, is_prefill, len(computed))
        context = get_context()
        reset_context()
        if self.rank == 0:          # the sampling inputs while the device runs the forward pass
            self.penalty_state.release(finished_seq_ids)
            if logits_rows is None and not defer_sampling and argmax_suffices(seqs):
                # greedy rows with nothing to edit or report: their tokens are the argmax (_sample), so no
                # inputs are built or copied (a lone small model's decode step is host work)
                tensors, penalty_rows = None, None
            else:
                tensors, penalty_rows = build_sampling_tensors(
                    seqs, logits_rows, self.config.hf_config.vocab_size, self.config.eos_token_ids,
                    self.penalty_state, self.device)
        step = (seqs, logits, tensors, penalty_rows, prompt_logprobs) if self.rank == 0 else (seqs,)
        drafter_record = None
        if self.draft is not None:      # what the drafter needs of this step, before the engine counts it computed
            with using_context(context):
                drafter_record = (self.draft.after_forward(input_ids, positions, seqs, computed, finished_seq_ids),
                                  context)
        if defer_sampling:
            self._deferred = (step, drafter_record, block_copies)
            return None
        return self._sample_and_follow(step, drafter_record, block_copies)

    @torch.inference_mode()
    def sample_deferred(self, token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> SampledTokens | None:
        """Sample the step run(defer_sampling=True) launched; token_bitmask (rank 0, on the host, the
        bitmask pinned on a GPU): structured outputs' (bitmask, rows), see SamplingTensors."""
        (step, drafter_record, block_copies), self._deferred = self._deferred, None
        if self.rank == 0 and token_bitmask is not None:
            step[2].token_bitmask = self._on_device(token_bitmask)
        return self._sample_and_follow(step, drafter_record, block_copies)

    def _sample_and_follow(self, step: tuple, drafter_record, block_copies: list[tuple[int, int]]
                           ) -> SampledTokens | None:
        """Sample a step; then the drafter's K/V of its positions (they may read its tokens), the step's block
        copies (after them: a copy carries both caches), and what the drafter writes into the copies."""
        sampled = self._sample(*step)
        if drafter_record is not None:
            record, context = drafter_record
            with using_context(context):
                self.draft.after_sampling(record, self.sampled)
        if block_copies:
            self.copy_blocks(block_copies)
            if drafter_record is not None:
                self.draft.after_block_copies(drafter_record[0], self.sampled)
        return sampled

    def _on_device(self, token_bitmask: tuple[torch.Tensor, torch.Tensor] | None):
        """Structured outputs' (bitmask, rows) from the host (pinned on a GPU), queued behind the step."""
        return None if token_bitmask is None else tuple(t.to(self.device, non_blocking=True) for t in token_bitmask)

    def propose_drafts(self, seqs: list[Sequence], lengths: list[int], first_tokens: list[list[int]]
                       ) -> list[list[int]] | None:
        """The drafter's lengths[i] drafts for seqs[i], whose slots are reserved (a draft model computes from
        the tokens first_tokens[i] on: draft_model.py; an EAGLE-3 head: eagle3_proposer.py); rank 0 gets them
        and keeps their laws for the verify() after."""
        drafts, self._draft_probs = self.draft.propose(seqs, lengths, first_tokens)
        return drafts if self.rank == 0 else None

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], drafts: list[list[int]], finished_seq_ids: list[int] = (),
               token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[SampledTokens, torch.Tensor | None] | None:
        """Speculative decoding's target step: each seq computes its last token and its drafts, one decode row
        each (step_inputs.prepare_verify; replayed in the decode graph of the rows' bucket where one holds
        them), every position's logits are sampled as plain decoding samples them
        (sampling_inputs.build_verify_tensors), and the rejection sampler counts the drafts accepted
        (layers/rejection_sampler.py). Rank 0 gets (SampledTokens of every row, num_accepted [seqs] on the
        device, or None where every row is greedy and nothing edits its logits: its tokens are the argmax and
        the engine counts the drafts that equal them, spec_decode.count_accepted): seq i gains the tokens
        of its rows 0..num_accepted[i]. Nothing is left pending: the
        engine collects this step before it schedules the next. token_bitmask: as sample_deferred's, over the
        verification's rows (StructuredOutputs.verify_bitmask)."""
        input_ids, positions = step_inputs.prepare_verify(seqs, drafts, self.block_size, self.device)
        logits = self.run_model(input_ids, positions, False, len(input_ids))   # a decode graph, if one holds it
        context = get_context()
        reset_context()
        self.sampled, self.sampled_rows = self.sampled[:0], {}
        draft_reads = self.draft is not None and self.draft.reads_verification
        if self.rank == 0:
            draft_probs, self._draft_probs = self._draft_probs, None
            self.penalty_state.release(finished_seq_ids)
            # greedy rows with nothing to edit: every row's token is its argmax, whatever the proposal's law
            # (the target's is one-hot), and the engine counts the leading rows that equal their drafts
            if not draft_reads and token_bitmask is None and argmax_suffices(seqs):
                return SampledTokens(SamplerOutput.argmax(logits)), None
            # while the device runs the forward pass: the host waits on this step
            tensors, state_rows = build_verify_tensors(
                seqs, drafts, self.config.hf_config.vocab_size, self.config.eos_token_ids, self.penalty_state,
                self.device)
            rows = DraftRows.from_drafts(drafts, self.device)
            tensors.token_bitmask = self._on_device(token_bitmask)
        output = accepted = None
        if self.rank == 0:
            output, accepted = self.rejection_sampler(logits, tensors, rows, draft_probs)
            if state_rows is not None:      # count the emitted tokens of the penalized rows
                p = tensors.penalties.rows
                emitted = rows.offsets[p] <= accepted[rows.seq_of_row[p]]
                self.penalty_state.count(state_rows[emitted], output.token_ids[p][emitted])
        if draft_reads:     # an EAGLE-3 head: every rank
            # the other ranks' buffers take rank 0's dtypes (int64: SamplerOutput, num_accepted), not the inputs'
            token_ids = output.token_ids if self.rank == 0 else torch.empty(len(input_ids), dtype=torch.int64,
                                                                             device=self.device)
            accepted = accepted if self.rank == 0 else torch.empty(len(seqs), dtype=torch.int64, device=self.device)
            self.tp.broadcast_from_first(token_ids)
            self.tp.broadcast_from_first(accepted)
            with using_context(context):
                self.draft.after_verify(positions, seqs, drafts, token_ids, accepted, finished_seq_ids)
        return (SampledTokens(output), accepted) if self.rank == 0 else None

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor | None = None, tensors=None, penalty_rows=None,
                prompt_logprobs=None) -> SampledTokens | None:
        if self.rank == 0:
            # no tensors: every row greedy with nothing to edit (run)
            output = SamplerOutput.argmax(logits) if tensors is None else self.sampler(logits, tensors)
            if penalty_rows is not None:
                self.penalty_state.count(penalty_rows, output.token_ids[tensors.penalties.rows])
            token_ids = output.token_ids
        else:
            token_ids = torch.empty(len(seqs), dtype=torch.int64, device=self.device)
        self.tp.broadcast_from_first(token_ids)       # every rank feeds them to its next decode step
        self.sampled, self.sampled_rows = token_ids, {seq.seq_id: i for i, seq in enumerate(seqs)}
        return SampledTokens(output, prompt_logprobs) if self.rank == 0 else None

    def _prompt_logprobs(self, hidden: torch.Tensor, seqs: list[Sequence], computed: list[Sequence],
                         wanted: list[tuple[int, int]]):
        """Log-probs of the prompt tokens this step's positions predict (step_inputs.prompt_logprob_targets).
        Returns (spans, tensors): per wanted sequence, its first predicted token's index, how many, and its
        k; the tensors row by row (rank 0)."""
        spans, rows, targets = step_inputs.prompt_logprob_targets(seqs, computed, wanted)
        if not rows:
            return spans, None
        tensors = prompt_logprobs(self.model.lm_head, hidden, list_to_device(rows, torch.int64, self.device),
                                  list_to_device(targets, torch.int64, self.device), max(k for _, k in wanted))
        return spans, tensors

    def copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source, destination), queued behind the step that wrote the sources."""
        kv.copy_blocks(self.kv_cache, block_copies)
        if self.draft is not None:
            kv.copy_blocks(self.draft.kv_cache, block_copies)

    def capture_cudagraph(self) -> None:
        hf, config = self.config.hf_config, self.config
        k = config.speculative_config["num_speculative_tokens"] if config.speculative_config else 0
        self.graphs = CudaGraphs(self.model, decode_graph_rows(config.max_num_seqs, k),
                                 -(-config.max_model_len // self.block_size),
                                 prefill_graph_lengths(config.max_num_batched_tokens, config.max_model_len),
                                 hf.hidden_size, config.dtype, self.device,
                                 logits_rows=LOGITS_IN_GRAPH_ROWS if self.world_size == 1 else 0,
                                 shared_prefixes=self.share_prefixes)
        self.graphs.capture()
        if isinstance(self.draft, DraftModel):      # its rounds: a row a sequence, or a few from one token back
            self.draft.capture_graphs(2 * config.max_num_seqs, -(-config.max_model_len // self.block_size),
                                      LOGITS_IN_GRAPH_ROWS if self.world_size == 1 else 0)
