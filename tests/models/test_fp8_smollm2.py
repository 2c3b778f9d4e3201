"""SmolLM2-135M-Instruct (real weights) with quantization="fp8" on CPU: online per-channel e4m3 weights and
per-token e4m3 activations against the same engine unquantized (float32), every position of a few
paragraphs of English teacher-forced. Run with -s for the figures (README).

The issue's goal (mean KL <= 5e-3, top-1 agreement >= 99% where the unquantized top-1 leads by > 0.5 nats) is
not met on this 135M model, and cannot be by the scheme's arithmetic: rounding the weights alone to e4m3 (3
mantissa bits, per-channel scales; activations left exact) already gives a mean KL of 2.0e-2 over these 449
positions (top-1 agreement 0.991), spread over every layer and projection (one kind at a time: qkv 5.2e-3,
o 1.3e-3, gate/up 6.5e-3, down 5.8e-3); per-token activations add the rest (3.4e-2 in all; per 1x32 groups
would give 2.9e-2). (The weights are themselves dequantized from the GGUF's Q4_1.) The bounds below guard the
measured figures against getting worse; they do not claim the goal."""
import pytest
import torch
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence
from nanovllm.utils.context import reset_context
from teacher_forcing import compare

pytestmark = pytest.mark.cpu_only     # every engine is device="cpu"

TEXTS = [
    "The water cycle describes how water moves between the oceans, the air and the land. Heat from the sun "
    "evaporates water from the sea; the vapour rises, cools and condenses into clouds, and the clouds return "
    "it to the ground as rain or snow. Rivers then carry much of it back to the sea, and the cycle begins again.",
    "To make a cup of tea, boil fresh water and pour it over the leaves or a tea bag. Let it steep for three to "
    "five minutes, depending on how strong you like it, then remove the leaves. Some people add milk, sugar or "
    "a slice of lemon; others prefer it plain.",
    "Paris is the capital and largest city of France. It is known for the Eiffel Tower, the Louvre museum and "
    "its cafes along the river Seine. Millions of tourists visit the city every year to see its art, "
    "architecture and food.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n\n\nprint([fibonacci(i) for i in range(10)])\n",
    "A healthy breakfast gives you energy for the morning. Good choices include oatmeal with fruit, eggs and "
    "whole grain toast, or yogurt with nuts and honey. Drinking a glass of water when you wake up also helps.",
    "The first rule of writing clearly is to know what you want to say before you start. Use short sentences, "
    "prefer concrete words to abstract ones, and cut every word that does not add meaning. Then read your text "
    "aloud: if you stumble, your reader will too.",
    "Photosynthesis is the process by which green plants turn light into chemical energy. In the leaves, "
    "chlorophyll absorbs sunlight, which drives the conversion of carbon dioxide and water into glucose and "
    "oxygen. The plant uses the glucose to grow, and releases the oxygen into the air we breathe.",
    "Dear Sarah,\n\nThank you for inviting me to your birthday party last weekend. I had a wonderful time, and "
    "the cake was delicious. I hope you like the book I gave you. Let's meet for coffee next week!\n\nBest "
    "wishes,\nTom",
]


@torch.inference_mode()
def every_position_logprobs(llm: LLM, sequences: list[list[int]]) -> torch.Tensor:
    """Log-probs of the next token at every position of every sequence: one prefill, all rows' logits."""
    runner, block_manager = llm.model_runner, llm.scheduler.block_manager
    seqs = [Sequence(ids, SamplingParams(), llm.config.kvcache_block_size) for ids in sequences]
    for seq in seqs:
        block_manager.allocate(seq)
        seq.num_scheduled_tokens = len(seq)
    try:
        hidden = runner.model(*runner.prepare_prefill(seqs))
        return runner.model.lm_head.logits_of(hidden).float().log_softmax(-1)
    finally:
        reset_context()
        for seq in seqs:
            block_manager.deallocate(seq)


def test_online_fp8_smollm2_tracks_the_unquantized_model(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    sequences = [tokenizer.encode(text) for text in TEXTS]
    logprobs = {}
    for quantization in (None, "fp8"):
        with LLM(smollm2_dir, device="cpu", quantization=quantization, enable_prefix_caching=False,
                 kvcache_block_size=16, max_model_len=512) as llm:
            logprobs[quantization] = every_position_logprobs(llm, sequences)
            if quantization:
                assert llm.model_runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    stats = compare(logprobs["fp8"], logprobs[None], margin=0.5)
    print(f"SmolLM2-135M, quantization='fp8' vs unquantized (float32, CPU) over {logprobs[None].shape[0]} positions: "
          f"mean KL {stats['kl']:.2e}, top-1 agreement {stats['agreement']:.4f} on the {stats['decided']:.0%} "
          f"with a gap > 0.5 nats")
    assert stats["decided"] > 0.5
    assert stats["kl"] <= 5e-2 and stats["agreement"] >= 0.96
