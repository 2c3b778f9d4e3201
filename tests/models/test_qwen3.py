"""Greedy decoding in nanovllm (float32, CPU) is token-identical to transformers' on the same checkpoint."""

import pytest

from nanovllm import LLM, SamplingParams
from oracle import hf_greedy, load_hf_model, random_prompts

pytestmark = pytest.mark.cpu_only     # every engine is device="cpu"

SHAPES = {
    "mha-d64": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=64, hidden_size=64),
    "gqa2-d64": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=64, hidden_size=96),
    "gqa4-d128": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128, hidden_size=64),
    "mqa-d128-tied": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=128, hidden_size=64,
                          tie_word_embeddings=True),
}
MAX_TOKENS = 12


def expected(model_dir, prompts, max_tokens=MAX_TOKENS):
    hf = load_hf_model(model_dir)
    return [hf_greedy(hf, p, max_tokens) for p in prompts]


def generate(llm, prompts, max_tokens=MAX_TOKENS):
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
    return [o["token_ids"] for o in outputs]


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("block_size", [16, 32])
def test_greedy_matches_transformers(make_checkpoint, shape, block_size):
    model_dir = make_checkpoint(**SHAPES[shape])
    prompts = random_prompts(5, 512, (1, 70), seed=block_size)        # mixed lengths crossing blocks
    with LLM(model_dir, device="cpu", kvcache_block_size=block_size, max_model_len=256) as llm:
        assert generate(llm, prompts) == expected(model_dir, prompts)


def test_prefix_cache_hits_give_the_same_tokens(make_checkpoint):
    model_dir = make_checkpoint(**SHAPES["gqa2-d64"])
    prefix = random_prompts(1, 512, (40, 40), seed=7)[0]
    prompts = random_prompts(6, 512, (1, 20), seed=8, shared_prefix=prefix)
    with LLM(model_dir, device="cpu", kvcache_block_size=16, max_model_len=256) as llm:
        first = generate(llm, prompts[:2])
        second = generate(llm, prompts)                 # most prompts now start with cached blocks
        assert llm.stats["num_prefix_cache_hit_tokens"] >= 5 * 32
    ref = expected(model_dir, prompts)
    assert first == ref[:2] and second == ref


def test_preemption_under_a_tiny_kv_cache_gives_the_same_tokens(make_checkpoint):
    model_dir = make_checkpoint(**SHAPES["gqa4-d128"])
    prompts = random_prompts(6, 512, (10, 40), seed=3)
    with LLM(model_dir, device="cpu", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=6) as llm:
        out = generate(llm, prompts, max_tokens=20)
        assert llm.stats["num_preemptions"] > 0
    assert out == expected(model_dir, prompts, max_tokens=20)


def test_chunked_prefill_gives_the_same_tokens(make_checkpoint):
    model_dir = make_checkpoint(**SHAPES["mha-d64"])
    prompts = random_prompts(4, 512, (30, 90), seed=5)
    with LLM(model_dir, device="cpu", kvcache_block_size=16, max_model_len=256, max_num_batched_tokens=24) as llm:
        assert generate(llm, prompts) == expected(model_dir, prompts)


def test_teacher_forced_logprobs_match_transformers(make_checkpoint):
    """The step-level path the GPU tests use (prefill, then decode steps fed given tokens) gives
    transformers' log-probs at every position, in float32 on CPU."""
    import torch

    from teacher_forcing import forced_logprobs

    model_dir = make_checkpoint(**SHAPES["gqa2-d64"])
    prompts = random_prompts(3, 512, (5, 40), seed=11)
    continuations = random_prompts(3, 512, (8, 8), seed=12)
    with LLM(model_dir, device="cpu", kvcache_block_size=16, max_model_len=128) as llm:
        ours = forced_logprobs(llm, prompts, continuations, use_graphs=False, num_forced=8)
    hf = load_hf_model(model_dir)
    with torch.inference_mode():
        theirs = torch.stack([hf(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:].log_softmax(-1)
                              for p, c in zip(prompts, continuations)])
    assert ours.shape == theirs.shape == (3, 9, 512)
    assert torch.allclose(ours, theirs, atol=1e-4)
