import gc
import itertools
import math

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import CPU_KV_CACHE_BYTES, Config
from nanovllm.distributed.group import TensorParallelGroup, building_with, rank_device
from nanovllm.engine.cuda_graphs import CudaGraphs, prefill_graph_lengths
from nanovllm.engine.sequence import PENDING, Sequence
from nanovllm.layers.attention import Attention, attention_ops
from nanovllm.layers.linear import dense_warmup_token_counts
from nanovllm.layers.prompt_logprobs import prompt_logprobs
from nanovllm.layers.quantization import building_with_quantization, warmup_token_counts
from nanovllm.engine.sampling_metadata import PenaltyState, SampledTokens, build_sampling_tensors
from nanovllm.kernels.prefill_attention import SHORT_KEYS
from nanovllm.layers.sampler import Sampler
from nanovllm.models import model_class
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.context import reset_context, set_context
from nanovllm.utils.loader import load_dummy_weights, load_model
from nanovllm.utils.transfer import to_device

_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


class ModelRunner:
    """Runs the model for one rank: builds it, owns the KV cache, prepares each step's inputs and
    attention metadata, replays CUDA graphs for decode, and (rank 0) samples.

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
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.dtype)
        try:
            with torch.device(self.device), building_with(self.tp), \
                    building_with_quantization(config.quant_method):
                self.model = model_class(hf_config)(hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            load_dummy_weights(self.model, std=getattr(hf_config, "initializer_range", None) or 0.02)
        else:
            load_model(self.model, config.model)
        self.sampler = Sampler()
        self.penalty_state = PenaltyState(hf_config.vocab_size, self.device) if self.rank == 0 else None
        # the last step's sampled tokens (on every rank) and each sequence's row in them: a decode input
        # whose token is still PENDING on the host is taken from here, on the device
        self.sampled = torch.empty(0, dtype=torch.int64, device=self.device)
        self.sampled_rows: dict[int, int] = {}
        self.ops = attention_ops(config.attention_backend)
        for layer in self._attention_layers():
            layer.ops = self.ops
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
        self.graphs = None
        for name in ("kv_cache", "sampled", "model", "penalty_state"):
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
        """One prefill at the full token budget: compiles kernels and shows peak activation memory."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        seq_len = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        budget = seq_len * max(1, min(self.config.max_num_batched_tokens // seq_len, self.config.max_num_seqs))
        self._warm_prefill(budget)
        # each kernel variant a batch can reach in the layers' quantization methods (MoE, FP8 GEMMs), and
        # prefill attention's tiles for short key ranges (the budget's prompts may be long enough for its others)
        extra = set(warmup_token_counts(self.model)) | {SHORT_KEYS}
        for num_tokens in sorted(extra):
            if num_tokens < budget:
                self._warm_prefill(num_tokens)
        # the LM head's skinny GEMM sees one row per sequence: batches of that many one-token prompts
        for num_seqs in dense_warmup_token_counts():
            if num_seqs <= min(budget, self.config.max_num_seqs):
                self._warm_prefill(num_seqs, longest=1)
        torch.cuda.empty_cache()

    def _warm_prefill(self, num_tokens: int, longest: int | None = None) -> None:
        """A prefill of num_tokens tokens in all, as sequences of at most `longest` (default max_model_len)
        tokens (the budget's: as many sequences of seq_len as fit, or one shorter one)."""
        longest = longest or self.config.max_model_len
        seqs = []
        while num_tokens > 0:
            length = min(num_tokens, longest)
            seqs.append(Sequence([0] * length, SamplingParams(), self.block_size))
            seqs[-1].num_scheduled_tokens = length
            num_tokens -= length
        self.run(seqs, True)

    def warmup_cached_paths(self) -> None:
        """Compile the kernels that read K/V through the block table (a prefill continuing a cached
        prefix, and an eager decode) now, not inside the first request that needs them."""
        if self.num_kvcache_blocks < 2:
            return
        seq = Sequence([0] * (self.block_size + 1), SamplingParams(), self.block_size)
        seq.block_table = [0, 1]                # scratch blocks: the scheduler has handed out nothing yet
        seq.num_cached_tokens, seq.num_scheduled_tokens = self.block_size - 1, 1
        self.run([seq], True)
        seq.num_cached_tokens = self.block_size
        self.run([seq], False)                  # before any graph is captured: eager
        # one token after a long cached prefix: the prefill kernel's tiles for long key ranges
        long_prefix = SHORT_KEYS + 1
        num_blocks = long_prefix // self.block_size + 1
        if self.config.max_model_len > long_prefix and self.num_kvcache_blocks >= num_blocks:
            seq = Sequence([0] * (long_prefix + 1), SamplingParams(), self.block_size)
            seq.block_table = list(range(num_blocks))
            seq.num_cached_tokens, seq.num_scheduled_tokens = long_prefix, 1
            self.run([seq], True)

    def _kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[K/V, layers, blocks, block_size, this rank's kv heads, head_dim]."""
        hf = self.config.hf_config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return (2, hf.num_hidden_layers, num_blocks, self.block_size, hf.num_key_value_heads // self.world_size,
                head_dim)

    def _block_bytes(self) -> int:
        return math.prod(self._kv_cache_shape(1)) * self.config.kv_cache_dtype.itemsize

    def _num_kvcache_blocks(self) -> int:
        config, block_bytes = self.config, self._block_bytes()
        if config.num_kvcache_blocks > 0:
            return config.num_kvcache_blocks
        if self.device.type == "cpu":
            min_blocks = (config.max_model_len + self.block_size - 1) // self.block_size
            return max(CPU_KV_CACHE_BYTES // block_bytes, min_blocks)
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        stats = torch.cuda.memory_stats(self.device)
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        available = int(total * config.gpu_memory_utilization) - used - peak + current
        num_blocks = available // block_bytes
        if num_blocks < 1:
            raise ValueError(f"not even one KV cache block ({block_bytes} bytes) fits in GPU memory at "
                             f"gpu_memory_utilization={config.gpu_memory_utilization}")
        return num_blocks

    def allocate_kv_cache(self) -> None:
        num_blocks = self._num_kvcache_blocks()
        if self.world_size > 1:   # every rank must agree on the pool the scheduler hands out
            t = torch.tensor([num_blocks], device=self.device)
            num_blocks = int(self.tp.all_reduce(t, dist.ReduceOp.MIN).item())
        self.num_kvcache_blocks = num_blocks
        self.kv_cache = torch.empty(self._kv_cache_shape(num_blocks), dtype=self.config.kv_cache_dtype,
                                    device=self.device)
        for i, layer in enumerate(self._attention_layers()):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    # ---- per-step inputs ------------------------------------------------------------------------------
    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        # through numpy: it converts a list of ints several times faster than torch.tensor does
        return self._to_device(np.array(data, dtype=_NUMPY_DTYPES[dtype]))

    @staticmethod
    def padded_block_tables(seqs: list[Sequence]) -> list[list[int]]:
        """Each seq's block table, padded with -1 to the longest one."""
        pad = [-1] * max(len(seq.block_table) for seq in seqs)
        return [seq.block_table + pad[len(seq.block_table):] for seq in seqs]

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs for tokens [num_cached_tokens, num_cached_tokens + num_scheduled_tokens) of each seq."""
        input_ids, positions, slot_mapping = [], [], []
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        max_seqlen_q = max_seqlen_k = 0
        bs = self.block_size
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
            input_ids.extend(seq[start:end])
            positions.extend(range(start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
            cu_seqlens_k.append(cu_seqlens_k[-1] + end)
            max_seqlen_q, max_seqlen_k = max(max_seqlen_q, end - start), max(max_seqlen_k, end)
            if not seq.block_table:      # warmup: nothing to store
                continue
            for i in range(start // bs, (end + bs - 1) // bs):
                first = seq.block_table[i] * bs
                slot_mapping.extend(range(first + max(start - i * bs, 0), first + min(end - i * bs, bs)))
        block_tables = None
        if cu_seqlens_k[-1] > cu_seqlens_q[-1]:    # some keys are already cached: attend through pages
            block_tables = self._tensor(self.padded_block_tables(seqs), torch.int32)
        input_ids = self._tensor(input_ids, torch.int64)
        positions = self._tensor(positions, torch.int64)
        set_context(True, self._tensor(cu_seqlens_q, torch.int32), self._tensor(cu_seqlens_k, torch.int32),
                    max_seqlen_q, max_seqlen_k, self._tensor(slot_mapping, torch.int32), None, block_tables)
        return input_ids, positions

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each seq computes its last token, whose slot is the next free one of its last block. A last
        token still PENDING (sampled by the step before, not yet on the host) is read on the device.

        Runs every step (every millisecond for a lone sequence), so the columns are built as Python
        lists, read into numpy in one pass, and travel in one copy."""
        n, block_size = len(seqs), self.block_size
        width = max(len(seq.block_table) for seq in seqs)
        tokens = [seq.last_token for seq in seqs]
        context_lens = [seq.num_tokens for seq in seqs]
        positions = [length - 1 for length in context_lens]
        slots = [seq.block_table[-1] * block_size + position % block_size for seq, position in zip(seqs, positions)]
        rows = self.sampled_rows           # a PENDING token's row in self.sampled; -1: on the host already
        sampled_rows = [rows[seq.seq_id] if token == PENDING else -1 for seq, token in zip(seqs, tokens)]
        block_tables = itertools.chain.from_iterable(seq.block_table + [-1] * (width - len(seq.block_table))
                                                     for seq in seqs)
        flat = np.fromiter(itertools.chain(tokens, positions, context_lens, slots, sampled_rows, block_tables),
                           dtype=np.int32, count=5 * n + n * width)
        flat = self._to_device(flat)
        columns = flat[:5 * n].view(5, n)
        set_context(False, slot_mapping=columns[3], context_lens=columns[2],
                    block_tables=flat[5 * n:].view(n, width))
        if len(self.sampled) == n and sampled_rows == list(range(n)):
            input_ids = self.sampled        # the last step's batch again, every token pending: as sampled
        elif max(sampled_rows) >= 0:
            input_ids = torch.where(columns[4] >= 0, self.sampled[columns[4].clamp(min=0)], columns[0])
        else:
            input_ids = columns[0]
        return input_ids, columns[1]

    # ---- running ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, is_prefill: bool,
                  num_seqs: int) -> torch.Tensor:
        hidden = None
        if self.graphs is not None and not self.enforce_eager:     # tests set enforce_eager to compare
            hidden = (self.graphs.prefill(input_ids, positions, num_seqs) if is_prefill
                      else self.graphs.decode(input_ids, positions))
        if hidden is None:
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool, block_copies: list[tuple[int, int]] = (),
            finished_seq_ids: list[int] = (), prompt_logprob_rows: list[tuple[int, int]] = ()
            ) -> SampledTokens | None:
        """Launch one step; rank 0 gets its sampled tokens (one per seq) as they will arrive.

        A prefill may carry completions split off a prompt computed in this very step (n > 1): they
        compute nothing, sample from their parent's logits, and get copies of its partial last block
        (block_copies: (source, destination)) once its KV is written. finished_seq_ids: sequences that
        ended since the last step (their sampling state is freed). prompt_logprob_rows: (index in seqs,
        k) of the prefilled sequences that want their prompt's log-probs (SampledTokens carries them)."""
        computed = [seq for seq in seqs if seq.num_scheduled_tokens] if is_prefill else seqs
        logits_rows = None
        if len(computed) < len(seqs):   # each split-off completion follows its parent: sample the parent's row
            logits_rows = list(itertools.accumulate(1 if seq.num_scheduled_tokens else 0 for seq in seqs))
            logits_rows = [row - 1 for row in logits_rows]
        input_ids, positions = self.prepare_prefill(computed) if is_prefill else self.prepare_decode(computed)
        if self.rank == 0:
            self.penalty_state.release(finished_seq_ids)
            tensors, penalty_rows = build_sampling_tensors(seqs, logits_rows, self.config.hf_config.vocab_size,
                                                           self.config.eos_token_ids, self.penalty_state, self.device)
        prompt_logprobs = None
        if prompt_logprob_rows:     # eager: they want the hidden state of every position
            hidden = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden)
            prompt_logprobs = self._prompt_logprobs(hidden, seqs, computed, prompt_logprob_rows)
        else:
            logits = self.run_model(input_ids, positions, is_prefill, len(computed))
        if block_copies:
            self.copy_blocks(block_copies)
        if self.rank == 0:
            output = self.sampler(logits, tensors)
            if penalty_rows is not None:
                self.penalty_state.count(penalty_rows, output.token_ids[tensors.penalties.rows])
            token_ids = output.token_ids
        else:
            token_ids = torch.empty(len(seqs), dtype=torch.int64, device=self.device)
        self.tp.broadcast_from_first(token_ids)       # every rank feeds them to its next decode step
        self.sampled, self.sampled_rows = token_ids, {seq.seq_id: i for i, seq in enumerate(seqs)}
        reset_context()
        return SampledTokens(output, prompt_logprobs) if self.rank == 0 else None

    def _prompt_logprobs(self, hidden: torch.Tensor, seqs: list[Sequence], computed: list[Sequence],
                         wanted: list[tuple[int, int]]):
        """Log-probs of the prompt tokens this step's positions predict: position p of a prompt of P
        tokens predicts token p + 1, for p < P - 1. Returns (spans, tensors): per wanted sequence, its
        first predicted token's index, how many, and its k; the tensors row by row (rank 0)."""
        offsets, offset = {}, 0
        for seq in computed:
            offsets[seq.seq_id] = offset
            offset += seq.num_scheduled_tokens
        rows, targets, spans = [], [], []
        for i, k in wanted:
            seq = seqs[i]
            start = seq.num_cached_tokens
            end = min(start + seq.num_scheduled_tokens, seq.num_prompt_tokens - 1)
            count = max(end - start, 0)
            spans.append((start + 1, count, k))
            if count:
                rows.extend(range(offsets[seq.seq_id], offsets[seq.seq_id] + count))
                targets.extend(seq.token_ids[start + 1:end + 1])
        if not rows:
            return spans, None
        tensors = prompt_logprobs(self.model.lm_head, hidden, self._tensor(rows, torch.int64),
                                  self._tensor(targets, torch.int64), max(k for _, k in wanted))
        return spans, tensors

    def copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (every layer, K and V), queued behind the step that wrote the sources."""
        source, destination = (self._tensor(list(column), torch.int64) for column in zip(*block_copies))
        cache = self.kv_cache.view(torch.uint8) if self.kv_cache.element_size() == 1 else self.kv_cache
        cache[:, :, destination] = cache[:, :, source]     # fp8 as bytes: not every device indexes float8

    def capture_cudagraph(self) -> None:
        hf, config = self.config.hf_config, self.config
        self.graphs = CudaGraphs(self.model, config.max_num_seqs, -(-config.max_model_len // self.block_size),
                                 prefill_graph_lengths(config.max_num_batched_tokens, config.max_model_len),
                                 hf.hidden_size, config.dtype, self.device)
        self.graphs.capture()
