"""ModelRunner's step inputs: which tokens, at which positions, written to which cache slots."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sampling_inputs import argmax_suffices, build_sampling_tensors
from nanovllm.engine.spec_decode import count_accepted
from nanovllm.engine.sequence import Sequence
from nanovllm.utils.context import get_context, reset_context

BS = 16


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=BS, max_model_len=256, num_kvcache_blocks=32) as engine:
        yield engine


def seq(tokens, block_table, num_cached=0, num_scheduled=None):
    s = Sequence(list(tokens), SamplingParams(), BS)
    s.block_table = list(block_table)
    s.num_cached_tokens = num_cached
    s.num_scheduled_tokens = len(s) - num_cached if num_scheduled is None else num_scheduled
    return s


def test_prefill_of_fresh_prompts_packs_them(llm):
    runner = llm.model_runner
    a, b = seq(range(20), [3, 7]), seq(range(100, 105), [9])
    input_ids, positions = runner.prepare_prefill([a, b])
    ctx = get_context()
    assert input_ids.tolist() == list(range(20)) + list(range(100, 105))
    assert positions.tolist() == list(range(20)) + list(range(5))
    assert ctx.is_prefill and ctx.cu_seqlens_q.tolist() == ctx.cu_seqlens_k.tolist() == [0, 20, 25]
    assert (ctx.max_seqlen_q, ctx.max_seqlen_k) == (20, 20)
    assert ctx.slot_mapping.tolist() == ([3 * BS + i for i in range(16)] + [7 * BS + i for i in range(4)]
                                         + [9 * BS + i for i in range(5)])
    assert ctx.block_tables is None              # nothing cached: attend over the packed K/V
    reset_context()


def test_prefill_after_a_cached_prefix_or_a_chunk_reads_through_pages(llm):
    runner = llm.model_runner
    cached = seq(range(40), [1, 2, 5], num_cached=16)                     # first block from the cache
    chunk = seq(range(50), [4, 6, 8, 10], num_cached=20, num_scheduled=10)  # tokens 20..29 of 50
    input_ids, positions = runner.prepare_prefill([cached, chunk])
    ctx = get_context()
    assert input_ids.tolist() == list(range(16, 40)) + list(range(20, 30))
    assert positions.tolist() == list(range(16, 40)) + list(range(20, 30))
    assert ctx.cu_seqlens_q.tolist() == [0, 24, 34] and ctx.cu_seqlens_k.tolist() == [0, 40, 70]
    assert ctx.slot_mapping.tolist() == ([2 * BS + i for i in range(16)] + [5 * BS + i for i in range(8)]
                                         + [6 * BS + i for i in range(4, 14)])
    assert ctx.block_tables.tolist() == [[1, 2, 5, -1], [4, 6, 8, 10]]
    reset_context()


def test_decode_computes_each_last_token_in_its_next_slot(llm):
    runner = llm.model_runner
    a = seq(range(17), [3, 7], num_cached=16)       # token 17 is the first of block 7
    b = seq(range(5), [2], num_cached=4)
    input_ids, positions = runner.prepare_decode([a, b])
    ctx = get_context()
    assert input_ids.tolist() == [16, 4] and positions.tolist() == [16, 4]
    assert not ctx.is_prefill and ctx.context_lens.tolist() == [17, 5]
    assert ctx.slot_mapping.tolist() == [7 * BS + 0, 2 * BS + 4]
    assert ctx.block_tables.tolist() == [[3, 7], [2, -1]]
    assert ctx.decode_order.tolist() == [0, 1]      # attention takes the longest context first
    reset_context()


def test_decode_attention_takes_the_rows_longest_context_first(llm):
    """A permutation of the rows, by context length, ties in row order: no long sequence is left to run alone
    at the end of the attention kernel."""
    runner = llm.model_runner
    seqs = [seq(range(n), [i], num_cached=n - 1) for i, n in enumerate((3, 12, 7, 12, 1))]
    runner.prepare_decode(seqs)
    ctx = get_context()
    assert ctx.context_lens.tolist() == [3, 12, 7, 12, 1]
    assert ctx.decode_order.tolist() == [1, 3, 2, 0, 4]
    reset_context()


def test_verification_is_a_decode_step_of_one_row_per_token(llm):
    """Each sequence's last token and its drafts are decode rows: each row's K/V goes to its own slot, and
    it attends to its sequence's keys up to its own position (its context length) through the sequence's
    block table, so that the decode kernels and graphs serve it."""
    from nanovllm.engine.step_inputs import prepare_verify
    a = seq(range(15), [3, 7], num_cached=14)       # last token at position 14; drafts at 15 (block 3), 16 (block 7)
    b = seq(range(5), [2], num_cached=4)            # last token at position 4, no draft
    input_ids, positions = prepare_verify([a, b], [[90, 91], []], BS, llm.model_runner.device)
    ctx = get_context()
    assert input_ids.tolist() == [14, 90, 91, 4] and positions.tolist() == [14, 15, 16, 4]
    assert not ctx.is_prefill and ctx.context_lens.tolist() == [15, 16, 17, 5]
    assert ctx.slot_mapping.tolist() == [3 * BS + 14, 3 * BS + 15, 7 * BS + 0, 2 * BS + 4]
    assert ctx.block_tables.tolist() == [[3, 7], [3, 7], [3, 7], [2, -1]]
    assert ctx.decode_order.tolist() == [2, 1, 0, 3]
    reset_context()


def test_sampling_reads_each_sequence_temperature(llm):
    seqs = [Sequence([1], SamplingParams(temperature=t), BS) for t in (0.0, 0.7)]
    runner = llm.model_runner
    tensors, _ = build_sampling_tensors(seqs, None, 512, frozenset(), runner.penalty_state, runner.device)
    assert tensors.temperatures.tolist() == pytest.approx([0.0, 0.7])


def test_a_steps_logit_edits_reach_each_row_by_its_own_params(llm):
    """allowed_token_ids and logit_bias of params shared by rows that are not adjacent (n > 1, or one
    SamplingParams for a batch), beside rows of other params and rows with neither: each row's logits are
    edited by its own params alone (the step sends each distinct params' arrays once)."""
    shared = SamplingParams(allowed_token_ids=[3, 5, 8], logit_bias={5: 2.0, 300: -1.0})
    bias_only = SamplingParams(logit_bias={1: 0.5})
    allowed_only = SamplingParams(allowed_token_ids=[2])
    row_params = [shared, SamplingParams(), bias_only, shared, allowed_only, shared]
    seqs = [Sequence([1], p, BS) for p in row_params]
    runner = llm.model_runner
    tensors, _ = build_sampling_tensors(seqs, None, 512, frozenset(), runner.penalty_state, runner.device)
    logits = torch.zeros(len(seqs), 512)
    runner.sampler._edit(logits, tensors, on_kernels=False)
    for row, p in enumerate(row_params):
        expected = torch.zeros(512)
        if p.allowed_token_ids:
            expected.fill_(float("-inf"))
            expected[p.allowed_token_ids] = 0.0
        for token, value in (p.logit_bias or {}).items():
            expected[token] += value
        assert torch.equal(logits[row], expected), row


@pytest.mark.parametrize("params, argmax", [
    (dict(temperature=0.0), True),
    (dict(temperature=0.0, top_k=5, top_p=0.5), True),          # filters do not move a greedy row's argmax
    (dict(temperature=0.7), False),
    (dict(temperature=0.0, logprobs=2), False),                 # log-probs are reported
    (dict(temperature=0.0, repetition_penalty=1.2), False),     # penalties edit the logits
    (dict(temperature=0.0, min_tokens=3), False),               # eos is banned for the first 3 tokens
], ids=["greedy", "greedy-filters", "sampled", "logprobs", "penalty", "min_tokens"])
def test_a_step_of_plain_greedy_rows_is_sampled_by_argmax_alone(llm, params, argmax):
    """A step whose rows are all greedy, with nothing that edits or reports on the logits, is drawn by one
    argmax (the sampler's kernels would give the same: ties to the lowest id); any other row keeps the
    sampler's whole path for the step."""
    runner = llm.model_runner
    seqs = [Sequence([1, 2], SamplingParams(**params), BS), Sequence([3], SamplingParams(temperature=0.0), BS)]
    tensors, _ = build_sampling_tensors(seqs, None, 512, frozenset({0}), runner.penalty_state, runner.device)
    assert tensors.argmax_only is argmax
    assert argmax_suffices(seqs) is argmax
    logits = torch.randn(2, 512)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1           # a tie: the lower id
    if argmax:
        assert runner.sampler(logits, tensors).token_ids.tolist() == [int(logits[0].argmax()), 7]


def test_min_tokens_leaves_argmax_to_the_rows_past_it():
    """Greedy rows under min_tokens need the sampler (eos banned) until each has that many completion tokens;
    the check goes by each row's own progress, whatever the rows share."""
    shared, plain = SamplingParams(temperature=0.0, min_tokens=2), SamplingParams(temperature=0.0)
    rows = [Sequence([1, 2], shared, BS), Sequence([3], shared, BS), Sequence([4], plain, BS)]
    for row, gained in zip(rows, (3, 2, 0)):
        for _ in range(gained):
            row.append_token(7)
    assert argmax_suffices(rows)
    assert not argmax_suffices(rows + [Sequence([5], shared, BS)])    # a row with none yet
    assert not argmax_suffices(rows + [Sequence([5], SamplingParams(temperature=0.7), BS)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("params, builds", [
    (dict(temperature=0.0), False),
    (dict(temperature=0.0, logprobs=1), True),          # log-probs are reported: the sampler's path
    (dict(temperature=0.8, seed=3), True),
], ids=["greedy", "greedy-logprobs", "sampled"])
def test_a_step_of_plain_greedy_rows_builds_no_sampling_inputs(llm, monkeypatch, params, builds):
    """Where argmax alone draws every row of a step, the runner builds and copies no sampling inputs (a lone
    small model's step is host work), and its tokens are the sampler's: the same as with the inputs built."""
    import nanovllm.engine.model_runner as model_runner
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    sampling = SamplingParams(max_tokens=6, ignore_eos=True, **params)
    calls = []

    def counted(*args, **kwargs):
        calls.append(len(args[0]))
        return build_sampling_tensors(*args, **kwargs)
    monkeypatch.setattr(model_runner, "build_sampling_tensors", counted)
    fast = [out["token_ids"] for out in llm.generate(prompts, sampling, use_tqdm=False)]
    assert bool(calls) is builds
    monkeypatch.setattr(model_runner, "argmax_suffices", lambda seqs: False)    # every step builds its inputs
    calls.clear()
    full = [out["token_ids"] for out in llm.generate(prompts, sampling, use_tqdm=False)]
    assert calls and fast == full and all(len(t) == 6 for t in fast)


@pytest.mark.timeout(120)       # an engine's step loop: a regression fails instead of hanging
def test_a_greedy_verification_leaves_the_accepted_count_to_the_host(tiny_model):
    """Greedy rows verify by their argmax alone (no accepted count on the device; the engine counts the
    drafts equal to the tokens, spec_decode.count_accepted); a sampled row takes the rejection sampler."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "adaptive": False}
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=BS, max_model_len=1024, speculative_config=spec) as llm:
        runner, outcomes = llm.model_runner, []
        verify = runner.verify
        runner.verify = lambda *args: outcomes.append(verify(*args)) or outcomes[-1]
        prompt = list(range(512)) + [5, 6]      # every token of the vocabulary in it: each step drafts
        for temperature in (0.0, 0.8):
            outcomes.clear()
            llm.generate([prompt], SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
            assert outcomes and all((accepted is None) == (temperature == 0.0) for _, accepted in outcomes)
    assert count_accepted([5, 6, 9, 4, 2, 3, 8], [[5, 7], [4, 2], []]) == [1, 2, 0]


def test_kv_cache_is_one_tensor_bound_into_every_layer(llm):
    runner, hf = llm.model_runner, llm.config.hf_config
    assert runner.kv_cache.shape == (2, hf.num_hidden_layers, 32, BS, hf.num_key_value_heads, hf.head_dim)
    for i, layer in enumerate(runner._attention_layers()):
        assert layer.k_cache.data_ptr() == runner.kv_cache[0, i].data_ptr()
        assert layer.v_cache.data_ptr() == runner.kv_cache[1, i].data_ptr()


def test_cached_path_warmup_touches_no_scheduler_state(llm):
    """CUDA runs it once at start, before any request: it writes scratch K/V into blocks 0 and 1
    and leaves the block manager alone."""
    bm = llm.scheduler.block_manager
    before = llm.generate([[1, 2, 3] * 7], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    free_before = list(bm.free_block_ids)
    llm.model_runner.warmup_cached_paths()
    assert bm.used_block_ids == set() and list(bm.free_block_ids) == free_before
    bm.hash_to_block_id.clear()          # this late, blocks 0/1 may hold a cached prefix: recompute it
    after = llm.generate([[1, 2, 3] * 7], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert after == before
