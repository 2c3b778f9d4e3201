import json
import logging
import shutil

import pytest
import torch

from nanovllm.config import Config
from benchmarks.random_checkpoint import write_random_checkpoint


def test_resolves_cpu_defaults(tiny_model):
    config = Config(str(tiny_model))
    assert config.device == ("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cpu":
        assert config.dtype == torch.float32 and config.attention_backend == "torch"
    assert config.max_model_len == 2048            # clamped to max_position_embeddings
    assert config.hf_config.num_hidden_layers == 2
    assert config.eos_token_ids == {config.hf_config.eos_token_id}


def test_a_max_model_len_past_the_model_is_cut_to_it_and_said_unless_the_default(tiny_model, caplog):
    """The model's max_position_embeddings (2048 here) caps max_model_len; a longer one asked for is
    logged (the default, 4096, is cut quietly)."""
    with caplog.at_level(logging.WARNING, logger="nanovllm.config"):
        assert Config(str(tiny_model)).max_model_len == 2048
        assert not caplog.records
        assert Config(str(tiny_model), max_model_len=10 ** 6).max_model_len == 2048
    assert "max_model_len=1000000 is more than the model's max_position_embeddings (2048" in caplog.text


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
    (dict(tensor_parallel_size=3, device="cpu"), ValueError, "does not divide"),   # on CPU any count of ranks
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


def test_a_hub_repository_id_is_fetched_into_the_cache_as_vllm_does(tiny_model, monkeypatch):
    """An org/name that is no local path is a Hugging Face Hub repository: its checkpoint comes from the Hub's
    cache (fetched if need be, weights as safetensors only, none for dummy weights); a failed fetch is a
    FileNotFoundError that says both what was looked for and why the fetch failed. Local paths never reach
    the Hub."""
    import huggingface_hub
    calls = []

    def fake_snapshot_download(repo_id, ignore_patterns):
        calls.append((repo_id, ignore_patterns))
        if repo_id == "nobody/nothing":
            raise OSError("repository not found")
        return str(tiny_model)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert Config("Qwen/Qwen3-tiny").model == str(tiny_model)
    assert Config("Qwen/Qwen3-tiny", load_format="dummy").model == str(tiny_model)
    assert calls[0][0] == "Qwen/Qwen3-tiny" and "*.bin" in calls[0][1] and "*.safetensors" not in calls[0][1]
    assert "*.safetensors" in calls[1][1]                       # dummy weights: config and tokenizer alone
    with pytest.raises(FileNotFoundError, match="nobody/nothing.*Hugging Face Hub.*repository not found"):
        Config("nobody/nothing")
    calls.clear()
    for local in ("./nobody/nothing", "/nobody/nothing", "nobody/nothing/deeper", "nothing"):
        with pytest.raises(FileNotFoundError, match="not found"):
            Config(local)
    assert not calls


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


# ---- FP8 weights (issue 26) ------------------------------------------------------------------------------------
BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def fp8_dynamic(**changes):
    from fp8_checkpoint import FP8_DYNAMIC_CONFIG
    config = json.loads(json.dumps(FP8_DYNAMIC_CONFIG))
    group = config["config_groups"]["group_0"]
    for key, value in changes.items():
        where, _, field = key.partition("__")
        if field:
            group[where][field] = value
        else:
            config[where] = value
    return config


def with_quantization_config(tiny_model, tmp_path, quantization_config, architecture=None):
    """A copy of the tiny model's config.json with a quantization_config (Config reads no weights with dummy)."""
    other = tmp_path / "quantized"
    other.mkdir(exist_ok=True)
    for file in tiny_model.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, other / file.name)
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = quantization_config
    if architecture is not None:
        config.update(architectures=[architecture], model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32)
    (other / "config.json").write_text(json.dumps(config))
    return str(other)


def test_quantization_fp8_quantizes_an_unquantized_checkpoint_online_per_channel(tiny_model):
    from nanovllm.layers.quantization import UNQUANTIZED
    from nanovllm.layers.quantization.fp8 import Fp8ChannelMethod
    config = Config(str(tiny_model), quantization="fp8")
    assert config.quantization == "fp8"
    assert config.quant_method == Fp8ChannelMethod(online=True)
    assert Config(str(tiny_model)).quant_method is UNQUANTIZED and Config(str(tiny_model)).quantization is None


@pytest.mark.parametrize("quantization_config, scheme", [
    (BLOCK_FP8, "block"),
    ({k: v for k, v in BLOCK_FP8.items() if k != "fmt"}, "block"),     # e4m3 is the default
    (dict(BLOCK_FP8, modules_to_not_convert=["lm_head"]), "block"),
    (fp8_dynamic(), "channel"),
    (fp8_dynamic(ignore=["lm_head", "re:.*embed_tokens"]), "channel"),
])
@pytest.mark.parametrize("requested", [None, "fp8"])
def test_fp8_checkpoints_are_fp8_whether_or_not_asked(tiny_model, tmp_path, quantization_config, scheme, requested):
    model = with_quantization_config(tiny_model, tmp_path, quantization_config)
    config = Config(model, quantization=requested, load_format="dummy")
    assert config.quantization == "fp8" and config.quant_method.scheme == scheme
    assert config.quant_method.online          # dummy weights are drawn in bf16, then quantized


@pytest.mark.parametrize("quantization_config, words", [
    ({"quant_method": "awq", "bits": 4}, "quantization method 'awq' in .*not supported; supported: fp8"),
    ({"quant_method": "gptq", "bits": 4}, "quantization method 'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "quantization method 'bitsandbytes'"),
    (dict(BLOCK_FP8, activation_scheme="static"), "activation_scheme 'static'"),
    (dict(BLOCK_FP8, weight_block_size=[64, 64]), r"weight_block_size \[64, 64\].*supported: \[128, 128\]"),
    ({k: v for k, v in BLOCK_FP8.items() if k != "weight_block_size"}, "without weight_block_size"),
    (dict(BLOCK_FP8, fmt="e5m2"), "format 'e5m2'"),
    (dict(BLOCK_FP8, modules_to_not_convert=["down_proj"]), "leaves model.layers.0.mlp.down_proj unquantized"),
    (fp8_dynamic(weights__strategy="tensor"), "compressed-tensors weights .*'strategy': 'tensor'"),
    (fp8_dynamic(input_activations__dynamic=False), "compressed-tensors input_activations"),
    (fp8_dynamic(input_activations__num_bits=4), "compressed-tensors input_activations"),
    (fp8_dynamic(weights__type="int"), "compressed-tensors weights"),
    (fp8_dynamic(format="pack-quantized"), "format 'pack-quantized'"),
    (fp8_dynamic(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    (fp8_dynamic(ignore=["lm_head", "re:.*self_attn.o_proj"]), "leaves model.layers.0.self_attn.o_proj unquantized"),
])
def test_other_quantization_configs_are_refused_by_name(tiny_model, tmp_path, quantization_config, words):
    model = with_quantization_config(tiny_model, tmp_path, quantization_config)
    for requested in (None, "fp8"):
        with pytest.raises(ValueError, match=words):
            Config(model, quantization=requested, load_format="dummy")


def test_bogus_quantization_is_refused(tiny_model):
    for bogus in ("bogus", "FP8", "int8", 8):
        with pytest.raises(ValueError, match="quantization must be None or 'fp8'"):
            Config(str(tiny_model), quantization=bogus)


def test_fp8_applies_to_mixture_of_experts_models(tiny_model, tmp_path):
    model = with_quantization_config(tiny_model, tmp_path, BLOCK_FP8, architecture="Qwen3MoeForCausalLM")
    assert Config(model, load_format="dummy").quant_method.scheme == "block"
    moe = write_random_checkpoint(tmp_path / "moe", architecture="MixtralForCausalLM", weights=False)
    assert Config(str(moe), quantization="fp8", load_format="dummy").quant_method.scheme == "channel"
