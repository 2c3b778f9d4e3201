"""Warm-up runs of a rank's model at start-up, on a GPU, so that no request waits for a kernel to compile:
one before the KV cache exists (a prefill at the full token budget, whose peak activation memory the
cache's sizing then leaves room for, and every kernel variant a batch can reach; with speculative decoding
also a verification step's sampling at its most rows, and a draft model's LM head and drafts' laws) and one after (the paths that read K/V through the
block table). The sampler warms its own kernels (Sampler.warmup).

Each takes the rank's ModelRunner and runs real steps through it (`runner.run`)."""
import torch
import torch.distributed as dist

from nanovllm.engine.sampling_inputs import build_verify_tensors
from nanovllm.engine.sequence import Sequence
from nanovllm.kernels.decode_attention import large_batch, unsplit_batch
from nanovllm.kernels.prefill_attention import SHORT_KEYS
from nanovllm.layers.linear import dense_warmup_token_counts
from nanovllm.layers.quantization import warmup_token_counts
from nanovllm.layers.rejection_sampler import DraftRows
from nanovllm.sampling_params import MAX_LOGPROBS, SamplingParams


def warmup_model(runner) -> None:
    """One prefill at the full token budget: compiles kernels and shows peak activation memory."""
    config = runner.config
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    seq_len = min(config.max_num_batched_tokens, config.max_model_len)
    budget = seq_len * max(1, min(config.max_num_batched_tokens // seq_len, config.max_num_seqs))
    _warm_prefill(runner, budget)
    # each kernel variant a batch can reach in the layers' quantization methods (MoE, FP8 GEMMs), and
    # prefill attention's tiles for short key ranges (the budget's prompts may be long enough for its others)
    extra = set(warmup_token_counts(runner.model)) | {SHORT_KEYS}
    for num_tokens in sorted(extra):
        if num_tokens < budget:
            _warm_prefill(runner, num_tokens)
    # the LM head's skinny GEMM sees one row per sequence: batches of that many one-token prompts
    for num_seqs in dense_warmup_token_counts():
        if num_seqs <= min(budget, config.max_num_seqs):
            _warm_prefill(runner, num_seqs, longest=1)
    if config.speculative_config:
        warmup_verify(runner)
    torch.cuda.empty_cache()


# the costliest sampling a row can ask for: every filter, every penalty (a private state copy per row), log-probs
COSTLIEST = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.1,
                           presence_penalty=0.1, frequency_penalty=0.1, logprobs=MAX_LOGPROBS)


def warmup_verify(runner) -> None:
    """Speculative decoding: a verification step's sampling at its most rows (as many sequences as the step
    can hold, each with a full draft), so that its [rows, vocab] logits, probabilities and penalty copies are
    in the peak the KV cache's sizing leaves room for; a plain step samples one row a sequence. The rows'
    hidden states are zeros through the LM head (no KV is read: the cache does not exist yet)."""
    config = runner.config
    k = config.speculative_config["num_speculative_tokens"]
    num_seqs = max(1, min(config.max_num_seqs, config.max_num_batched_tokens // (k + 1)))
    hidden = torch.zeros(num_seqs * (k + 1), config.hf_config.hidden_size, dtype=config.dtype, device=runner.device)
    logits = runner.model.lm_head.logits_of(hidden)         # every rank: the LM head gathers to rank 0
    draft_probs = None
    if runner.draft is not None:    # a draft model's LM head at each row count a step drafts for (its GEMM's
        draft_hf = config.draft_hf_config                     # variants), and the laws q of a step's drafts
        for rows in dense_warmup_token_counts():
            if rows <= num_seqs:
                runner.draft.model.lm_head.logits_of(torch.zeros(rows, draft_hf.hidden_size, dtype=config.dtype,
                                                                 device=runner.device))
        if runner.rank == 0:
            draft_probs = torch.zeros(len(hidden), draft_hf.vocab_size, dtype=torch.float32, device=runner.device)
            # the drafts' draws over the drafter's own vocabulary (an EAGLE-3 head's may be smaller)
            draft_vocab = getattr(runner.draft.model, "draft_vocab_size", draft_hf.vocab_size)
            runner.draft.sampler.draw(torch.zeros(2, draft_vocab, dtype=config.dtype, device=runner.device),
                                      torch.tensor([0.0, 1.0], device=runner.device),
                                      torch.arange(2, device=runner.device))
    if runner.rank != 0:
        return
    seqs = [Sequence([0], COSTLIEST, runner.block_size) for _ in range(num_seqs)]
    for seq in seqs:
        seq.num_scheduled_tokens = 1                        # a row that samples (penalized as a decode row is)
    drafts = [[0] * k for _ in seqs]
    tensors, _ = build_verify_tensors(seqs, drafts, config.hf_config.vocab_size, config.eos_token_ids,
                                      runner.penalty_state, runner.device)
    runner.rejection_sampler(logits, tensors, DraftRows.from_drafts(drafts, runner.device), draft_probs)
    runner.penalty_state.release([seq.seq_id for seq in seqs])


def _warm_prefill(runner, num_tokens: int, longest: int | None = None) -> None:
    """A prefill of num_tokens tokens in all, as sequences of at most `longest` (default max_model_len)
    tokens (the budget's: as many sequences of seq_len as fit, or one shorter one)."""
    longest = longest or runner.config.max_model_len
    seqs = []
    while num_tokens > 0:
        length = min(num_tokens, longest)
        seqs.append(Sequence([0] * length, SamplingParams(), runner.block_size))
        seqs[-1].num_scheduled_tokens = length
        num_tokens -= length
    runner.run(seqs, True)


def warmup_cached_paths(runner) -> None:
    """Compile the kernels that read K/V through the block table (a prefill continuing a cached
    prefix, and an eager decode) now, not inside the first request that needs them."""
    block_size = runner.block_size
    if runner.num_kvcache_blocks < 2:
        return
    seq = Sequence([0] * (block_size + 1), SamplingParams(), block_size)
    seq.block_table = [0, 1]                # scratch blocks: the scheduler has handed out nothing yet
    seq.num_cached_tokens, seq.num_scheduled_tokens = block_size - 1, 1
    runner.run([seq], True)
    seq.num_cached_tokens = block_size
    runner.run([seq], False)                # before any graph is captured: eager
    # batches large enough for decode attention's other kernels (eager steps: enforce_eager, a draft's): a small
    # batch's tiles unsplit (a bf16 cache on a GPU), then a large batch's tiles; where the backend reads the
    # pages that rows share once for them (shared_prefixes.py), each such batch that way too, and two rows
    # (a small batch's tiles; the plain ones are the lone row's above)
    if runner.share_prefixes and runner.config.max_num_seqs >= 2:
        _warm_decode(runner, 2, [True])
    hf_configs = [c for c in (runner.config.hf_config, runner.config.draft_hf_config) if c is not None]
    for first_batch in (unsplit_batch, large_batch):
        num_seqs = max(first_batch(max(1, c.num_key_value_heads // runner.world_size), runner.device,
                                   runner.config.kv_cache_dtype) or 0 for c in hf_configs)
        if not num_seqs:            # no such kernel here (the same on every rank: one device type, one cache dtype)
            continue
        if runner.world_size > 1:   # every rank runs the same steps (their collectives pair up), whatever its SMs
            num_seqs = int(runner.tp.all_reduce(torch.tensor([num_seqs], device=runner.device),
                                                dist.ReduceOp.MAX).item())
        if num_seqs <= runner.config.max_num_seqs:
            _warm_decode(runner, num_seqs, [False, True] if runner.share_prefixes else [False])
    if runner.draft is not None:
        _warm_eager_decodes(runner)
    # one token after a long cached prefix: the prefill kernel's tiles for long key ranges
    long_prefix = SHORT_KEYS + 1
    num_blocks = long_prefix // block_size + 1
    if runner.config.max_model_len > long_prefix and runner.num_kvcache_blocks >= num_blocks:
        seq = Sequence([0] * (long_prefix + 1), SamplingParams(), block_size)
        seq.block_table = list(range(num_blocks))
        seq.num_cached_tokens, seq.num_scheduled_tokens = long_prefix, 1
        runner.run([seq], True)


def _warm_decode(runner, num_seqs: int, shared: list[bool]) -> None:
    """Eager decode steps of num_seqs sequences over the same two scratch blocks, each with the rows' shared
    first page read once for them (True) or by each row (False)."""
    block_size = runner.block_size
    seqs = [Sequence([0] * (block_size + 1), SamplingParams(), block_size) for _ in range(num_seqs)]
    for seq in seqs:
        seq.block_table, seq.num_cached_tokens = [0, 1], block_size
    share_prefixes = runner.share_prefixes
    try:
        for share in shared:
            runner.share_prefixes = share
            runner.run(seqs, False)
    finally:
        runner.share_prefixes = share_prefixes


def _warm_eager_decodes(runner) -> None:
    """An EAGLE-3 head runs its decode steps eagerly, and so does a draft model beyond its largest graph or with
    enforce_eager (the target replays graphs with fixed buffers), so its
    attention meets the variants Triton compiles by the step's layout: batches of 1, 2 and 4 sequences (the
    inputs' columns start 4, 8 or 16 bytes into one buffer: step_inputs.prepare_decode) over block tables
    1, 2 and 16 blocks wide (the attention kernels no longer specialize on a table's width; kept as a check)."""
    block_size = runner.block_size
    most = min(runner.num_kvcache_blocks, -(-runner.config.max_model_len // block_size))
    for width in (1, 2, 16):
        if width > most:
            continue
        for num_seqs in (1, 2, 4):
            seqs = []
            for _ in range(num_seqs):
                seq = Sequence([0] * (width * block_size), SamplingParams(), block_size)
                seq.block_table = list(range(width))    # scratch blocks: the scheduler has handed out nothing yet
                seq.num_cached_tokens = width * block_size - 1
                seqs.append(seq)
            runner.run(seqs, False)
