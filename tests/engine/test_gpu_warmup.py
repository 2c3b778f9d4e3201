"""Start-up compiles every kernel variant a request can reach: after LLM(...) returns, requests with any
sampling setting (structured outputs too), batch size, prompt length, prefix-cache hits, n and an fp8 cache compile nothing more
with Triton (issue 23: the first request with top_p/top_k waited ~2 s for two sampling kernels)."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from benchmarks.random_checkpoint import QWEN3_0_6B
from compilations import assert_none_compiled, recorded_compilations
from teacher_forcing import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SETTINGS = [dict(temperature=0.0), dict(temperature=0.6), dict(temperature=0.6, top_p=0.95, top_k=20),
            dict(temperature=0.7, min_p=0.05), dict(temperature=0.6, logprobs=5), dict(temperature=0.0, logprobs=0),
            dict(temperature=0.6, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
            dict(temperature=0.6, repetition_penalty=1.2, logprobs=3), dict(temperature=0.6, seed=7),
            dict(temperature=0.8, n=3, top_k=50), dict(temperature=0.6, min_tokens=4),
            dict(temperature=0.6, stop=["a"], top_p=0.9, logprobs=2),
            dict(temperature=0.0, logit_bias={5: 2.0, 9: -1.0}),
            dict(temperature=0.7, top_k=20, allowed_token_ids=list(range(50, 300)), logit_bias={60: 1.5}, logprobs=3)]
# structured outputs (xgrammar, a test extra): the token-mask kernel, alone and beside penalties and log-probs
STRUCTURED = [dict(temperature=0.6, structured_outputs={"regex": "[a-z ]{1,40}"}),
              dict(temperature=0.0, logprobs=2, repetition_penalty=1.1, n=2,
                   structured_outputs={"choice": ["alpha beta gamma delta", "x"]})]


@pytest.mark.parametrize("kv_cache_dtype,block_size", [("auto", 256), ("fp8", 256), ("auto", 16)])
def test_no_request_compiles_a_kernel_after_start_up(make_checkpoint, kv_cache_dtype, block_size):
    """16-token pages: block tables of every width up to ~95 (a multiple of 16 is a variant Triton would
    specialize)."""
    model_dir = make_checkpoint(dtype=torch.bfloat16, device="cuda", **QWEN3_0_6B)
    with LLM(str(model_dir), max_model_len=2048, gpu_memory_utilization=0.5, kv_cache_dtype=kv_cache_dtype,
             kvcache_block_size=block_size) as llm:
        with recorded_compilations() as compiled:
            generate_in_every_batch(llm, SETTINGS)
    assert_none_compiled(compiled)


def test_no_structured_request_compiles_a_kernel_after_start_up(make_checkpoint):
    """Constrained requests (sampled once their token masks are known) at the default cache: the mask kernel
    is one variant whatever the cache's dtype or page size."""
    pytest.importorskip("xgrammar")
    model_dir = make_checkpoint(dtype=torch.bfloat16, device="cuda", **QWEN3_0_6B)
    with LLM(str(model_dir), max_model_len=2048, gpu_memory_utilization=0.5) as llm:
        with recorded_compilations() as compiled:
            generate_in_every_batch(llm, STRUCTURED)
    assert_none_compiled(compiled)


def generate_in_every_batch(llm: LLM, settings: list[dict]) -> None:
    """Each setting over a lone prompt, small and large batches (up to 1,500 tokens), and small and large ones
    over a cached 1,100-token prefix, whose pages decode reads once for them (shared_prefixes.py)."""
    prompts = random_prompts(40, seed=11, lengths=(1, 1500))
    prefix = random_prompts(1, seed=13, lengths=(1100, 1100))[0]
    shared = [prefix + p for p in random_prompts(40, seed=12, lengths=(1, 50))]
    llm.generate(shared[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    for i, options in enumerate(settings):
        for batch in (prompts[i:i + 1], prompts[:3], prompts[:40], shared[:3], shared):
            llm.generate(batch, SamplingParams(max_tokens=8, ignore_eos=True, **options), use_tqdm=False)
    assert llm.stats["num_prefix_cache_hit_tokens"] > 0     # the paged prefill path ran too


def test_speculative_verification_replays_decode_graphs_and_compiles_nothing_after_start_up(make_checkpoint):
    """A verification step (a sequence's last token and its drafts, one decode row each) replays the decode
    graph of its rows' bucket, and its sampler with many rows a sequence was compiled at start-up. The
    proposer is made to draft every step (a random model rarely repeats what n-gram lookup would find)."""
    model_dir = make_checkpoint(dtype=torch.bfloat16, device="cuda", **QWEN3_0_6B)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    prompts = random_prompts(40, seed=12, lengths=(1, 1500))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(model_dir), max_model_len=2048, gpu_memory_utilization=0.5, speculative_config=spec) as llm:
        proposer = llm.spec_decode.proposer
        proposer.propose = lambda seqs, room: [[seq.last_token] * max(0, min(3, r)) for seq, r in zip(seqs, room)]
        proposer.may_propose = lambda seqs: True      # so the step in flight is always collected for drafts
        graphs, replayed = llm.model_runner.graphs, []
        decode = graphs.decode

        def recorded_decode(input_ids, positions):
            replay = decode(input_ids, positions)
            replayed.append((len(input_ids), replay is not None))
            return replay
        graphs.decode = recorded_decode
        with recorded_compilations() as compiled:
            outputs = speculate_in_every_mode(llm, prompts, greedy)
    assert max(rows for rows, _ in replayed) > 40           # verification steps went through graphs.decode
    assert all(in_graph for _, in_graph in replayed)        # and none ran eagerly (40 x 4 rows fit a graph)
    assert_none_compiled(compiled)
    assert_greedy_up_to_near_ties(model_dir, prompts, outputs, greedy)


def speculate_in_every_mode(llm: LLM, prompts: list, greedy: SamplingParams) -> list[list[int]]:
    """Greedy, then sampled with top-p and log-probs, then seeded n = 2, each at 1, 3 and 40 sequences; drafts
    were proposed. Returns the greedy token ids."""
    outputs = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    for options in (dict(temperature=0.8, top_p=0.9, logprobs=2), dict(temperature=0.6, seed=3, n=2)):
        for batch in (prompts[:1], prompts[:3], prompts[:40]):
            llm.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True, **options), use_tqdm=False)
    assert llm.stats["spec_decode_draft_tokens"] > 0
    return outputs


def assert_greedy_up_to_near_ties(model_dir, prompts, outputs, greedy):
    """Speculative greedy tokens are plain decoding's up to bf16 rounding: the verification computes a
    sequence's rows in a larger batch than plain decoding (other GEMM and attention tilings), and a random
    model's top two logits are often within their difference (on the H100 about half of these 12-token
    completions part somewhere, on ties as close as 0.03 between the top logits). So where a completion first
    departs from plain decoding's, a fresh prefill of the same tokens before must rank the speculative token
    within a near tie (0.25) of its best."""
    with LLM(str(model_dir), max_model_len=2048, gpu_memory_utilization=0.3) as llm:
        expected = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        parted = [(p, o, e) for p, o, e in zip(prompts, outputs, expected) if o != e]
        assert len(parted) < len(prompts) * 3 // 4
        for prompt, output, plain in parted:
            at = next(i for i, (a, b) in enumerate(zip(output, plain)) if a != b)
            assert at > 0           # the first token comes from the prefill, the same pass either way
            step = llm.generate([prompt + output[:at]], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5),
                                use_tqdm=False)[0]
            ranked = step["logprobs"][0]        # a third path (a fresh prefill) as the judge of the tie
            assert output[at] in ranked and max(ranked.values()) - ranked[output[at]] < 0.25, (at, ranked)


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_a_drafter_compiles_nothing_after_start_up_and_keeps_the_greedy_tokens(make_checkpoint, tmp_path, method):
    """A draft model (two layers of the target's shape) or an EAGLE-3 head (random, with a draft vocabulary
    of its own) drafts every step: its passes, its LM head, its draws and the verification's general rule are
    compiled at start-up; greedy tokens are plain decoding's up to near ties (assert_greedy_up_to_near_ties)."""
    from benchmarks.random_checkpoint import write_random_eagle3_head
    model_dir = make_checkpoint(dtype=torch.bfloat16, device="cuda", **QWEN3_0_6B)
    if method == "draft_model":
        draft = make_checkpoint(dtype=torch.bfloat16, device="cuda", **{**QWEN3_0_6B, "num_hidden_layers": 2})
    else:
        draft = write_random_eagle3_head(tmp_path / "head", model_dir, draft_vocab_size=32000, dtype=torch.bfloat16)
    spec = {"method": method, "model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    prompts = random_prompts(40, seed=13, lengths=(1, 1500))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(model_dir), max_model_len=2048, gpu_memory_utilization=0.5, speculative_config=spec) as llm:
        replayed = []       # a draft model's passes replay its own decode graphs (an EAGLE-3 head's run eagerly)
        draft_graphs = getattr(llm.model_runner.draft, "graphs", None)
        if draft_graphs is not None:
            decode = draft_graphs.decode

            def recorded_decode(*args):
                replay = decode(*args)
                replayed.append(replay is not None)
                return replay
            draft_graphs.decode = recorded_decode
        with recorded_compilations() as compiled:
            outputs = speculate_in_every_mode(llm, prompts, greedy)
        assert (method == "draft_model") == (sum(replayed) > 0)
    assert_none_compiled(compiled)
    assert_greedy_up_to_near_ties(model_dir, prompts, outputs, greedy)
