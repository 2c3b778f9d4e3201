"""FP8 weights on the GPU, against the same engine in bf16: teacher-forced next-token distributions on the
Qwen3-0.6B shape, through the Triton/cuBLASLt GEMMs and CUDA graphs, with the fp8 KV cache too; per-channel
(quantization="fp8" on a bf16 checkpoint) and 128x128 blocks (a block-FP8 config.json, dummy weights drawn
exactly as the bf16 run's, then quantized); FP8 experts on Qwen3-30B-A3B's layer shape; and no Triton
compilation after start-up. Run with -s for the figures docs/benchmarks.md records."""
import json
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from benchmarks.random_checkpoint import QWEN3_0_6B, QWEN3_30B_A3B
from compilations import assert_none_compiled, recorded_compilations
from teacher_forcing import compare, forced_logprobs, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MARGIN = 0.5
ENGINE = dict(max_model_len=1024, gpu_memory_utilization=0.5)
BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# FP8 against bf16 is the format's noise (e4m3 keeps 3 mantissa bits of every weight and activation): measured
# on an H100, 2026-11-24, KL 3.7e-2 to 4.9e-2 and agreement 0.85 to 0.91 on the ~11% of these random-weight
# positions that are decided. A broken GEMM, scale or shard gives a KL of nats and chance agreement.
MIN_AGREEMENT, MAX_MEAN_KL = 0.8, 0.08
# the GPU kernels against the torch path's arithmetic run on the GPU: the same quantized values, float32 sums
# in another order. Not bit-identical, and W8A8 amplifies that: an output one bf16 ulp apart can move a row's
# amax, so the next layer rounds the whole row onto another grid. Measured (H100): KL 1.2e-2 to 1.5e-2, with
# every decided position agreeing; a wrong scale, shard or tile gives KL in nats.
KERNEL_MAX_KL, KERNEL_MIN_AGREEMENT = 2.5e-2, 0.97


def positions():
    return random_prompts(8, seed=0, lengths=(100, 900)), random_prompts(8, seed=1, lengths=(48, 48))


def report(what, fp8, bf16):
    stats = compare(fp8, bf16, MARGIN)
    print(f"{what} vs bf16 over {fp8.shape[:2].numel()} positions: mean KL {stats['kl']:.2e}, top-1 agreement "
          f"{stats['agreement']:.4f} on the {stats['decided']:.0%} with a gap > {MARGIN} nats")
    return stats


def exercise_without_compiling(llm):
    """Requests of every batch size class and prompt length after start-up: nothing may compile."""
    with recorded_compilations() as compiled:
        prompts = random_prompts(40, seed=11, lengths=(1, 1000))
        for options in (dict(temperature=0.0), dict(temperature=0.6, top_p=0.95, top_k=20)):
            for batch in (prompts[:1], prompts[:3], prompts[:40]):
                llm.generate(batch, SamplingParams(max_tokens=8, ignore_eos=True, **options), use_tqdm=False)
        forced_logprobs(llm, *positions(), use_graphs=False, num_forced=4)    # eager decode of 8 rows
    assert_none_compiled(compiled)


def torch_path(method, layer, x, bias):
    """layers/quantization/fp8.py's CPU arithmetic, run on the GPU: the oracle for the engine's kernels (in
    place of Fp8Method.apply)."""
    from nanovllm.layers.quantization.fp8 import fp8_linear_torch
    y = fp8_linear_torch(x, layer.weight, getattr(layer, method.scale_name), method.scheme)
    return y if bias is None else y + bias


FP8_APPLY = "nanovllm.layers.quantization.fp8.Fp8Method.apply"     # what torch_path stands in for


def check_kernels_against_the_torch_path(what, kernels, oracle):
    stats = compare(kernels, oracle, MARGIN)
    print(f"{what}, GPU kernels vs the torch path: mean KL {stats['kl']:.2e}, top-1 agreement "
          f"{stats['agreement']:.4f} on the {stats['decided']:.0%} decided")
    assert stats["kl"] <= KERNEL_MAX_KL and stats["agreement"] >= KERNEL_MIN_AGREEMENT


def weight_bytes(llm) -> int:
    return sum(p.numel() * p.element_size() for p in llm.model_runner.model.parameters())


def test_online_fp8_weights_track_bf16_with_graphs_and_an_fp8_cache(make_checkpoint, monkeypatch):
    model_dir = make_checkpoint(dtype=torch.bfloat16, device="cuda", **QWEN3_0_6B)
    prompts, continuations = positions()
    logprobs, sizes = {}, {}
    with LLM(str(model_dir), **ENGINE) as llm:
        logprobs["bf16"] = forced_logprobs(llm, prompts, continuations)
        sizes["bf16"] = weight_bytes(llm)
    with LLM(str(model_dir), quantization="fp8", **ENGINE) as llm:
        layer = llm.model_runner.model.model.layers[0].mlp.gate_up_proj
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (2 * 3072,)
        sizes["fp8"] = weight_bytes(llm)
        logprobs["fp8"] = forced_logprobs(llm, prompts, continuations)                      # CUDA graphs
        logprobs["fp8 eager"] = forced_logprobs(llm, prompts, continuations, use_graphs=False)
        exercise_without_compiling(llm)
    with LLM(str(model_dir), quantization="fp8", kv_cache_dtype="fp8", **ENGINE) as llm:
        logprobs["fp8 + fp8 cache"] = forced_logprobs(llm, prompts, continuations)
        exercise_without_compiling(llm)
    with monkeypatch.context() as patch:
        patch.setattr(FP8_APPLY, torch_path)
        with LLM(str(model_dir), quantization="fp8", **ENGINE) as llm:
            logprobs["torch path"] = forced_logprobs(llm, prompts, continuations)
    check_kernels_against_the_torch_path("online FP8", logprobs["fp8"], logprobs["torch path"])
    linear = 28 * (1024 * (2048 + 2 * 1024) + 2048 * 1024 + 3 * 1024 * 3072)
    print(f"weights: {sizes['bf16'] / 1e9:.3f} GB bf16 -> {sizes['fp8'] / 1e9:.3f} GB with FP8 linear layers")
    assert sizes["bf16"] - sizes["fp8"] >= linear * 0.99        # one byte saved per linear weight (scales aside)
    for what in ("fp8", "fp8 eager", "fp8 + fp8 cache"):
        stats = report(f"online FP8 weights ({what})", logprobs[what], logprobs["bf16"])
        assert stats["agreement"] >= MIN_AGREEMENT and stats["kl"] <= MAX_MEAN_KL and stats["decided"] > 0.05
    graphs = compare(logprobs["fp8"], logprobs["fp8 eager"], MARGIN)
    print(f"FP8 weights, CUDA graphs vs eager: mean KL {graphs['kl']:.1e}")
    assert graphs["kl"] < 1e-3


def test_block_fp8_weights_track_bf16(tmp_path, monkeypatch):
    """A config.json that says block FP8 (as Qwen3-*-FP8's), run with dummy weights: the engine draws the same
    bf16 numbers as a plain dummy run (the same generator over the same parameters), then quantizes them per
    128x128 block; its activations go per 1x128 group through our block-scaled Triton GEMM."""
    from benchmarks.random_checkpoint import write_random_checkpoint
    plain = write_random_checkpoint(tmp_path / "plain", dtype=torch.bfloat16, weights=False, **QWEN3_0_6B)
    block = tmp_path / "block"
    shutil.copytree(plain, block)
    config = json.loads((block / "config.json").read_text())
    config["quantization_config"] = BLOCK_FP8
    (block / "config.json").write_text(json.dumps(config))
    prompts, continuations = positions()
    with LLM(str(plain), load_format="dummy", **ENGINE) as llm:
        bf16 = forced_logprobs(llm, prompts, continuations)
    with LLM(str(block), load_format="dummy", **ENGINE) as llm:
        layer = llm.model_runner.model.model.layers[0].self_attn.qkv_proj
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.shape == (32, 8)
        fp8 = forced_logprobs(llm, prompts, continuations)
        exercise_without_compiling(llm)
    with monkeypatch.context() as patch:
        patch.setattr(FP8_APPLY, torch_path)
        with LLM(str(block), load_format="dummy", **ENGINE) as llm:
            check_kernels_against_the_torch_path("block FP8", fp8, forced_logprobs(llm, prompts, continuations))
    stats = report("block FP8 weights (dummy)", fp8, bf16)
    assert stats["agreement"] >= MIN_AGREEMENT and stats["kl"] <= MAX_MEAN_KL and stats["decided"] > 0.05


def moe_torch_path(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None):
    """layers/fused_moe.py's torch experts (each an FP8 linear layer's arithmetic), run on the GPU."""
    from nanovllm.layers.fused_moe import fused_moe
    from nanovllm.layers.quantization.fp8 import fp8_linear_torch
    scheme = "block" if w13_scale.dim() == 3 else "channel"
    return fused_moe(x, w13, w2, topk_weights, topk_ids.long(), w13_scale, w2_scale,
                     lambda rows, weight, scale: fp8_linear_torch(rows, weight, scale, scheme))


def with_config(source, target, quantization_config):
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_fp8_experts_track_bf16(tmp_path, monkeypatch):
    """Qwen3-30B-A3B's layer shape (4 of its 48 layers), dummy weights: bf16, online FP8 (per row) and a
    block-FP8 config.json (Qwen3-30B-A3B-FP8's layout: routers and LM head unquantized); the grouped FP8 GEMMs
    against the torch experts run on the GPU; CUDA graphs; nothing compiled after start-up."""
    from benchmarks.random_checkpoint import write_random_checkpoint
    shape = dict(QWEN3_30B_A3B, num_hidden_layers=4)
    plain = write_random_checkpoint(tmp_path / "plain", architecture="Qwen3MoeForCausalLM", dtype=torch.bfloat16,
                                    weights=False, **shape)
    block = with_config(plain, tmp_path / "block", dict(BLOCK_FP8, modules_to_not_convert=[
        "lm_head", *(f"model.layers.{i}.mlp.gate" for i in range(4))]))
    prompts, continuations = positions()
    logprobs = {}
    with LLM(str(plain), load_format="dummy", **ENGINE) as llm:
        logprobs["bf16"] = forced_logprobs(llm, prompts, continuations)
    for what, model_dir, kwargs in (("online", plain, dict(quantization="fp8")), ("block", block, {})):
        with LLM(str(model_dir), load_format="dummy", **ENGINE, **kwargs) as llm:
            experts = llm.model_runner.model.model.layers[0].mlp.experts
            assert experts.w13_weight.dtype == torch.float8_e4m3fn
            assert llm.model_runner.model.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16
            logprobs[what] = forced_logprobs(llm, prompts, continuations)
            logprobs[f"{what} eager"] = forced_logprobs(llm, prompts, continuations, use_graphs=False)
            exercise_without_compiling(llm)
        with monkeypatch.context() as patch:
            patch.setattr(FP8_APPLY, torch_path)
            patch.setattr("nanovllm.kernels.fused_moe.fused_moe", moe_torch_path)
            with LLM(str(model_dir), load_format="dummy", enforce_eager=True, **ENGINE, **kwargs) as llm:
                oracle = forced_logprobs(llm, prompts, continuations, use_graphs=False)
        check_kernels_against_the_torch_path(f"{what} FP8 experts", logprobs[f"{what} eager"], oracle)
        stats = report(f"{what} FP8 experts", logprobs[what], logprobs["bf16"])
        assert stats["agreement"] >= MIN_AGREEMENT and stats["kl"] <= MAX_MEAN_KL and stats["decided"] > 0.05
        graphs = compare(logprobs[what], logprobs[f"{what} eager"], MARGIN)
        print(f"{what} FP8 experts, CUDA graphs vs eager: mean KL {graphs['kl']:.1e}")
        assert graphs["kl"] < 1e-3
