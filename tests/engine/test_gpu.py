"""The CUDA path end to end: Triton kernels and CUDA graphs (decode, a lone prompt's prefill), in bf16, against
transformers on the same GPU with a random-weight checkpoint of Qwen3-0.6B's shape."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence
from nanovllm.utils.context import reset_context
from benchmarks.random_checkpoint import QWEN3_0_6B
from groupings import record_groupings
from oracle import hf_greedy, load_hf_model
from teacher_forcing import NUM_FORCED, TIE_MARGIN, compare, forced_logprobs, hf_forced_logprobs, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint(dtype=torch.bfloat16, **QWEN3_0_6B)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), max_model_len=1024, gpu_memory_utilization=0.5) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf_model(model_dir, dtype=torch.bfloat16, device="cuda")


def test_teacher_forced_logprobs_agree_with_transformers(llm, hf):
    """Random weights give flat distributions full of near-ties, which two correct bf16
    implementations may break differently; top-1 agreement is required (>= 99%) where transformers'
    own top-1 leads by more than TIE_MARGIN, and the whole distributions must agree closely."""
    prompts = random_prompts(8, seed=0)
    continuations = random_prompts(8, seed=1, lengths=(NUM_FORCED, NUM_FORCED))
    ours = forced_logprobs(llm, prompts, continuations)
    theirs = hf_forced_logprobs(hf, prompts, continuations)
    same_top1 = ours.argmax(-1) == theirs.argmax(-1)
    top2 = theirs.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > TIE_MARGIN
    their_top = theirs.argmax(-1, keepdim=True)
    top_logprob_diff = (ours.gather(-1, their_top) - theirs.gather(-1, their_top)).abs().max().item()
    kl = F.kl_div(ours, theirs, log_target=True, reduction="none").sum(-1).mean().item()
    print(f"positions {same_top1.numel()}, top-1 agreement {same_top1.float().mean():.4f}; "
          f"decided positions {decided.float().mean():.2%}, their agreement {same_top1[decided].float().mean():.4f}; "
          f"max |dlogprob| of top-1 {top_logprob_diff:.4f}, mean KL {kl:.2e}")
    assert decided.float().mean() > 0.5
    assert same_top1[decided].float().mean() >= 0.99
    assert top_logprob_diff < 0.25
    assert kl < 1e-2


@pytest.mark.parametrize("num_seqs", [5, 70])
def test_cuda_graph_decode_matches_eager(llm, num_seqs):
    """Graph replay reads full-width block tables (the decode kernel may split the keys differently
    than eager does), so the two agree to rounding, not bit for bit. A batch of up to 64 rows has its
    graph compute the logits too; a larger one's logits run eagerly after its replay."""
    assert (num_seqs <= llm.model_runner.graphs.logits_rows) == (num_seqs == 5)
    prompts = random_prompts(num_seqs, seed=2)
    continuations = random_prompts(num_seqs, seed=3, lengths=(NUM_FORCED, NUM_FORCED))
    graphs = forced_logprobs(llm, prompts, continuations, use_graphs=True)
    eager = forced_logprobs(llm, prompts, continuations, use_graphs=False)
    top2 = eager.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > TIE_MARGIN
    eager_top = eager.argmax(-1, keepdim=True)
    top_logprob_diff = (graphs.gather(-1, eager_top) - eager.gather(-1, eager_top)).abs().max().item()
    kl = F.kl_div(graphs, eager, log_target=True, reduction="none").sum(-1).mean().item()
    print(f"graph vs eager: max |dlogprob| of top-1 {top_logprob_diff:.4f}, mean KL {kl:.2e}")
    assert torch.equal(graphs.argmax(-1)[decided], eager.argmax(-1)[decided])
    assert top_logprob_diff < 0.25    # the same bounds as against transformers
    assert kl < 1e-2


@torch.inference_mode()
@pytest.mark.parametrize("length", [7, 64, 300, 1024])
def test_cuda_graph_prefill_of_a_lone_prompt_matches_eager(llm, length):
    """A lone prompt's prefill replays the graph of the smallest bucket that holds it (padding rows store
    nothing and are attended by no query): its last-token logits are eager's to rounding."""
    runner, bm = llm.model_runner, llm.scheduler.block_manager
    seq = Sequence(random_prompts(1, seed=1000 + length, lengths=(length, length))[0], SamplingParams(),
                   llm.config.kvcache_block_size)
    bm.allocate(seq)
    seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens
    assert seq.num_cached_tokens == 0
    try:
        input_ids, positions = runner.prepare_prefill([seq])
        hidden = runner.graphs.prefill(input_ids, positions, num_seqs=1)
        assert hidden is not None and hidden.shape[0] == length
        graph = runner.model.compute_logits(hidden).float().log_softmax(-1)
        eager = runner.model.compute_logits(runner.model(input_ids, positions)).float().log_softmax(-1)
    finally:
        reset_context()
        bm.deallocate(seq)
    kl = F.kl_div(graph, eager, log_target=True, reduction="none").sum(-1).item()
    print(f"{length} tokens: graph vs eager KL {kl:.2e}")
    assert kl < 1e-3
    top2 = eager.topk(2, dim=-1).values[0]
    assert top2[0] - top2[1] < TIE_MARGIN or graph.argmax() == eager.argmax()


def test_greedy_continuations_agree_with_transformers(llm, hf):
    """Every token we pick greedily is transformers' argmax too, or within a near-tie of it."""
    prompts = random_prompts(6, seed=4)
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    ours = [o["token_ids"] for o in ours]
    theirs = hf_forced_logprobs(hf, prompts, [t + [0] * NUM_FORCED for t in ours])[:, :16]
    picked = theirs.gather(-1, torch.tensor(ours, device="cuda").unsqueeze(-1)).squeeze(-1)
    shortfall = (theirs.max(-1).values - picked).max().item()
    first_agree = [next((i for i, (a, b) in enumerate(zip(o, hf_greedy(hf, p, 16))) if a != b), 16)
                   for p, o in zip(prompts, ours)]
    print(f"largest shortfall from transformers' argmax {shortfall:.4f}; tokens identical to its own greedy "
          f"decoding before the first difference: {first_agree}")
    assert shortfall < TIE_MARGIN


def test_prompts_sharing_a_prefix_that_ends_inside_a_page_copy_it_and_decode_as_transformers(llm, hf):
    """A shared prefix (a system prompt) of 300 tokens in 256-token pages: past its full page, each prompt
    finds its next 44 tokens in the page the first prompt filled, gets a copy of it before its step and
    computes only its own tokens; every token it then picks greedily is transformers' argmax, or within a
    near-tie of it (a wrong copy would attend other keys)."""
    prefix = random_prompts(1, seed=20, lengths=(300, 300))[0]
    first = prefix + random_prompts(1, seed=21, lengths=(300, 300))[0]      # two full pages
    others = [prefix + p for p in random_prompts(4, seed=22, lengths=(5, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate([first], params, use_tqdm=False)
    before = llm.stats["num_prefix_cache_hit_tokens"]
    ours = [o["token_ids"] for o in llm.generate(others, params, use_tqdm=False)]
    shared = [next(i for i, (a, b) in enumerate(zip(o, first)) if a != b) for o in others]
    assert min(shared) >= 300 and llm.stats["num_prefix_cache_hit_tokens"] - before == sum(shared)
    theirs = hf_forced_logprobs(hf, others, [t + [0] * NUM_FORCED for t in ours])[:, :16]
    picked = theirs.gather(-1, torch.tensor(ours, device="cuda").unsqueeze(-1)).squeeze(-1)
    shortfall = (theirs.max(-1).values - picked).max().item()
    print(f"partial hits of {[s - 256 for s in shared]} tokens; largest shortfall from transformers' argmax "
          f"{shortfall:.4f}")
    assert shortfall < TIE_MARGIN

def test_rows_sharing_prefixes_read_them_once_and_agree_with_each_row_reading_its_own(llm, monkeypatch):
    """Forty prompts over four 700-token prefixes (two full pages each shares with nine others): decode steps
    group the rows by their shared pages (shared_prefixes.py), through the shared-prefix graphs and eagerly, and
    give the log-probs of every row reading all its own pages, to rounding (as graphs against eager)."""
    prefixes = random_prompts(4, seed=30, lengths=(700, 700))
    prompts = [prefixes[i % 4] + p for i, p in enumerate(random_prompts(40, seed=31, lengths=(1, 100)))]
    continuations = random_prompts(40, seed=32, lengths=(NUM_FORCED, NUM_FORCED))
    # the prefixes' pages cached, so that the prompts' allocations below hit them (the scheduler registers
    # a step's full pages; forced_logprobs allocates directly)
    llm.generate([prefix + [1] for prefix in prefixes], SamplingParams(max_tokens=1), use_tqdm=False)
    grouped = record_groupings(monkeypatch)
    assert any(bs >= 40 for bs in llm.model_runner.graphs.shared_sizes)
    through_graphs = forced_logprobs(llm, prompts, continuations, use_graphs=True)
    eager = forced_logprobs(llm, prompts, continuations, use_graphs=False)
    assert len(grouped) == 2 * NUM_FORCED and all(g is not None for g in grouped)
    assert all(sorted(set(g[0].tolist())) == [512] and len(g[1]) == 4 for g in grouped)
    monkeypatch.setattr(llm.model_runner, "share_prefixes", False)
    alone = forced_logprobs(llm, prompts, continuations, use_graphs=True)
    assert len(grouped) == 2 * NUM_FORCED
    for ours in (through_graphs, eager):
        agreement = compare(ours[:, 1:], alone[:, 1:])
        print(f"shared pages read once vs by each row: {agreement}")
        assert agreement["decided"] > 0.5 and agreement["agreement"] >= 0.99
        assert agreement["top_logprob_diff"] < 0.25 and agreement["kl"] < 1e-2


def test_sampling_many_sequences_through_graph_buckets(llm):
    prompts = random_prompts(300, seed=6, lengths=(5, 60))      # decode batches of many bucket sizes
    outputs = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o["token_ids"]) == 8 for o in outputs)
    assert llm.scheduler.block_manager.used_block_ids == set()


def test_every_sampling_option_runs_through_cuda_graphs_and_logprobs_match_transformers(llm, hf):
    """Qwen3's settings, log-probs, penalties, n, seeds, stop tokens and min_tokens in one batch of
    graph-replayed decode steps; the greedy request's log-probs against transformers' in bf16."""
    prompts = random_prompts(6, seed=7)
    qwen3 = dict(temperature=0.6, top_p=0.95, top_k=20)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5),
              SamplingParams(max_tokens=12, ignore_eos=True, seed=5, **qwen3),
              SamplingParams(max_tokens=12, ignore_eos=True, n=3, seed=6, logprobs=2, **qwen3),
              SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.2, presence_penalty=0.5,
                             frequency_penalty=0.3, min_p=0.05, temperature=0.8),
              SamplingParams(max_tokens=12, min_tokens=4, top_p=0.9, stop_token_ids=list(range(0, 151936, 2))),
              SamplingParams(max_tokens=12, ignore_eos=True, top_k=100)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o["outputs"] for o in outputs[1:3]] == [o["outputs"] for o in again[1:3]]   # seeded: repeatable
    assert len(outputs[2]["outputs"]) == 3 and len({tuple(c["token_ids"]) for c in outputs[2]["outputs"]}) == 3
    stopped = outputs[4]
    assert 5 <= len(stopped["token_ids"]) <= 12 and all(t % 2 for t in stopped["token_ids"][:4])
    if len(stopped["token_ids"]) < 12:
        assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stopped["token_ids"][-1]
    greedy = outputs[0]
    theirs = hf_forced_logprobs(hf, prompts[:1], [greedy["token_ids"] + [0] * NUM_FORCED])[0, :12]
    ours = torch.tensor([entry[t] for entry, t in zip(greedy["logprobs"], greedy["token_ids"])], device="cuda")
    picked = theirs.gather(-1, torch.tensor(greedy["token_ids"], device="cuda").unsqueeze(-1)).squeeze(-1)
    diff = (ours - picked).abs().max().item()
    alone = llm.generate([prompts[1]], params[1], use_tqdm=False)[0]["token_ids"]
    same = sum(a == b for a, b in zip(alone, outputs[1]["token_ids"]))
    print(f"greedy log-probs vs transformers: max |d| {diff:.4f}; seeded request alone vs in the batch: "
          f"{same}/12 tokens equal (bf16 logits of a row may differ with the batch)")
    assert diff < 0.25
    assert all(len(entry) in (5, 6) for entry in greedy["logprobs"])


def test_kv_cache_that_cannot_fit_is_a_clear_error(model_dir):
    with pytest.raises(ValueError, match="KV cache block"):
        LLM(str(model_dir), gpu_memory_utilization=0.01, enforce_eager=True)


def test_an_engine_started_after_another_exits_gets_the_memory_back(model_dir, llm):
    """exit() empties the allocator's cache: else the next engine's weights land in the freed KV segment,
    pin it, and the next KV cache finds the memory still 'used'."""
    sizes = []
    for _ in range(2):
        with LLM(str(model_dir), max_model_len=1024, gpu_memory_utilization=0.8, enforce_eager=True) as engine:
            sizes.append(engine.model_runner.num_kvcache_blocks)
    assert sizes[0] > 100 and sizes[1] >= 0.95 * sizes[0], sizes
