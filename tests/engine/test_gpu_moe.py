"""Mixture-of-experts models on the GPU in bf16: Qwen3-30B-A3B's layer shape (4 of its 48 layers) and Mixtral
8x7B's (2 of 32), random weights, teacher-forced against transformers on the same GPU; CUDA-graph decode
against eager; start-up compiles every MoE kernel variant a request can reach."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from benchmarks.random_checkpoint import QWEN3_30B_A3B
from compilations import assert_none_compiled, recorded_compilations
from oracle import load_hf_model
from teacher_forcing import NUM_FORCED, compare, forced_logprobs, hf_forced_logprobs, random_prompts

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(900)]

SHAPES = {
    "qwen3-30b-a3b-4-layers": dict(architecture="Qwen3MoeForCausalLM", **{**QWEN3_30B_A3B, "num_hidden_layers": 4}),
    "mixtral-8x7b-2-layers": dict(architecture="MixtralForCausalLM", hidden_size=4096, intermediate_size=14336,
                                 num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                 num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                                 max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5),
}


# Random routers put experts' probabilities close together: where two are within bf16's rounding of each
# other, two correct implementations pick different ones, and among 8 experts (Mixtral) the swapped one
# carries a third of the token's output (it moved a top-1 log-prob by 2.4 nats at 1.2% of positions).
# Trained routers are decisive; Mixtral's random ones are made so by scaling their logits up 4x.
ROUTER_SHARPNESS = {"mixtral-8x7b-2-layers": 4.0}


def sharpen_routers(model_dir, factor: float) -> None:
    from safetensors.torch import load_file, save_file
    for file in model_dir.glob("*.safetensors"):
        tensors = load_file(file)
        gates = [name for name in tensors if name.endswith(("block_sparse_moe.gate.weight", "mlp.gate.weight"))]
        for name in gates:
            tensors[name] = tensors[name] * factor
        if gates:
            save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(SHAPES))
def model_dir(request, make_checkpoint):
    path = make_checkpoint(dtype=torch.bfloat16, device="cuda", **SHAPES[request.param])
    if request.param in ROUTER_SHARPNESS:
        sharpen_routers(path, ROUTER_SHARPNESS.pop(request.param))     # once per session
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), max_model_len=1024, gpu_memory_utilization=0.6) as engine:
        yield engine


def test_teacher_forced_logprobs_agree_with_transformers(request, model_dir, llm):
    """As for the dense models: top-1 agreement >= 99% where transformers' top-1 leads by more than the tie
    margin, and the whole distributions agree closely."""
    prompts = random_prompts(8, seed=0)
    continuations = random_prompts(8, seed=1, lengths=(NUM_FORCED, NUM_FORCED))
    ours = forced_logprobs(llm, prompts, continuations)
    hf = load_hf_model(model_dir, dtype=torch.bfloat16, device="cuda")
    try:
        figures = compare(ours, hf_forced_logprobs(hf, prompts, continuations))
    finally:
        del hf
        torch.cuda.empty_cache()
    shape = request.node.callspec.params["model_dir"]
    print(f"{shape}: vs transformers {figures}")
    assert figures["decided"] > 0.5
    assert figures["agreement"] >= 0.99
    # the bound the dense models keep at every position, here at 99% of them: a token whose expert choice
    # flipped on a near-tie moves its own logits by more (Mixtral's worst: 1.8 nats)
    assert figures["top_logprob_diff_p99"] < 0.25
    assert figures["kl"] < 1e-2


def test_cuda_graph_decode_matches_eager(llm):
    prompts = random_prompts(6, seed=2)
    continuations = random_prompts(6, seed=3, lengths=(NUM_FORCED, NUM_FORCED))
    graphs = forced_logprobs(llm, prompts, continuations, use_graphs=True)
    eager = forced_logprobs(llm, prompts, continuations, use_graphs=False)
    figures = compare(graphs, eager)
    print(f"graphs vs eager {figures}")
    assert figures["agreement"] == 1.0
    assert figures["top_logprob_diff_p99"] < 0.25
    assert figures["kl"] < 1e-2


def test_no_request_compiles_a_kernel_after_start_up(llm):
    """Batches of 1 to 200 sequences and prompts of 1 to 1,000 tokens reach every token-count bucket of the
    MoE kernels, in prefill and in decode."""
    with recorded_compilations() as compiled:
        prompts = random_prompts(200, seed=11, lengths=(1, 1000))
        for batch in (prompts[:1], prompts[1:4], prompts[4:24], prompts[24:200]):
            llm.generate(batch, SamplingParams(temperature=0.6, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert_none_compiled(compiled)
