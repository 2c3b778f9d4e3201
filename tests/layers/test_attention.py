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


def _kernel_rope(head_dim: int):
    """A RotaryEmbedding that takes its GPU path, the Triton kernel, on any device (the interpreter on CPU)."""
    from nanovllm.kernels.rotary import rotate_qk
    from nanovllm.layers.rotary_kv_store import RotaryEmbedding

    class KernelRope(RotaryEmbedding):
        def forward(self, positions, query, key, q_norm=None, k_norm=None, **cache):
            norm = () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
            return rotate_qk(positions, query, key, self.cos_sin_cache, *norm, **cache)
    return KernelRope(head_dim, 256, 10000.0)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("rope", ["kernel", "layer"])
def test_rotating_and_storing_in_one_call_attends_and_caches_as_rotate_then_store(cache_dtype, rope):
    """A Qwen3-style layer (q/k norms), given rotary_emb, over a prefill of two prompts and then a decode
    step: with the triton ops the rotary call writes the cache (their store_kvcache is never called), and
    outputs and cache bytes are those of rotating, then storing (the ops told fused_rope_store=False).
    rope 'kernel': the Triton rotary kernel whatever the device; 'layer': RotaryEmbedding as it is (on a
    CPU it rotates and stores in torch)."""
    from types import SimpleNamespace

    import torch

    from nanovllm.layers.attention import Attention
    from nanovllm.layers.layernorm import RMSNorm
    from nanovllm.layers.rotary_kv_store import RotaryEmbedding
    from nanovllm.utils.context import reset_context, set_context

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    rotary_emb = (_kernel_rope(head_dim) if rope == "kernel" else RotaryEmbedding(head_dim, 256, 10000.0)).to(device)
    q_norm, k_norm = RMSNorm(head_dim), RMSNorm(head_dim)
    for norm in (q_norm, k_norm):
        norm.to(device).weight.data = (1 + 0.1 * torch.randn(head_dim, device=device)).bfloat16()
    i32 = dict(dtype=torch.int32, device=device)
    # prompts of 12 and 20 tokens in blocks [2] and [5, 0]; then one decode token each
    prefill = dict(is_prefill=True, cu_seqlens_q=torch.tensor([0, 12, 32], **i32),
                   cu_seqlens_k=torch.tensor([0, 12, 32], **i32), max_seqlen_q=20, max_seqlen_k=20,
                   slot_mapping=torch.tensor([2 * 16 + p for p in range(12)] + [5 * 16 + p for p in range(16)]
                                             + [p for p in range(4)], **i32))
    decode = dict(is_prefill=False, slot_mapping=torch.tensor([2 * 16 + 12, 0 * 16 + 4], **i32),
                  context_lens=torch.tensor([13, 21], **i32), block_tables=torch.tensor([[2, -1], [5, 0]], **i32))
    steps = [(prefill, torch.cat([torch.arange(12), torch.arange(20)]).to(device)),
             (decode, torch.tensor([12, 20], device=device))]
    inputs = [(3 * torch.randn(len(positions), (num_heads + 2 * num_kv_heads) * head_dim, device=device)).bfloat16()
              for _, positions in steps]

    def run(ops):
        layer = Attention(num_heads, head_dim, head_dim ** -0.5, num_kv_heads)
        layer.ops = ops
        layer.k_cache, layer.v_cache = (torch.zeros(6, block_size, num_kv_heads, head_dim, device=device,
                                                    dtype=getattr(torch, cache_dtype)) for _ in range(2))
        outputs = []
        for (context, positions), qkv in zip(steps, inputs):
            set_context(**context)
            q, k, v = qkv.clone().split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
            q, k, v = (x.view(len(positions), -1, head_dim) for x in (q, k, v))
            outputs.append(layer(q, k, v, positions, rotary_emb, q_norm, k_norm))
        return outputs, [c.view(torch.uint8) if c.element_size() == 1 else c for c in (layer.k_cache, layer.v_cache)]

    def must_not_be_called(*args):
        raise AssertionError("the rotary call stores: store_kvcache must not run")

    triton_ops = vars(attention_ops("triton"))
    assert triton_ops["fused_rope_store"] and not attention_ops("torch").fused_rope_store
    try:
        fused_outputs, fused_caches = run(SimpleNamespace(**{**triton_ops, "store_kvcache": must_not_be_called}))
        outputs, caches = run(SimpleNamespace(**{**triton_ops, "fused_rope_store": False}))
    finally:
        reset_context()
    assert all(torch.equal(a, b) for a, b in zip(fused_outputs, outputs))
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, caches))
    assert caches[0].any() and caches[1].any()
