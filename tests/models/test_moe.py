"""Mixture-of-experts models (Qwen3-MoE, Mixtral) in float32 on CPU: greedy decoding is token-identical to
transformers on checkpoints it saved (the hub's per-expert layout), through prefix-cache hits, chunked
prefill, preemption and tensor parallelism; unknown MoE variants and incomplete checkpoints are refused."""
import json
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from oracle import hf_greedy, load_hf_model, random_prompts

pytestmark = pytest.mark.timeout(300)
# cpu_only (tests/conftest.py): the tests whose engines are all device="cpu"; those that build a Config of the
# default device ("auto": CUDA on a GPU box) stay with the GPU tests

QWEN3_MOE = "Qwen3MoeForCausalLM"
MIXTRAL = "MixtralForCausalLM"
SHAPES = {   # a small checkpoint each; hidden 64, 4 q / 2 kv heads, vocab 512 (random_checkpoint's defaults)
    "top1-of-8": dict(architecture=QWEN3_MOE, num_experts=8, num_experts_per_tok=1),
    "top2-of-16-renormalized": dict(architecture=QWEN3_MOE, num_experts=16, num_experts_per_tok=2,
                                    norm_topk_prob=True),
    "top8-of-64-dense-layer": dict(architecture=QWEN3_MOE, num_experts=64, num_experts_per_tok=8,
                                   moe_intermediate_size=16, num_hidden_layers=3, mlp_only_layers=[1]),
    "top4-of-8-every-other-layer": dict(architecture=QWEN3_MOE, num_experts=8, num_experts_per_tok=4,
                                        decoder_sparse_step=2, norm_topk_prob=True),
    "mixtral-top2-of-8": dict(architecture=MIXTRAL, intermediate_size=48),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def generate(llm, prompts, params=GREEDY):
    return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


def expected(model_dir, prompts, max_tokens=GREEDY.max_tokens):
    hf = load_hf_model(model_dir)
    return [hf_greedy(hf, p, max_tokens) for p in prompts]


@pytest.mark.cpu_only
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_greedy_matches_transformers(make_checkpoint, shape):
    model_dir = make_checkpoint(**SHAPES[shape])
    prompts = random_prompts(4, 512, (1, 60), seed=len(shape))
    with LLM(model_dir, device="cpu", kvcache_block_size=16, max_model_len=256) as llm:
        assert generate(llm, prompts) == expected(model_dir, prompts)


@pytest.mark.cpu_only
def test_the_layers_are_sparse_where_transformers_makes_them_sparse(make_checkpoint):
    from nanovllm.layers.fused_moe import SparseMoeBlock
    from nanovllm.models.llama import LlamaMLP

    for shape, sparse in (("top8-of-64-dense-layer", [True, False, True]),
                          ("top4-of-8-every-other-layer", [False, True])):
        with LLM(make_checkpoint(**SHAPES[shape]), device="cpu", max_model_len=64) as llm:
            layers = llm.model_runner.model.model.layers
            assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == sparse
            assert all(isinstance(layer.mlp, LlamaMLP) for layer, s in zip(layers, sparse) if not s)


@pytest.mark.cpu_only
@pytest.mark.parametrize("shape", ["top2-of-16-renormalized", "mixtral-top2-of-8"])
def test_prefix_cache_chunked_prefill_and_preemption_give_the_same_tokens(make_checkpoint, shape):
    model_dir = make_checkpoint(**SHAPES[shape])
    prefix = random_prompts(1, 512, (40, 40), seed=7)[0]
    prompts = random_prompts(6, 512, (1, 30), seed=8, shared_prefix=prefix)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with LLM(model_dir, device="cpu", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=10,
             max_num_batched_tokens=24) as llm:
        first = generate(llm, prompts[:1], params)
        rest = generate(llm, prompts[1:], params)
        assert llm.stats["num_prefix_cache_hit_tokens"] > 0
        assert llm.stats["num_preemptions"] > 0
    assert first + rest == expected(model_dir, prompts, max_tokens=20)


@pytest.mark.cpu_only
@pytest.mark.parametrize("shape", ["top2-of-16-renormalized", "mixtral-top2-of-8"])
def test_tensor_parallel_over_gloo_equals_one_rank(make_checkpoint, shape):
    """Each expert's intermediate dimension split over two ranks, the router replicated."""
    model_dir = make_checkpoint(**SHAPES[shape])
    prompts = random_prompts(3, 512, (5, 40), seed=9)
    outputs = {}
    for tp in (1, 2):
        with LLM(str(model_dir), device="cpu", tensor_parallel_size=tp, kvcache_block_size=16,
                 max_model_len=128) as llm:
            outputs[tp] = generate(llm, prompts)
    assert outputs[2] == outputs[1] == expected(model_dir, prompts)


def test_dummy_weights_need_no_safetensors_and_are_seeded(tmp_path):
    from benchmarks.random_checkpoint import write_random_checkpoint

    model_dir = write_random_checkpoint(tmp_path / "config-only", architecture=QWEN3_MOE, weights=False)
    assert not list(model_dir.glob("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="load_format='dummy'"):
        Config(str(model_dir))
    prompts = random_prompts(2, 512, (5, 20), seed=3)
    runs = []
    for _ in range(2):
        with LLM(str(model_dir), device="cpu", load_format="dummy", max_model_len=64) as llm:
            runs.append(generate(llm, prompts))
            params = dict(llm.model_runner.model.named_parameters())
    assert runs[0] == runs[1]                       # the same weights each time
    experts = params["model.layers.0.mlp.experts.w13_weight"]
    scale = json.loads((model_dir / "config.json").read_text())["initializer_range"]     # 64 ** -0.5 here
    assert 0.9 * scale < experts.std().item() < 1.1 * scale
    assert torch.equal(params["model.layers.0.input_layernorm.weight"], torch.ones(64))
    with pytest.raises(ValueError, match="load_format"):
        Config(str(model_dir), load_format="random")


def _edited_copy(model_dir, tmp_path, name, **changes):
    other = tmp_path / name
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config.update(changes)
    (other / "config.json").write_text(json.dumps(config))
    return str(other)


def test_unknown_moe_variants_are_refused_by_name(make_checkpoint, tmp_path):
    qwen = make_checkpoint(**SHAPES["top1-of-8"])
    for architecture in ("Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM"):
        with pytest.raises(ValueError, match=f"mixture-of-experts architecture.*{architecture}.*Qwen3MoeForCausalLM"):
            Config(_edited_copy(qwen, tmp_path, architecture, architectures=[architecture]))
    with pytest.raises(ValueError, match="shared experts"):
        Config(_edited_copy(qwen, tmp_path, "shared", shared_expert_intermediate_size=64))
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        Config(_edited_copy(qwen, tmp_path, "too-many", num_experts_per_tok=9))
    mixtral = make_checkpoint(**SHAPES["mixtral-top2-of-8"])
    with pytest.raises(ValueError, match="sliding window of 32"):
        Config(_edited_copy(mixtral, tmp_path, "window", sliding_window=32), max_model_len=64)
    assert Config(_edited_copy(mixtral, tmp_path, "wide-window", sliding_window=64), max_model_len=64)


def test_tensor_parallel_must_divide_the_experts_intermediate_size(make_checkpoint):
    model_dir = make_checkpoint(**SHAPES["top1-of-8"], moe_intermediate_size=30)
    with pytest.raises(ValueError, match="does not divide moe_intermediate_size=30"):
        Config(str(model_dir), tensor_parallel_size=4)


@pytest.mark.cpu_only
def test_a_checkpoint_missing_one_expert_is_refused(make_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "missing-expert"
    shutil.copytree(make_checkpoint(**SHAPES["top1-of-8"]), model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks weights for: model.layers.1.mlp.experts.w13_weight"):
        LLM(str(model_dir), device="cpu", max_model_len=64)
