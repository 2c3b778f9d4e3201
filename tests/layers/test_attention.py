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


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU test covers it at full size")
def test_an_fp8_prompt_attends_as_a_later_read_of_its_cached_blocks_does():
    """bf16 queries over an fp8 cache: a prompt's own prefill (fresh K/V) and a later prefill that
    reads the same keys through the block table (a prefix-cache hit) give bitwise the same output, so
    outputs do not depend on cache hits (issue 23: they ran bf16 dots one way, float16 the other)."""
    import torch

    from nanovllm.layers.attention import Attention
    from nanovllm.utils.context import reset_context, set_context

    torch.manual_seed(0)
    length, tail, num_heads, num_kv_heads, head_dim, block_size = 40, 8, 4, 2, 64, 16
    layer = Attention(num_heads, head_dim, head_dim ** -0.5, num_kv_heads)
    layer.ops = attention_ops("triton")
    layer.k_cache, layer.v_cache = (torch.zeros(6, block_size, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn)
                                    for _ in range(2))
    q = torch.randn(length, num_heads, head_dim).bfloat16()
    k, v = (3 * torch.randn(length, num_kv_heads, head_dim).bfloat16() for _ in range(2))
    block_table = torch.tensor([[4, 1, 3]], dtype=torch.int32)
    slots = torch.tensor([int(block_table[0, p // block_size]) * block_size + p % block_size for p in range(length)],
                         dtype=torch.int32)
    try:
        set_context(True, torch.tensor([0, length], dtype=torch.int32), torch.tensor([0, length], dtype=torch.int32),
                    length, length, slots)
        fresh = layer(q, k.clone(), v.clone())
        set_context(True, torch.tensor([0, tail], dtype=torch.int32), torch.tensor([0, length], dtype=torch.int32),
                    tail, length, slots[-tail:], None, block_table)
        cached = layer(q[-tail:], k[-tail:].clone(), v[-tail:].clone())
    finally:
        reset_context()
    assert torch.equal(fresh[-tail:], cached)
