"""kv_cache_dtype="fp8": K and V stored as float8_e4m3fn (scale 1.0, saturated), twice the tokens of a
bf16 cache in the same memory, next-token distributions close to those of a full-precision cache. On
CPU with both attention backends (Triton through its interpreter); the GPU figures are in
tests/engine/test_gpu_fp8_kv_cache.py."""
import os

import pytest
import torch
import torch.nn.functional as F

from nanovllm import LLM
from teacher_forcing import forced_logprobs, random_prompts

SHAPE = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=64)


@pytest.mark.parametrize("dtype, ratio", [("float32", 4), ("bfloat16", 2)])
def test_the_same_memory_holds_more_blocks_in_fp8(tiny_model, dtype, ratio):
    blocks = {}
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(str(tiny_model), device="cpu", dtype=dtype, kv_cache_dtype=kv_cache_dtype) as llm:
            assert llm.model_runner.kv_cache.dtype == llm.config.kv_cache_dtype
            blocks[kv_cache_dtype] = llm.model_runner.num_kvcache_blocks
    assert blocks["fp8"] == ratio * blocks["auto"]


def agreement(ours, theirs, margin=0.5):
    """Mean KL(theirs || ours), and top-1 agreement where theirs leads its runner-up by > margin nats."""
    kl = F.kl_div(ours, theirs, log_target=True, reduction="none").sum(-1).mean().item()
    top2 = theirs.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > margin
    same = (ours.argmax(-1) == theirs.argmax(-1))[decided].float().mean().item()
    return kl, same, decided.float().mean().item()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_teacher_forced_distributions_stay_close_to_a_float32_cache(make_checkpoint, backend):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("on a GPU box the Triton backend is covered by the GPU tests")
    model_dir = make_checkpoint(**SHAPE)
    prompts = random_prompts(6, seed=0, lengths=(20, 90))
    prompts = [[t % 512 for t in p] for p in prompts]
    continuations = [[t % 512 for t in c] for c in random_prompts(6, seed=1, lengths=(24, 24))]
    logprobs = {}
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(str(model_dir), device="cpu", attention_backend=backend, kv_cache_dtype=kv_cache_dtype,
                 kvcache_block_size=16, max_model_len=128) as llm:
            logprobs[kv_cache_dtype] = forced_logprobs(llm, prompts, continuations, num_forced=24)
    kl, same, decided = agreement(logprobs["fp8"], logprobs["auto"])
    print(f"{backend}: mean KL {kl:.2e}, top-1 agreement {same:.4f} on {decided:.0%} of positions")
    assert 0 < kl < 1e-2 and same >= 0.99 and decided > 0.15    # random weights: flat distributions
