import json
import shutil

import pytest
import torch

from nanovllm.config import Config


def test_resolves_cpu_defaults(tiny_model):
    config = Config(str(tiny_model))
    assert config.device == ("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cpu":
        assert config.dtype == torch.float32 and config.attention_backend == "torch"
    assert config.max_model_len == 2048            # clamped to max_position_embeddings
    assert config.hf_config.num_hidden_layers == 2
    assert config.eos_token_ids == {config.hf_config.eos_token_id}


def test_kv_cache_dtype_auto_is_the_model_dtype_and_fp8_is_e4m3(tiny_model):
    assert Config(str(tiny_model)).kv_cache_dtype == Config(str(tiny_model)).dtype
    assert Config(str(tiny_model), dtype="bfloat16").kv_cache_dtype == torch.bfloat16
    assert Config(str(tiny_model), kv_cache_dtype="fp8").kv_cache_dtype == torch.float8_e4m3fn


def test_explicit_dtype_and_block_count(tiny_model):
    config = Config(str(tiny_model), dtype="bfloat16", num_kvcache_blocks=7, kvcache_block_size=16)
    assert config.dtype == torch.bfloat16 and config.num_kvcache_blocks == 7


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size"),
    (dict(tensor_parallel_size=9), ValueError, "tensor_parallel_size"),
    (dict(tensor_parallel_size=3), ValueError, "does not divide"),
    (dict(tensor_parallel_size="2"), TypeError, "tensor_parallel_size"),
    (dict(max_model_len=0), ValueError, "max_model_len"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(max_num_batched_tokens=-5), ValueError, "max_num_batched_tokens"),
    (dict(gpu_memory_utilization=0.0), ValueError, "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
    (dict(num_kvcache_blocks=0), ValueError, "num_kvcache_blocks"),
    (dict(num_kvcache_blocks=-2), ValueError, "num_kvcache_blocks"),
    (dict(kvcache_block_size=24), ValueError, "power of two"),
    (dict(kvcache_block_size=8), ValueError, "power of two"),
    (dict(device="tpu"), ValueError, "device"),
    (dict(dtype="float64"), ValueError, "dtype"),
    (dict(attention_backend="xformers"), ValueError, "attention_backend"),
    (dict(kv_cache_dtype="fp8_e5m2"), ValueError, "kv_cache_dtype"),
    (dict(kv_cache_dtype=torch.float16), ValueError, "kv_cache_dtype"),
    (dict(kv_cache_dtype="fp8", attention_backend="flash_attn"), ValueError, "cannot read an fp8 KV cache"),
    (dict(enforce_eager="yes"), TypeError, "enforce_eager"),
    (dict(enable_prefix_caching=None), TypeError, "enable_prefix_caching"),
])
def test_rejects_bad_settings_by_name(tiny_model, kwargs, error, words):
    with pytest.raises(error, match=words):
        Config(str(tiny_model), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only errors")
def test_gpu_only_settings_are_refused_on_cpu(tiny_model):
    with pytest.raises(ValueError, match="CUDA"):
        Config(str(tiny_model), device="cuda")
    with pytest.raises(ValueError, match="flash_attn"):
        Config(str(tiny_model), attention_backend="flash_attn")


def test_missing_or_incomplete_model_directories(tiny_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Config(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        Config(str(tmp_path))
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(tiny_model / "config.json", partial / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        Config(str(partial))
    with pytest.raises(TypeError, match="model"):
        Config(42)


def test_unsupported_architecture_lists_the_supported_ones(tiny_model, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Qwen3ForCausalLM"):
        Config(str(other))


def test_sliding_window_models_are_refused_up_front(tiny_model, tmp_path):
    other = tmp_path / "sliding"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding-window"):
        Config(str(other))
