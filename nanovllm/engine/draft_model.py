"""Speculative decoding's draft model (speculative_config method "draft_model"): a smaller checkpoint with the
target's vocabulary, built on every rank beside the target (the same tensor-parallel split), that proposes up
to k tokens a sequence, one forward pass a token.

Its KV cache is a second paged cache indexed by the target's block ids: a token's draft K/V lie at the slot
where its target K/V lie, so the BlockManager's block tables, prefix-cache hits, n > 1 block copies,
preemption and lookahead reservations serve both caches at once. The draft computes its K/V in every prefill
and plain decode step the target runs (ModelRunner.run calls `after_forward` and `after_sampling` with that
step's inputs and attention metadata), so it holds valid K/V wherever the target does but at one place: when a
sequence's k drafts are all accepted, the draft never computed the last draft's K/V. So each proposal starts
one token back, at num_cached_tokens - 1 (its K/V rewritten with the same token), and computes up to the last
token: usually two tokens; where plain steps came after such a hole (the adaptive policy), it starts at the
hole and computes those steps' tokens again, since they attended to it. (The prefix cache publishes no block
from the one with that hole on until a proposal has filled it: BlockManager.hold_back.)

A proposal: pass 1 computes those tokens and drafts token 1 from its last row; pass j computes draft j - 1 at
its position (its slot reserved by reserve_lookahead before the drafting) and drafts token j. A greedy row
drafts its argmax; a sampled row draws from q = softmax(logits / T), the request's temperature (no filters, no
penalties: any q leaves the output's law exact, layers/rejection_sampler.py), with keys of its own (a seeded
request's from its seed and the position, salted apart from the keys the verification draws with), and q is
kept for the verification.
"""
import numpy as np
import torch

from nanovllm.config import Config
from nanovllm.distributed.group import TensorParallelGroup
from nanovllm.engine import kv_cache as kv
from nanovllm.engine.cuda_graphs import CudaGraphs
from nanovllm.engine.model_loading import build_model
from nanovllm.engine.sampling_inputs import seeded_key
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_inputs import prepare_decode_rows
from nanovllm.layers.attention import Attention
from nanovllm.layers.sampler import Sampler
from nanovllm.utils.context import get_context, reset_context
from nanovllm.utils.transfer import to_device

DRAFT_SALT = 0x5EED_D4AF      # a draft's draw keys differ from the verification's keys at the same position


class Drafter:
    """What a drafter holds on one rank: its model, built as the target is but unquantized (a quantized
    target's method and its checkpoint's scales describe the target alone), a KV cache under the target's
    block ids (kv_cache.block_bytes counted both), and a sampler for its draws."""

    reads_verification = False      # whether verify() hands it the emitted tokens (after_verify)

    def __init__(self, config: Config, device: torch.device, group: TensorParallelGroup, rank: int, ops,
                 factory=None):
        self.config, self.device, self.tp, self.rank = config, device, group, rank
        self.block_size = config.kvcache_block_size
        self.model = build_model(config, config.draft_hf_config, config.speculative_config["model"], device, group,
                                 None, factory)
        for layer in self.attention_layers():
            layer.ops = ops
        self.kv_cache: torch.Tensor | None = None
        self.sampler = Sampler()

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = kv.allocate_kv_cache(self.config, num_blocks, self.device, self.attention_layers(),
                                             self.config.draft_hf_config)

    def exit(self) -> None:
        for layer in self.attention_layers():
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = None

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], lengths: list[int], first_tokens: list[list[int]]
                ) -> tuple[list[list[int]], torch.Tensor | None]:
        """lengths[i] drafts for seqs[i] (their slots reserved), round by round (_round_logits: the drafter's
        logits of the sequences still drafting). first_tokens[i]: seqs[i]'s tokens from num_cached_tokens - 1
        on (a worker's copy of a decode sequence holds its last token alone). Rank 0 gets (the drafts, q):
        q [R, vocab] float32, row j of seqs[i]'s rows (in the verification's order: len(drafts[i]) + 1 rows
        each) the law draft j + 1 was drawn from; None when every drafting row is greedy (a one-hot q: the
        verification then needs none). Other ranks get ([], None)."""
        active = [i for i, n in enumerate(lengths) if n > 0]
        if not active:
            return [[] for _ in seqs], None
        rounds = max(lengths)
        drafted = torch.empty(len(seqs), rounds, dtype=torch.int64, device=self.device)
        temperatures, keys, sampled = draw_inputs(seqs, rounds, self.device) if self.rank == 0 else (None, None, False)
        laws = []       # (rows of seqs, round, q [rows, vocab]) of the sampled drafts
        for j in range(rounds):
            rows = [i for i in active if lengths[i] > j]
            logits = self._round_logits(j, rows, seqs, first_tokens, drafted)
            token_ids = torch.empty(len(rows), dtype=torch.int64, device=self.device)
            if self.rank == 0:
                token_ids, q = draw_drafts(self.sampler, logits, rows, j, temperatures, keys, sampled,
                                           self.to_target_ids, self.config.hf_config.vocab_size)
                if q is not None:
                    laws.append((rows, j, q))
            self.tp.broadcast_from_first(token_ids)     # every rank feeds them to its next round
            drafted[rows, j] = token_ids
        return finish_proposal(drafted, lengths, laws, sampled, self.rank)

    to_target_ids = None            # a drafter with a vocabulary of its own maps its ids to the target's

    # ---- after the target's prefill and plain decode steps (ModelRunner.run) -----------------------------------
    def after_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seqs: list[Sequence],
                      computed: list[Sequence], finished_seq_ids: list[int]):
        """What the drafter keeps of a target step, taken under its attention metadata right after the
        target's forward pass and before the scheduler counts the step as computed (a constrained step is
        sampled later: the engine goes on meanwhile)."""
        return input_ids, positions

    def after_sampling(self, record, sampled: torch.Tensor) -> None:
        """The drafter's K/V of the step's positions, under its attention metadata (the caller sets it again),
        once the step's tokens (`sampled`, every row's) are known."""

    def after_block_copies(self, record, sampled: torch.Tensor) -> None:
        """After the step's block copies (n > 1), which carry the drafter's cache too: nothing to add."""


class DraftModel(Drafter):
    """The draft model of one rank and its KV cache (see the module's docstring): its drafting writes the
    drafts' K/V itself. Its passes are decode rows (one a token, each attending to its sequence's K/V up to
    its own position), so that they replay decode graphs of their own (capture_graphs): a drafting round,
    and the draft's K/V of a target decode step, are one launch each rather than a launch a kernel."""

    def __init__(self, config: Config, target: torch.nn.Module, device: torch.device, group: TensorParallelGroup,
                 rank: int, ops):
        super().__init__(config, device, group, rank, ops)
        self.graphs: CudaGraphs | None = None

    def capture_graphs(self, max_rows: int, max_num_blocks: int, logits_rows: int) -> None:
        """Decode graphs of the draft model, up to max_rows rows, the logits in them up to logits_rows."""
        hf = self.config.draft_hf_config
        self.graphs = CudaGraphs(self.model, max_rows, max_num_blocks, [], hf.hidden_size, self.config.dtype,
                                 self.device, logits_rows=logits_rows)
        self.graphs.capture()

    def exit(self) -> None:
        self.graphs = None
        super().exit()

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits: bool = True) -> torch.Tensor | None:
        """The draft's pass under the current context (decode rows: replayed where a graph holds them), and
        its logits of every row (logits=True)."""
        replay = None
        if self.graphs is not None and not get_context().is_prefill:
            replay = self.graphs.decode(input_ids, positions)
        hidden, in_graph = replay or (self.model(input_ids, positions), None)
        if not logits:
            return None
        return in_graph if in_graph is not None else self.model.compute_logits(hidden)

    @torch.inference_mode()
    def after_sampling(self, record: tuple[torch.Tensor, torch.Tensor], sampled: torch.Tensor) -> None:
        """The draft's K/V of the tokens a target step (prefill or decode) computed (record: its input ids and
        positions), under its attention metadata (the caller sets it again)."""
        self._forward(*record, logits=False)

    def after_verify(self, *args) -> None:
        """Nothing: the drafts' K/V were written as they were drafted."""

    def _round_logits(self, j: int, rows: list[int], seqs: list[Sequence], first_tokens: list[list[int]],
                      drafted: torch.Tensor) -> torch.Tensor | None:
        """Round 0 computes each sequence from one token back (see the module's docstring) to its last token,
        and drafts from its last row; round j computes its draft j at its position."""
        batch = [seqs[i] for i in rows]
        if j == 0:
            firsts = [first_tokens[i] for i in rows]
            counts = [len(f) for f in firsts]
            positions = prepare_decode_rows(batch, [seq.num_tokens - n for seq, n in zip(batch, counts)], counts,
                                            self.block_size, self.device)
            input_ids = to_device(np.array([t for f in firsts for t in f], dtype=np.int64), self.device)
            last_rows = None if max(counts) == 1 else to_device(np.cumsum(counts) - 1, self.device)
        else:
            positions = prepare_decode_rows(batch, [seq.num_tokens + j - 1 for seq in batch], [1] * len(batch),
                                            self.block_size, self.device)
            input_ids, last_rows = drafted[rows, j - 1], None
        logits = self._forward(input_ids, positions)
        reset_context()
        return logits if last_rows is None or logits is None else logits[last_rows]      # None: not rank 0


def draw_inputs(seqs: list[Sequence], rounds: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """[seqs, rounds] temperatures and draw keys: draft j of a seeded request drawn with a key of its seed,
    its completion's index and its position, salted; other rows' keys from one random number. And whether
    any row samples (read on the host: no wait for the device)."""
    params = [seq.sampling_params for seq in seqs]
    temperatures = np.repeat(np.array([p.temperature for p in params], dtype=np.float32)[:, None], rounds, 1)
    keys = int(torch.randint(0, 2 ** 62 - 2 ** 30, (1,))) + np.arange(len(seqs) * rounds, dtype=np.int64)
    keys = keys.reshape(len(seqs), rounds)
    for i, (seq, p) in enumerate(zip(seqs, params)):
        if p.seed is not None:
            keys[i] = [seeded_key(p.seed ^ DRAFT_SALT, seq.index, seq.num_tokens + j) for j in range(rounds)]
    return to_device(temperatures, device), to_device(keys, device), bool((temperatures > 0).any())


def draw_drafts(sampler: Sampler, logits: torch.Tensor, rows: list[int], j: int, temperatures: torch.Tensor,
                keys: torch.Tensor, sampled: bool, to_target_ids=None, vocab_size: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Round j's drafts for seqs `rows` from their logits: argmax where greedy, else a keyed draw from
    q = softmax(logits / T); and q (one-hot where greedy) when the batch has sampled rows. A head with a
    vocabulary of its own maps its ids to the target's (to_target_ids) and q onto the target's vocab_size."""
    index = to_device(np.array(rows, dtype=np.int64), logits.device)
    t, key = temperatures[index, j], keys[index, j]
    token_ids = sampler.draw(logits, t, key)
    q = None
    if sampled:
        scaled = logits.float() / torch.where(t > 0, t, 1.0).unsqueeze(1)
        q = torch.where((t > 0).unsqueeze(1), torch.softmax(scaled, dim=-1),
                        torch.zeros_like(scaled).scatter_(1, token_ids.unsqueeze(1), 1.0))
    if to_target_ids is not None:
        token_ids = to_target_ids(token_ids)
        if q is not None and q.size(1) != vocab_size:
            ids = to_target_ids(torch.arange(q.size(1), device=q.device))
            q = q.new_zeros(q.size(0), vocab_size).index_copy_(1, ids, q)
    return token_ids, q


def finish_proposal(drafted: torch.Tensor, lengths: list[int], laws: list, sampled: bool, rank: int
                    ) -> tuple[list[list[int]], torch.Tensor | None]:
    """Rank 0: (each sequence's drafts, their laws q in the verification's row order, or None when every
    drafting row is greedy); other ranks: ([], None)."""
    if rank != 0:
        return [], None
    host = drafted.tolist()
    drafts = [host[i][:n] for i, n in enumerate(lengths)]
    if not sampled:
        return drafts, None
    # a sequence's rows: one a draft, then its bonus row, whose q is never read
    firsts = np.concatenate([[0], np.cumsum([n + 1 for n in lengths])])
    q = torch.zeros(int(firsts[-1]), laws[0][2].size(1), dtype=torch.float32, device=drafted.device)
    for rows, j, law in laws:
        q[to_device((firsts[rows] + j).astype(np.int64), drafted.device)] = law
    return drafts, q
