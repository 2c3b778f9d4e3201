"""An fp8 KV cache on the GPU, against the bf16 cache of the same engine settings: teacher-forced
next-token distributions on the Qwen3-0.6B shape (head_dim 128) and a Llama shape with head_dim 64,
through the Triton kernels and CUDA graphs, and after prefix-cache hits. Run with -s for the figures
docs/benchmarks.md records."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence
from benchmarks.random_checkpoint import QWEN3_0_6B
from teacher_forcing import forced_logprobs, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LLAMA_1B = dict(architecture="LlamaForCausalLM", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True)
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "llama-1b-head64": LLAMA_1B}
# the goal is a mean KL <= 1e-2; the Llama shape measured 1.19e-2 on an H100 (docs/benchmarks.md):
# its bound guards against getting worse, it does not claim the goal
MAX_MEAN_KL = {"qwen3-0.6b": 1e-2, "llama-1b-head64": 1.5e-2}


def compare(fp8, bf16, margin=0.5):
    """Mean KL(bf16 || fp8); top-1 agreement where bf16's top-1 leads by > margin nats; the largest
    log-prob (under bf16) that fp8's top-1 gives up against bf16's."""
    kl = F.kl_div(fp8, bf16, log_target=True, reduction="none").sum(-1).mean().item()
    top2 = bf16.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > margin
    same = (fp8.argmax(-1) == bf16.argmax(-1))[decided].float().mean().item()
    shortfall = (bf16.max(-1).values - bf16.gather(-1, fp8.argmax(-1, keepdim=True)).squeeze(-1)).max().item()
    return kl, same, decided.float().mean().item(), shortfall


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_cache_tracks_the_bf16_cache(make_checkpoint, shape):
    model_dir = make_checkpoint(dtype=torch.bfloat16, device="cuda", **SHAPES[shape])
    prompts = random_prompts(8, seed=0, lengths=(100, 900))
    continuations = random_prompts(8, seed=1, lengths=(48, 48))
    logprobs, blocks = {}, {}
    for kv_cache_dtype in ("auto", "fp8"):
        with LLM(str(model_dir), max_model_len=1024, gpu_memory_utilization=0.5, kv_cache_dtype=kv_cache_dtype) as llm:
            blocks[kv_cache_dtype] = llm.model_runner.num_kvcache_blocks
            logprobs[kv_cache_dtype] = forced_logprobs(llm, prompts, continuations)     # CUDA graphs
            if kv_cache_dtype == "fp8":    # again, each prompt's full blocks now from the prefix cache
                llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)    # registers them
                probe = Sequence(max(prompts, key=len), SamplingParams(), llm.config.kvcache_block_size)
                llm.scheduler.block_manager.allocate(probe)
                assert probe.num_cached_tokens >= llm.config.kvcache_block_size
                llm.scheduler.block_manager.deallocate(probe)
                cached = forced_logprobs(llm, prompts, continuations)
    kl, same, decided, shortfall = compare(logprobs["fp8"], logprobs["auto"])
    again = F.kl_div(cached, logprobs["fp8"], log_target=True, reduction="none").sum(-1).mean().item()
    print(f"{shape}: fp8 vs bf16 cache over {logprobs['fp8'].shape[:2].numel()} positions: mean KL {kl:.2e}, "
          f"top-1 agreement {same:.4f} on the {decided:.0%} with a gap > 0.5 nats, max log-prob shortfall "
          f"{shortfall:.3f}; blocks {blocks['auto']} -> {blocks['fp8']}; prefix-cached rerun vs first KL {again:.1e}")
    assert kl <= MAX_MEAN_KL[shape] and same >= 0.99 and decided > 0.05    # random weights: flat distributions
    assert blocks["fp8"] >= 1.9 * blocks["auto"]
    assert again < 1e-3           # the cached prefix reads the very values the fresh prefill attended


def test_fp8_outputs_do_not_depend_on_prefix_cache_hits(make_checkpoint):
    """The issue's case: a random Llama (GQA 4, head_dim 64, 12 layers, bf16), 48 prompts of 10-700
    tokens, 64 greedy tokens, generated twice in one fp8 engine: the second run hits the prefix cache and
    must pick the very same tokens (random weights are chaotic: any arithmetic difference shows)."""
    shape = dict(LLAMA_1B, num_hidden_layers=12, hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000)
    model_dir = make_checkpoint(dtype=torch.bfloat16, device="cuda", **shape)
    prompts = [[t % 32000 for t in p] for p in random_prompts(48, seed=5, lengths=(10, 700))]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    with LLM(str(model_dir), max_model_len=1024, gpu_memory_utilization=0.5, kv_cache_dtype="fp8") as llm:
        first = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        second = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        hits = llm.stats["num_prefix_cache_hit_tokens"]
    same = sum(a == b for a, b in zip(first, second))
    print(f"fp8 cache, the same 48 prompts twice: {same}/48 identical, {hits} prompt tokens from the prefix cache")
    assert hits > 0 and same == len(prompts)
