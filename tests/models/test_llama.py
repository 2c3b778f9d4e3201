"""Llama and Qwen2 (and Qwen3's bias option) with random weights: nanovllm's greedy decoding in float32
on CPU is token-identical to transformers' on the same checkpoint."""
import json

import pytest

from nanovllm import LLM, SamplingParams
from oracle import hf_greedy, load_hf_model, random_prompts

pytestmark = pytest.mark.cpu_only     # every engine is device="cpu"

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)
CHECKPOINTS = {
    "llama-gqa-untied": dict(architecture="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2),
    "llama-mqa-tied-llama3rope": dict(architecture="LlamaForCausalLM", num_attention_heads=4,
                                      num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                                      rope_scaling=LLAMA3_ROPE),
    "llama-gqa-untied-llama3rope-bias": dict(architecture="LlamaForCausalLM", hidden_size=96,
                                             num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                             rope_scaling=LLAMA3_ROPE, attention_bias=True, mlp_bias=True),
    "qwen2-gqa-tied": dict(architecture="Qwen2ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen2-gqa-untied": dict(architecture="Qwen2ForCausalLM", num_attention_heads=8, num_key_value_heads=2,
                             hidden_size=128),
    "qwen3-attention-bias": dict(architecture="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=32, attention_bias=True),
}
MAX_TOKENS = 16


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_greedy_matches_transformers(make_checkpoint, name):
    model_dir = make_checkpoint(**CHECKPOINTS[name])
    prompts = random_prompts(5, 512, (1, 70), seed=len(name))     # mixed lengths, crossing 16-token blocks
    hf = load_hf_model(model_dir)
    expected = [hf_greedy(hf, prompt, MAX_TOKENS) for prompt in prompts]
    with LLM(model_dir, device="cpu", kvcache_block_size=16, max_model_len=256) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected


def test_the_checkpoints_exercise_what_they_claim(make_checkpoint):
    """Biases are random (not zero) and the llama3 rope scaling reaches the config transformers reads."""
    from safetensors import safe_open
    from transformers import AutoConfig
    model_dir = make_checkpoint(**CHECKPOINTS["llama-gqa-untied-llama3rope-bias"])
    config = AutoConfig.from_pretrained(model_dir)
    assert (config.rope_parameters or config.rope_scaling)["rope_type"] == "llama3"
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        biases = [name for name in f.keys() if name.endswith(".bias")]
        assert any("o_proj" in n for n in biases) and any("down_proj" in n for n in biases)
        assert all(f.get_tensor(name).abs().sum() > 0 for name in biases)


def test_an_unsupported_architecture_is_refused_by_name(make_checkpoint, tmp_path):
    model_dir = make_checkpoint(**CHECKPOINTS["llama-gqa-untied"])
    for file in model_dir.iterdir():
        (tmp_path / file.name).symlink_to(file)
    config = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(dict(config, architectures=["MistralForCausalLM"])))
    with pytest.raises(ValueError, match="MistralForCausalLM.*LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(tmp_path), device="cpu")
