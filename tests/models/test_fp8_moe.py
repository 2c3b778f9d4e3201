"""FP8 experts in the engine, on CPU (float32 compute, the torch path): Qwen3-MoE and Mixtral checkpoints in
Qwen's block-FP8 release layout (routers and LM head left unconverted, as Qwen3-30B-A3B-FP8 leaves them) and
in compressed-tensors' FP8-dynamic layout, against transformers on the dequantized weights; online
quantization of the experts; tensor parallelism over the experts' scale blocks. Run with -s for the figures."""
import pytest
import torch

import oracle
from fp8_checkpoint import dequantized, to_block_fp8, to_fp8_dynamic
from nanovllm import LLM, SamplingParams
from teacher_forcing import compare, forced_logprobs, hf_forced_logprobs

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.cpu_only]     # every engine is ENGINE's device="cpu"

# every dimension a multiple of 128 (also per rank at TP=2), 8 experts, top 2
SHAPES = {
    "qwen3-moe": dict(architecture="Qwen3MoeForCausalLM", hidden_size=256, moe_intermediate_size=256,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=128, num_hidden_layers=2, vocab_size=512),
    "mixtral": dict(architecture="MixtralForCausalLM", hidden_size=256, intermediate_size=256,
                    num_local_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=128, num_hidden_layers=2, vocab_size=512),
}
MARGIN = 0.5            # nats: a decided position
NUM_FORCED = 24
ENGINE = dict(device="cpu", max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=48)   # on a GPU box too


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoints(request, make_checkpoint, tmp_path_factory):
    original = make_checkpoint(**SHAPES[request.param])
    root = tmp_path_factory.mktemp(f"fp8-{request.param}")
    block, dynamic = to_block_fp8(original, root / "block"), to_fp8_dynamic(original, root / "dynamic")
    return dict(name=request.param, original=original, block=block, dynamic=dynamic,
                block_dequantized=dequantized(block, root / "block-dequantized"))


@pytest.fixture(scope="module")
def positions():
    prompts = oracle.random_prompts(12, 512, (10, 50), seed=13)
    continuations = oracle.random_prompts(12, 512, (NUM_FORCED, NUM_FORCED), seed=14)
    return prompts, continuations


def ours(model_dir, positions, **kwargs):
    with LLM(str(model_dir), **ENGINE, **kwargs) as llm:
        weights = {name: p.detach().clone() for name, p in llm.model_runner.model.named_parameters()}
        return forced_logprobs(llm, *positions, use_graphs=False, num_forced=NUM_FORCED), weights


def unquantized_activations(x, group=None):
    """A stand-in for quantize_activations: the activations as they are, with scales of one."""
    rows = x.shape[0]
    return x.float(), torch.ones((rows,) if group is None else (rows, -(-x.shape[1] // group)))


def test_block_fp8_experts_are_the_dequantized_weights(checkpoints, positions, monkeypatch):
    """With the activations left unquantized, the engine multiplies by exactly the dequantized weights that
    transformers runs (scales, gate/up blocks, shards and layout all right): the same log-probs to float32
    summation order (mean KL under 1e-7: Mixtral measures 1.3e-8 against transformers 5.24, whose experts
    sum in another order; one wrong scale block costs orders of magnitude more)."""
    from nanovllm.layers.quantization import fp8
    monkeypatch.setattr(fp8, "quantize_activations", unquantized_activations)
    logprobs, weights = ours(checkpoints["block"], positions)
    experts = "model.layers.1.mlp.experts"
    assert weights[f"{experts}.w13_weight"].dtype == weights[f"{experts}.w2_weight"].dtype == torch.float8_e4m3fn
    assert weights[f"{experts}.w13_weight_scale_inv"].shape == (8, 4, 2)      # gate's 2 row blocks, then up's
    assert weights[f"{experts}.w2_weight_scale_inv"].shape == (8, 2, 2)
    assert weights["model.layers.1.mlp.gate.weight"].dtype == torch.float32         # the router: unquantized
    stats = compare(logprobs, reference(checkpoints, positions), MARGIN)
    assert stats["agreement"] == 1.0 and stats["kl"] < 1e-7, stats


def test_block_fp8_experts_track_transformers_on_the_dequantized_weights(checkpoints, positions):
    """With the activations quantized too (1 x 128 groups, e4m3's 3-bit mantissa), the router sees slightly
    different hidden states and sometimes swaps a token's second and third expert: a looser agreement than
    dense layers (tests/models/test_fp8_checkpoints.py), still far from a wrong model (a scale misapplied
    leaves a few percent)."""
    logprobs, _ = ours(checkpoints["block"], positions)
    stats = compare(logprobs, reference(checkpoints, positions), MARGIN)
    print(f"{checkpoints['name']} block FP8 vs transformers on its dequantized weights: mean KL "
          f"{stats['kl']:.2e}, agreement {stats['agreement']:.4f} on {stats['decided']:.0%} decided")
    assert stats["decided"] > 0.1 and stats["agreement"] >= 0.9 and stats["kl"] < 3e-2


_references = {}


def reference(checkpoints, positions):
    if checkpoints["name"] not in _references:
        _references[checkpoints["name"]] = hf_forced_logprobs(
            oracle.load_hf_model(checkpoints["block_dequantized"]), *positions, num_forced=NUM_FORCED)
    return _references[checkpoints["name"]]


def test_fp8_dynamic_experts_are_exactly_online_quantization(checkpoints, positions):
    """Per-row weight scales, per-token activations: the checkpoint's values and the ones quantization='fp8'
    computes at load are the same bits, experts included, and so are the log-probs."""
    loaded, loaded_weights = ours(checkpoints["dynamic"], positions)
    online, online_weights = ours(checkpoints["original"], positions, quantization="fp8")
    scale = online_weights["model.layers.0.mlp.experts.w13_weight_scale"]
    assert scale.shape == (8, 512) and scale.min() > 0
    assert loaded_weights.keys() == online_weights.keys()
    for name, weight in loaded_weights.items():
        other = online_weights[name]
        assert weight.dtype == other.dtype, name
        if weight.dtype == torch.float8_e4m3fn:
            weight, other = weight.view(torch.uint8), other.view(torch.uint8)
        assert torch.equal(weight, other), name
    assert torch.equal(loaded, online)


def test_tp2_equals_tp1_on_block_fp8_experts(checkpoints):
    """Each rank holds 128 of each expert's 256 intermediate rows and their scale blocks; the activation
    groups are the same on either split, so TP=2 only sums the row-parallel partial products in another
    order. Most prompt positions' log-probs agree to float32 rounding; but an activation that sits on an
    e4m3 rounding boundary may round the other way (a 6% step), or a router near-tie flip, and later
    positions see that through attention: a few hundredths of a nat (measured: 0.04 at worst, Mixtral).
    A misplaced shard or scale block would move every position by far more."""
    prompts = oracle.random_prompts(3, 512, (20, 60), seed=15)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    logprobs = {}
    for tp in (1, 2):
        with LLM(str(checkpoints["block"]), tensor_parallel_size=tp, **ENGINE) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        logprobs[tp] = torch.tensor([value for o in outputs for entry in o["prompt_logprobs"][1:]
                                     for value in entry.values()])
    assert len(logprobs[1]) == sum(len(p) - 1 for p in prompts)
    difference = (logprobs[2] - logprobs[1]).abs()
    assert difference.median() < 1e-4 and difference.max() < 0.1, (difference.median(), difference.max())


def test_block_fp8_experts_must_split_on_scale_blocks(make_checkpoint, tmp_path):
    """An expert intermediate size of 128 over two ranks would cut its scale blocks in half: refused."""
    shape = dict(SHAPES["qwen3-moe"], moe_intermediate_size=128)
    block = to_block_fp8(make_checkpoint(**shape), tmp_path / "block")
    with pytest.raises(ValueError, match="block-FP8 experts .* multiple of 128"):
        LLM(str(block), tensor_parallel_size=2, **ENGINE)
