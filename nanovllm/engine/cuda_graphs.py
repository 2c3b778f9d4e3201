"""CUDA graphs of the model's forward: one per decode batch-size bucket, and one per length bucket of a
lone prompt's prefill.

A step whose shape fits a bucket copies its inputs into the bucket's static buffers and replays the
graph: one launch instead of ~300 from Python. Decode runs that way every step, and so does speculative
decoding's verification (its rows are decode rows). A lone prompt's prefill
(one sequence, nothing cached) is what a user waits on before the first token: eager, its launches cost
the host ~17 ms for a 512-token prompt on an H100, against ~2 ms of GPU work. A prefill graph is
captured for the bucket's length: its padding tokens store nothing (slot -1) and no query attends to
them (the sequence's length travels in cu_seqlens), and the attention kernel's grid, fixed at capture,
covers the bucket's length; tiles past the prompt's end exit at once.

A decode graph of up to `logits_rows` rows also computes the logits (into one static buffer): a lone
sequence's step, or a verification's few rows, is bound by the host's launches, and the LM head's would be
one more. Above that, and for prefill (the LM head picks its last rows through the context's cu_seqlens), the
logits stay eager.
"""
import torch
from torch import nn

from nanovllm.kernels.dependent_launch import MAX_ROWS as DEPENDENT_LAUNCH_ROWS
from nanovllm.kernels.dependent_launch import dependent_launches
from nanovllm.utils.context import get_context, reset_context, set_context


def cuda_graph_batch_sizes(max_rows: int) -> list[int]:
    """Decode batch buckets: 1, 2, 4, 8, then every multiple of 16, up to the first that holds max_rows
    (at most 512)."""
    sizes = [1, 2, 4, 8] + list(range(16, 513, 16))
    return sizes[:next((i + 1 for i, bs in enumerate(sizes) if bs >= max_rows), len(sizes))]


def shared_prefix_batch_sizes(decode_sizes: list[int]) -> list[int]:
    """The decode buckets that also get a graph whose attention reads shared pages once for their rows
    (a step's context.shared_prefix): 8, 16, 32, 64, then every multiple of 64, and the largest bucket (a step
    that groups rows saves more than a wider bucket's padding rows cost)."""
    sizes = [bs for bs in decode_sizes if bs in (8, 16, 32) or bs % 64 == 0]
    return sizes + ([decode_sizes[-1]] if decode_sizes[-1] >= 8 and decode_sizes[-1] not in sizes else [])


def decode_graph_rows(max_num_seqs: int, num_speculative_tokens: int = 0) -> int:
    """The most rows of a decode-shaped step: one a sequence, or with speculative decoding a verification's
    k + 1 a sequence (step_inputs.prepare_verify); the decode graphs are captured up to it."""
    return max_num_seqs * (1 + num_speculative_tokens)


def prefill_graph_lengths(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """Lone-prompt prefill buckets: 64, 128, ... 2048 tokens, within both limits."""
    largest = min(max_num_batched_tokens, max_model_len, 2048)
    return [n for n in (64, 128, 256, 512, 1024, 2048) if n <= largest]


class CudaGraphs:
    """Captures and replays the forward of `model` for each bucket; all graphs share one memory pool."""

    def __init__(self, model: nn.Module, max_decode_rows: int, max_num_blocks: int, prefill_lengths: list[int],
                 hidden_size: int, dtype: torch.dtype, device: torch.device, logits_rows: int = 0,
                 shared_prefixes: bool = False):
        """logits_rows: the decode graphs of at most this many rows compute the logits too (0: none; the
        LM head must need no collective: one rank). shared_prefixes: decode steps may group rows that share
        pages (the attention backend reads them once), so shared_prefix_batch_sizes' buckets get a second
        graph each."""
        self.model = model
        self.decode_sizes = cuda_graph_batch_sizes(max_decode_rows)
        self.logits_rows = max((bs for bs in self.decode_sizes if bs <= logits_rows), default=0)
        self.prefill_lengths = prefill_lengths
        rows = max(self.decode_sizes[-1], prefill_lengths[-1] if prefill_lengths else 0)
        self.vars = dict(
            input_ids=torch.zeros(rows, dtype=torch.int64, device=device),
            positions=torch.zeros(rows, dtype=torch.int64, device=device),
            slot_mapping=torch.full((rows,), -1, dtype=torch.int32, device=device),
            context_lens=torch.ones(self.decode_sizes[-1], dtype=torch.int32, device=device),
            block_tables=torch.zeros(self.decode_sizes[-1], max_num_blocks, dtype=torch.int32, device=device),
            decode_order=torch.arange(self.decode_sizes[-1], dtype=torch.int32, device=device),
            # a shared prefix's (step_inputs.prepare_decode): every item holds two rows or more
            shared_lens=torch.zeros(self.decode_sizes[-1], dtype=torch.int32, device=device),
            shared_items=torch.zeros(self.decode_sizes[-1] // 2, 3, dtype=torch.int32, device=device),
            shared_members=torch.zeros(self.decode_sizes[-1], dtype=torch.int32, device=device),
            cu_seqlens=torch.zeros(2, dtype=torch.int32, device=device),
            outputs=torch.zeros(rows, hidden_size, dtype=dtype, device=device),
        )
        self.rows = torch.arange(self.decode_sizes[-1], dtype=torch.int32, device=device)
        self.order_written = 0      # vars["decode_order"] holds rows[n:] from n = order_written on
        self.decode_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.shared_sizes = shared_prefix_batch_sizes(self.decode_sizes) if shared_prefixes else []
        self.shared_graphs: dict[int, torch.cuda.CUDAGraph] = {}     # decode graphs reading shared prefixes
        self.shared_written = (0, 0)    # the shared_items / shared_lens rows the last such step wrote
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    # ---- capture ----------------------------------------------------------------------------------------
    def _capture(self, num_tokens: int, with_logits: bool = False) -> torch.cuda.CUDAGraph:
        """The forward over the first num_tokens rows, under the context set by the caller (and the logits
        of every row: with_logits)."""
        v = self.vars

        def forward():
            hidden = v["outputs"][:num_tokens] = self.model(v["input_ids"][:num_tokens], v["positions"][:num_tokens])
            if with_logits:
                v["logits"][:num_tokens] = self.model.compute_logits(hidden)
        forward()       # warm up
        graph = torch.cuda.CUDAGraph()
        # thread_local: a worker's death may make the monitor abort NCCL (which frees memory) from its
        # own thread mid-capture; the default global mode would forbid that and leave NCCL half torn down
        with torch.cuda.graph(graph, self.pool, capture_error_mode="thread_local"):
            forward()
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize()
        reset_context()
        return graph

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, so that smaller graphs reuse its memory."""
        v = self.vars
        if self.logits_rows:          # the logits' static buffer, shaped as a decode row's logits
            set_context(False)
            logits = self.model.compute_logits(v["outputs"][:1])
            reset_context()
            v["logits"] = logits.new_empty(self.logits_rows, logits.size(-1))
        for n in reversed(self.prefill_lengths):
            v["cu_seqlens"][1] = n
            set_context(True, v["cu_seqlens"], v["cu_seqlens"], n, n, v["slot_mapping"][:n])
            self.prefill_graphs[n] = self._capture(n)
        for graphs, sizes in ((self.decode_graphs, self.decode_sizes), (self.shared_graphs, self.shared_sizes)):
            for bs in reversed(sizes):
                shared = None
                if graphs is self.shared_graphs:     # no item has rows at capture: nothing shared, as it reads
                    shared = (v["shared_lens"][:bs], v["shared_items"][:bs // 2], v["shared_members"][:bs])
                set_context(False, slot_mapping=v["slot_mapping"][:bs], context_lens=v["context_lens"][:bs],
                            block_tables=v["block_tables"][:bs], decode_order=v["decode_order"][:bs],
                            shared_prefix=shared)
                # a step of few sequences is a chain of short kernels: each starts while the one before ends
                with dependent_launches(bs <= DEPENDENT_LAUNCH_ROWS):
                    graphs[bs] = self._capture(bs, with_logits=bs <= self.logits_rows)

    # ---- replay -------------------------------------------------------------------------------------------
    def _inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The rows every graph reads; padding rows store nothing (slot -1)."""
        n, v = input_ids.size(0), self.vars
        v["input_ids"][:n] = input_ids
        v["positions"][:n] = positions
        v["slot_mapping"].fill_(-1)
        v["slot_mapping"][:n] = slot_mapping

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(hidden states, logits or None: the bucket's graph computes none) of a decode step under the
        current context, or None: no bucket holds the batch. The logits are a static buffer's rows, valid
        until the next replay."""
        bs = input_ids.size(0)
        if bs > self.decode_sizes[-1]:
            return None
        context, v = get_context(), self.vars
        self._inputs(input_ids, positions, context.slot_mapping)
        v["context_lens"].fill_(1)                   # padding rows read one slot of block 0: harmless
        v["context_lens"][:bs] = context.context_lens
        v["block_tables"].zero_()
        v["block_tables"][:bs, :context.block_tables.size(1)] = context.block_tables
        self._decode_order(bs, context.decode_order)
        graphs, sizes = self.decode_graphs, self.decode_sizes
        if context.shared_prefix is not None and self.shared_sizes:
            graphs, sizes = self.shared_graphs, self.shared_sizes
        bucket = next(b for b in sizes if b >= bs)
        self._shared_prefix(context.shared_prefix if graphs is self.shared_graphs else None)
        graphs[bucket].replay()
        return v["outputs"][:bs], (v["logits"][:bs] if bucket <= self.logits_rows else None)

    def _shared_prefix(self, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
        """The step's groups into the static buffers; rows past them read nothing shared (0 tokens, items of
        no rows), which is what any graph reads after a step without groups."""
        v = self.vars
        num_items, num_rows = (0, 0) if shared is None else (len(shared[1]), len(shared[0]))
        items_written, rows_written = self.shared_written
        if shared is not None:
            v["shared_lens"][:num_rows] = shared[0]
            v["shared_items"][:num_items] = shared[1]
            v["shared_members"][:len(shared[2])] = shared[2]
        if items_written > num_items:
            v["shared_items"][num_items:items_written] = 0
        if rows_written > num_rows:
            v["shared_lens"][num_rows:rows_written] = 0
        self.shared_written = (num_items, num_rows)

    def _decode_order(self, bs: int, order: torch.Tensor | None) -> None:
        """A permutation of the bucket's rows: the step's order (None: as they come), then the padding rows in
        place. Written as little as it can be (a lone sequence's order is [0]: nothing): one stream's steps are
        host-bound, and each copy is a launch."""
        v = self.vars["decode_order"]
        if order is not None and bs > 1:
            v[:bs] = order
            written = bs
        else:
            written = 0
        if self.order_written > written:
            v[written:self.order_written] = self.rows[written:self.order_written]
        self.order_written = written

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, num_seqs: int) -> torch.Tensor | None:
        """Hidden states of a lone prompt's prefill under the current context, or None: the step is not
        one sequence with nothing cached, or no bucket holds it."""
        n, context = input_ids.size(0), get_context()
        if (num_seqs != 1 or context.block_tables is not None or context.slot_mapping.numel() != n
                or not self.prefill_lengths or n > self.prefill_lengths[-1]):
            return None
        v = self.vars
        self._inputs(input_ids, positions, context.slot_mapping)
        v["cu_seqlens"].copy_(context.cu_seqlens_q)
        self.prefill_graphs[next(b for b in self.prefill_lengths if b >= n)].replay()
        return v["outputs"][:n]
