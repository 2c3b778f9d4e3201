"""Both attention backends that run without flash-attn, inside the whole engine, give transformers'
greedy tokens in float32 on CPU: the PyTorch reference and our Triton kernels (through Triton's
interpreter), with chunked prefill and prefix-cache hits exercising the paged paths."""
import os
import random

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.layers.attention import attention_ops
from oracle import hf_greedy, load_hf_model

SHAPE = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=64)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backend_matches_transformers_end_to_end(make_checkpoint, backend):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("on a GPU box the Triton backend is covered by the GPU tests")
    model_dir = make_checkpoint(**SHAPE)
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 40))] for _ in range(3)]
    hf = load_hf_model(model_dir)
    expected = [hf_greedy(hf, p, 6) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(model_dir), device="cpu", attention_backend=backend, kvcache_block_size=16, max_model_len=128,
             max_num_batched_tokens=32) as llm:                  # 32-token budget: prompts go in chunks
        first = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        second = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats["num_prefix_cache_hit_tokens"] > 0
    assert first == second == expected


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="xformers"):
        attention_ops("xformers")
