"""bench.py on CPU: the workload is upstream's draw, the floor matches the worked numbers of
docs/architecture.md ("Performance yardsticks"), and a tiny end-to-end run of each engine reports
consistent figures. Parameters counted from a config match the checkpoint's; a mixture-of-experts floor
reads the experts a step touches, a dense one is unchanged."""
import argparse
import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.random_checkpoint import QWEN3_0_6B, QWEN3_8B, QWEN3_30B_A3B, write_random_checkpoint

_spec = importlib.util.spec_from_file_location("bench", Path(__file__).resolve().parents[1] / "bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),   # the engine runs many steps (MoE's: 100x slower on two)
              pytest.mark.cpu_only]     # every run passes --device cpu; the cuda cases only draw workloads

# --device cpu: these are CPU runs on a GPU box too (the CPU's float32 model, workloads and defaults)
TINY_RUN = ["--device", "cpu", "--num-seqs", "4", "--max-input-len", "32", "--max-output-len", "8", "--seed", "3",
            "--json"]


def upstream_draw(num_seqs: int, max_input_len: int, max_output_len: int, seed: int):
    """nano-vllm's bench.py, verbatim in its use of the global random module."""
    random.seed(seed)
    prompt_token_ids = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))]
                        for _ in range(num_seqs)]
    max_tokens = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompt_token_ids, max_tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # token ids go up to 10000, as upstream draws them; tied embeddings, as Qwen3-0.6B has
    return write_random_checkpoint(tmp_path_factory.mktemp("bench") / "tiny", vocab_size=10240,
                                   tie_word_embeddings=True)


def run_bench(capsys, argv: list[str]) -> dict:
    figures = bench.main(argv)
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last_line) == json.loads(json.dumps(figures))
    return figures


def check_consistent(figures: dict) -> None:
    workload = bench.make_workload(4, 32, 8, seed=3)
    assert figures["total_tokens"] == sum(workload.max_tokens)
    assert figures["prompt_tokens"] == sum(map(len, workload.prompts))
    assert figures["throughput"] == pytest.approx(figures["total_tokens"] / figures["time_s"])
    assert 0 < figures["fraction_of_floor"] <= 1
    assert figures["fraction_of_floor"] == pytest.approx(figures["floor_s"] / figures["time_s"])
    floor_s = ((figures["kv_read_bytes"] + figures["weight_read_bytes"]) / (figures["bandwidth_gbps"] * 1e9)
               + figures["prefill_flops"] / (figures["peak_tflops"] * 1e12))
    assert figures["floor_s"] == pytest.approx(floor_s)


def test_workload_is_upstreams_draw():
    prompts, max_tokens = upstream_draw(256, 1024, 1024, seed=0)
    workload = bench.make_workload(256, 1024, 1024, seed=0)
    assert workload.prompts == prompts and workload.max_tokens == max_tokens
    assert sum(workload.max_tokens) == 133_966          # docs/architecture.md's output token count
    assert bench.make_workload(256, 1024, 1024, seed=1).max_tokens != max_tokens
    small = bench.make_workload(16, 128, 64, seed=0)   # short maxima lower the lower bound to max/2
    assert all(64 <= len(p) <= 128 for p in small.prompts) and all(32 <= m <= 64 for m in small.max_tokens)


def test_floor_matches_design_numbers():
    config = AutoConfig.for_model("qwen3", **QWEN3_0_6B)
    workload = bench.make_workload(256, 1024, 1024, seed=0)
    floor = bench.hardware_floor(config, 596_049_920, 2, workload, bandwidth=3.0e12, flops=800e12)
    assert floor["kv_read_bytes"] / 1e12 == pytest.approx(13.87, abs=0.01)
    assert floor["weight_read_bytes"] / 1e12 == pytest.approx(1.22, abs=0.01)
    assert floor["prefill_flops"] / 800e12 == pytest.approx(0.17, abs=0.01)
    assert floor["floor_s"] == pytest.approx(5.2, abs=0.05)


def test_an_fp8_kv_cache_halves_the_floors_kv_reads():
    config = AutoConfig.for_model("qwen3", **QWEN3_0_6B)
    workload = bench.make_workload(256, 1024, 1024, seed=0)
    bf16 = bench.hardware_floor(config, 596_049_920, 2, workload, bandwidth=3.0e12, flops=800e12)
    fp8 = bench.hardware_floor(config, 596_049_920, 2, workload, bandwidth=3.0e12, flops=800e12, kv_itemsize=1)
    assert fp8["kv_read_bytes"] * 2 == bf16["kv_read_bytes"]
    assert fp8["weight_read_bytes"] == bf16["weight_read_bytes"]


def test_fp8_kv_cache_reaches_the_engine_and_the_floor(checkpoint, capsys):
    """On CPU the model runs in float32, so the same KV budget holds four times the blocks in fp8."""
    argv = ["--model", str(checkpoint), *TINY_RUN, "--bandwidth", "1000", "--peak-tflops", "10"]
    auto = run_bench(capsys, argv)
    fp8 = run_bench(capsys, argv + ["--kv-cache-dtype", "fp8"])
    assert (auto["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("float32", "float8_e4m3fn")
    assert fp8["num_kv_blocks"] == 4 * auto["num_kv_blocks"]
    assert fp8["kv_read_bytes"] * 4 == auto["kv_read_bytes"]


def test_fp8_weights_read_one_byte_per_projection_weight_and_prefill_at_twice_the_peak():
    """Qwen3-0.6B in bf16: 440M projection weights of its 596M parameters (the tied embedding, norms and
    q/k norms stay bf16); the standard workload's floor reads 0.44 GB less per decode step, and the
    projections' prefill FLOPs count at twice the peak."""
    config = AutoConfig.for_model("qwen3", **QWEN3_0_6B)
    fp8_params = bench.linear_parameters(config)
    assert fp8_params == 28 * (1024 * (2048 + 2 * 1024) + 2048 * 1024 + 3 * 1024 * 3072) == 440_401_920
    workload = bench.make_workload(256, 1024, 1024, seed=0)
    bf16 = bench.hardware_floor(config, 596_049_920, 2, workload, bandwidth=3.0e12, flops=800e12)
    fp8 = bench.hardware_floor(config, 596_049_920, 2, workload, bandwidth=3.0e12, flops=800e12,
                               fp8_params=fp8_params)
    steps = max(workload.max_tokens)
    assert bf16["weight_read_bytes"] - fp8["weight_read_bytes"] == fp8_params * steps
    assert fp8["weight_read_bytes"] == (596_049_920 * 2 - fp8_params) * steps
    assert fp8["kv_read_bytes"] == bf16["kv_read_bytes"] and fp8["prefill_flops"] == bf16["prefill_flops"]
    prompt_tokens = sum(map(len, workload.prompts))
    assert fp8["fp8_prefill_flops"] == 2 * fp8_params * prompt_tokens
    saved = (bf16["weight_read_bytes"] - fp8["weight_read_bytes"]) / 3.0e12 + fp8["fp8_prefill_flops"] / 2 / 800e12
    assert fp8["floor_s"] == pytest.approx(bf16["floor_s"] - saved)
    assert "fp8_params" not in bf16 and bench.linear_parameters(AutoConfig.for_model("qwen3", **QWEN3_8B)) > 6e9


def test_fp8_experts_read_one_byte_per_expert_weight_they_touch():
    """Qwen3-30B-A3B with FP8 weights: its touched experts' bytes halve, and their FLOPs with the projections'
    count at twice the peak; the dense part's saving is the projections' as for a dense model."""
    config = AutoConfig.for_model("qwen3_moe", **QWEN3_30B_A3B)
    num_params, fp8_params = bench.config_parameters(config), bench.linear_parameters(config)
    workload = bench.make_workload(64, 256, 128, seed=0)
    floors = {fp8: bench.hardware_floor(config, num_params, 2, workload, bandwidth=3.0e12, flops=800e12,
                                        fp8_params=fp8_params if fp8 else 0, fp8_experts=fp8) for fp8 in (False, True)}
    bf16, fp8 = floors[False], floors[True]
    steps = max(workload.max_tokens)
    assert fp8["expert_read_bytes"] * 2 == pytest.approx(bf16["expert_read_bytes"])
    assert bf16["weight_read_bytes"] - fp8["weight_read_bytes"] == pytest.approx(
        fp8_params * steps + fp8["expert_read_bytes"])
    assert fp8["experts_touched_fraction"] == pytest.approx(bf16["experts_touched_fraction"])
    experts = bench.moe_experts(config)
    assert fp8["fp8_experts"] and fp8["fp8_prefill_flops"] == 2 * (fp8_params + experts.active_params) * sum(
        map(len, workload.prompts))


def test_fp8_weights_reach_the_engine_and_the_floor(checkpoint, capsys):
    argv = ["--model", str(checkpoint), *TINY_RUN, "--bandwidth", "1000", "--peak-tflops", "10"]
    plain = run_bench(capsys, argv)
    fp8 = run_bench(capsys, argv + ["--quantization", "fp8"])
    assert plain["quantization"] is None and fp8["quantization"] == "fp8"
    assert fp8["fp8_params"] == bench.linear_parameters(AutoConfig.from_pretrained(checkpoint))
    # float32 on CPU: three bytes saved per projection weight and decode step
    steps = max(bench.make_workload(4, 32, 8, seed=3).max_tokens)
    assert plain["weight_read_bytes"] - fp8["weight_read_bytes"] == 3 * fp8["fp8_params"] * steps
    with pytest.raises(SystemExit):
        bench.parse_args(["--engine", "hf", "--quantization", "fp8"])


def test_count_parameters_counts_tied_embedding_once(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert bench.count_parameters(checkpoint, tied=True) == model.num_parameters()


def test_nanovllm_engine_on_cpu(checkpoint, capsys):
    argv = ["--model", str(checkpoint), *TINY_RUN, "--bandwidth", "1000", "--peak-tflops", "10",
            "--max-num-batched-tokens", "256"]
    figures = run_bench(capsys, argv)
    check_consistent(figures)
    assert figures["engine"] == "nanovllm" and figures["device"] == "cpu"
    assert figures["bandwidth_gbps"] == 1000 and figures["peak_tflops"] == 10
    assert 0 < figures["prefill_time_s"] and 0 < figures["decode_time_s"]
    assert figures["prefill_time_s"] + figures["decode_time_s"] <= figures["time_s"]
    assert figures["num_preemptions"] == 0 and 0 < figures["peak_kv_blocks"] <= figures["num_kv_blocks"]


def test_hf_engine_on_cpu(checkpoint, capsys):
    figures = run_bench(capsys, ["--engine", "hf", "--model", str(checkpoint), *TINY_RUN])   # measured floor
    check_consistent(figures)
    assert figures["engine"] == "hf" and figures["bandwidth_gbps"] > 0 and figures["peak_tflops"] > 0
    assert figures["prefill_time_s"] is None and figures["peak_kv_blocks"] is None


def test_engine_knobs_are_refused_for_hf():
    with pytest.raises(SystemExit):
        bench.parse_args(["--engine", "hf", "--max-num-seqs", "8"])


def test_sampling_options_reach_the_engine_and_n_counts_every_completion(checkpoint, capsys):
    argv = ["--model", str(checkpoint), *TINY_RUN, "--bandwidth", "1000", "--peak-tflops", "10",
            "--top-p", "0.95", "--top-k", "20", "--logprobs", "5", "--n", "2"]
    figures = run_bench(capsys, argv)
    assert (figures["top_p"], figures["top_k"], figures["logprobs"], figures["n"]) == (0.95, 20, 5, 2)
    workload = bench.make_workload(figures["num_seqs"], figures["max_input_len"], figures["max_output_len"],
                                   figures["seed"])
    assert figures["total_tokens"] == 2 * sum(workload.max_tokens)


def test_device_picks_the_engine_device_and_the_scale_of_the_defaults():
    on_cpu = bench.parse_args(["--device", "cpu"])
    assert on_cpu.device == "cpu" and on_cpu.num_seqs == bench.DEFAULTS["cpu"]["num_seqs"]
    assert bench.parse_args([]).device == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench.parse_args(["--device", "cuda"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "tpu"])


@pytest.mark.parametrize("argv", [["--top-p", "0"], ["--top-k", "-3"], ["--n", "0"], ["--logprobs", "30"],
                                  ["--engine", "hf", "--top-k", "20"]])
def test_bad_sampling_options_are_refused(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_each_workload_is_drawn_as_its_regime_says(device):
    sizes = bench.WORKLOAD_SIZES[device]
    standard = bench.draw_workload("standard", device, 0, num_seqs=256, max_input_len=1024, max_output_len=1024)
    assert standard == bench.make_workload(256, 1024, 1024, seed=0)       # upstream's draw, untouched
    single = bench.draw_workload("single-stream", device)
    assert [len(p) for p in single.prompts] == [sizes["single-stream"]["prompt_len"]]
    assert single.max_tokens == [sizes["single-stream"]["output_len"]] and single.temperature == 0.0
    for name in ("long-context", "prefill-heavy"):
        w, size = bench.draw_workload(name, device), sizes[name]
        assert len(w.prompts) == size["num_seqs"] and {len(p) for p in w.prompts} == {size["prompt_len"]}
        assert w.max_tokens == [size["output_len"]] * size["num_seqs"] and len(set(map(tuple, w.prompts))) > 1
    shared, size = bench.draw_workload("shared-prefix", device), sizes["shared-prefix"]
    n, p = size["num_suffixes"], size["prefix_len"]
    assert len(shared.prompts) == size["num_prefixes"] * n
    assert {len(q) for q in shared.prompts} == {p + size["suffix_len"]}
    groups = [shared.prompts[i:i + n] for i in range(0, len(shared.prompts), n)]
    assert all(len({tuple(q[:p]) for q in group}) == 1 for group in groups)     # one prefix per group
    assert len({tuple(group[0][:p]) for group in groups}) == size["num_prefixes"]
    assert shared.shared_tokens == ([0] + [p] * (n - 1)) * size["num_prefixes"]
    ours = [single, shared, *(bench.draw_workload(w, device) for w in ("long-context", "prefill-heavy"))]
    assert all(0 <= t < 10000 for w in ours for q in w.prompts for t in q)     # (upstream's draw: <= 10000)
    assert len({tuple(w.prompts[0][:16]) for w in ours}) == len(ours)          # no workload starts like another
    assert bench.draw_workload("shared-prefix", device, seed=1).prompts != shared.prompts


def test_a_shared_prefix_is_counted_once_in_the_floor():
    """Computed once (prefill FLOPs) and read once per decode step (KV bytes)."""
    config = AutoConfig.for_model("qwen3", **QWEN3_0_6B)
    prompt = list(range(100))
    alone = bench.Workload([prompt], [4])
    both = bench.Workload([prompt, prompt + [7]], [4, 4], shared_tokens=[0, 100])
    floor = lambda w: bench.hardware_floor(config, 596_049_920, 2, w, bandwidth=3e12, flops=800e12)
    embedding_head = 2 * config.vocab_size * config.hidden_size          # the second prompt's last-token logits
    suffix_flops = 2 * (596_049_920 - config.vocab_size * config.hidden_size) \
        + 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * (101 * 102 - 100 * 101)
    assert floor(both)["prefill_flops"] == floor(alone)["prefill_flops"] + embedding_head + suffix_flops
    kv_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    # the second request reads its own token and the ones it generates: 4 steps x 1 + (0 + 1 + 2 + 3)
    assert floor(both)["kv_read_bytes"] == floor(alone)["kv_read_bytes"] + kv_token * (4 * 1 + 6)


def test_every_workload_runs_end_to_end_with_a_json_line_each(capsys, checkpoint):
    all_figures = bench.main(["--model", str(checkpoint), "--device", "cpu", "--workload", "all", "--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert lines == json.loads(json.dumps(all_figures))
    assert [f["workload"] for f in lines] == list(bench.WORKLOADS)
    for figures in lines:
        assert 0 < figures["fraction_of_floor"] <= 1 and figures["throughput"] > 0
        assert figures["prompt_and_output_throughput"] == pytest.approx(
            (figures["prompt_tokens"] + figures["total_tokens"]) / figures["time_s"])
    by_name = {f["workload"]: f for f in lines}
    single = by_name["single-stream"]
    assert single["temperature"] == 0.0 and single["ttft_ms"] > 0
    assert single["ms_per_token"] == pytest.approx(single["time_s"] * 1e3 / single["total_tokens"])
    size = bench.WORKLOAD_SIZES["cpu"]["shared-prefix"]
    # every request but the first of its prefix reads the prefix's full blocks from the cache
    full_blocks = size["prefix_len"] // 256 * 256
    assert by_name["shared-prefix"]["prefix_cache_hit_tokens"] == \
        size["num_prefixes"] * (size["num_suffixes"] - 1) * full_blocks


# ---- mixture-of-experts: parameters from the config, and a floor that reads only the experts a step touches

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

COUNTED = [dict(architecture="Qwen3ForCausalLM"),
           dict(architecture="Qwen3ForCausalLM", tie_word_embeddings=True, attention_bias=True),
           dict(architecture="LlamaForCausalLM"),
           dict(architecture="LlamaForCausalLM", attention_bias=True, mlp_bias=True, head_dim=32),
           dict(architecture="Qwen2ForCausalLM", tie_word_embeddings=True),
           dict(architecture="Qwen3MoeForCausalLM", **MOE),
           dict(architecture="Qwen3MoeForCausalLM", **MOE, num_hidden_layers=4, decoder_sparse_step=2,
                mlp_only_layers=[3], attention_bias=True),
           dict(architecture="MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2)]


@pytest.mark.parametrize("shape", COUNTED, ids=["qwen3", "qwen3-tied-bias", "llama", "llama-biases-head-dim",
                                                  "qwen2-tied", "qwen3-moe", "qwen3-moe-dense-layers-bias", "mixtral"])
def test_parameters_counted_from_the_config_match_the_checkpoint(make_checkpoint, shape):
    path = make_checkpoint(**shape)
    config = AutoConfig.from_pretrained(path)
    tied = getattr(config, "tie_word_embeddings", False)
    assert bench.config_parameters(config) == bench.count_parameters(path, tied)
    assert bench.model_parameters(path, config) == bench.count_parameters(path, tied)


def test_a_config_only_checkpoint_is_counted_from_its_config(tmp_path, make_checkpoint):
    shape = dict(architecture="Qwen3MoeForCausalLM", **MOE)
    config_only = write_random_checkpoint(tmp_path / "config-only", weights=False, **shape)
    assert not list(config_only.glob("*.safetensors"))
    with_weights = make_checkpoint(**shape)
    config = AutoConfig.from_pretrained(config_only)
    assert bench.model_parameters(config_only, config) == bench.count_parameters(with_weights, tied=False)


def test_qwen3_30b_a3b_has_its_published_parameter_counts():
    """30.5B parameters in all, 3.3B of them active per token (Qwen3-30B-A3B's model card)."""
    config = AutoConfig.for_model("qwen3_moe", **QWEN3_30B_A3B)
    experts = bench.moe_experts(config)
    assert experts.sparse_layers == tuple(range(48)) and (experts.num_experts, experts.top_k) == (128, 8)
    total = bench.config_parameters(config)
    assert total / 1e9 == pytest.approx(30.5, abs=0.05)
    assert (total - experts.params + experts.active_params) / 1e9 == pytest.approx(3.3, abs=0.1)


def test_sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step():
    def sparse(**shape):
        experts = bench.moe_experts(AutoConfig.for_model("qwen3_moe", hidden_size=64, num_hidden_layers=6, **shape))
        return experts and experts.sparse_layers
    assert sparse(**MOE) == (0, 1, 2, 3, 4, 5)
    assert sparse(**MOE, decoder_sparse_step=2) == (1, 3, 5)
    assert sparse(**MOE, decoder_sparse_step=2, mlp_only_layers=[3]) == (1, 5)
    assert sparse(**MOE, mlp_only_layers=[0, 1, 2, 3, 4, 5]) is None       # every layer dense: a dense model
    assert sparse(**dict(MOE, num_experts=0)) is None
    mixtral = bench.moe_experts(AutoConfig.for_model("mixtral", num_hidden_layers=3, num_local_experts=4,
                                                     intermediate_size=96, hidden_size=64))
    assert mixtral.sparse_layers == (0, 1, 2) and mixtral.params_per_expert == 3 * 64 * 96
    assert bench.moe_experts(AutoConfig.for_model("qwen3", **QWEN3_0_6B)) is None


def test_the_dense_floor_is_unchanged():
    """To the byte and FLOP, the figures the floor gave before it knew of experts."""
    workload = bench.make_workload(256, 1024, 1024, seed=0)
    floor = bench.hardware_floor(AutoConfig.for_model("qwen3", **QWEN3_0_6B), 596_049_920, 2, workload,
                                 bandwidth=3.0e12, flops=800e12)
    assert floor == dict(kv_read_bytes=13870140899328, weight_read_bytes=1220710236160,
                         prefill_flops=137186652258304, bandwidth_gbps=3000.0, peak_tflops=800.0,
                         floor_s=pytest.approx(5.201767027152213, rel=1e-12))
    shared = bench.draw_workload("shared-prefix", "cuda")
    floor = bench.hardware_floor(AutoConfig.for_model("qwen3", **QWEN3_8B), 8_190_735_360, 2, shared,
                                 bandwidth=3.35e12, flops=989e12, kv_itemsize=1)
    assert floor == dict(kv_read_bytes=1227286904832, weight_read_bytes=4193656504320,
                         prefill_flops=479285385363456, bandwidth_gbps=3350.0, peak_tflops=989.0,
                         floor_s=pytest.approx(2.102808225591629, rel=1e-12))


def moe_config(**shape):
    return AutoConfig.for_model("qwen3_moe", **dict(dict(QWEN3_30B_A3B, num_hidden_layers=6), **shape))


@pytest.mark.parametrize("shape", [{}, dict(decoder_sparse_step=2, mlp_only_layers=[3])])
def test_one_request_reads_top_k_experts_per_sparse_layer_each_step(shape):
    config = moe_config(**shape)
    experts, num_params = bench.moe_experts(config), bench.config_parameters(config)
    dense = num_params - experts.params
    workload = bench.Workload([list(range(50))], [7])
    floor = bench.hardware_floor(config, num_params, 2, workload, bandwidth=3e12, flops=800e12)
    expert_bytes = 2 * 7 * len(experts.sparse_layers) * experts.top_k * experts.params_per_expert
    assert floor["expert_read_bytes"] == pytest.approx(expert_bytes, rel=1e-12)
    assert floor["weight_read_bytes"] == pytest.approx(2 * 7 * dense + expert_bytes, rel=1e-12)
    assert floor["experts_touched_fraction"] == pytest.approx(experts.top_k / experts.num_experts, rel=1e-12)
    # prefill computes each token's active parameters: the dense body and k experts per sparse layer
    embedding = config.vocab_size * config.hidden_size
    active = dense + experts.active_params
    attention = 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    assert floor["active_params"] == active and floor["num_params"] == num_params
    assert floor["prefill_flops"] == 2 * (active - 2 * embedding) * 50 + 2 * embedding + attention * 50 * 51


def test_a_huge_batch_reads_every_expert_and_steps_count_their_own_batch():
    config = moe_config()
    experts, num_params = bench.moe_experts(config), bench.config_parameters(config)
    huge = bench.Workload([[0]] * 5000, [3] * 5000)
    floor = bench.hardware_floor(config, num_params, 2, huge, bandwidth=3e12, flops=800e12)
    assert floor["experts_touched_fraction"] == pytest.approx(1, rel=1e-9)
    assert floor["weight_read_bytes"] == pytest.approx(2 * 3 * num_params, rel=1e-9)
    # 3 requests: steps 0-1 run all three, step 2 two of them, steps 3-4 one
    workload = bench.Workload([[0]] * 3, [2, 5, 3])
    floor = bench.hardware_floor(config, num_params, 2, workload, bandwidth=3e12, flops=800e12)
    per_layer = 2 * experts.expected_touched(3) + experts.expected_touched(2) + 2 * experts.expected_touched(1)
    assert experts.expected_touched(1) == pytest.approx(experts.top_k, rel=1e-12)
    assert experts.top_k < experts.expected_touched(2) < 2 * experts.top_k
    assert floor["expert_read_bytes"] == pytest.approx(
        2 * len(experts.sparse_layers) * experts.params_per_expert * per_layer, rel=1e-12)


def test_the_30b_shape_is_config_only_and_runs_dummy(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    path = bench.default_model("cuda", "qwen3-30b-a3b")       # config.json only: writable without a GPU
    assert path == tmp_path / "random-qwen3-30b-a3b" and not list(path.glob("*.safetensors"))
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["Qwen3MoeForCausalLM"] and config.dtype == torch.bfloat16
    assert {k: getattr(config, k) for k in QWEN3_30B_A3B if k != "rope_theta"} == \
        {k: v for k, v in QWEN3_30B_A3B.items() if k != "rope_theta"}
    assert bench.parse_args(["--shape", "qwen3-30b-a3b"]).load_format == "dummy"
    assert bench.parse_args([]).load_format is None                   # the engine's default
    assert bench.parse_args(["--load-format", "dummy"]).load_format == "dummy"
    for argv in (["--shape", "qwen3-30b-a3b", "--load-format", "auto"], ["--engine", "hf", "--shape", "qwen3-30b-a3b"],
                 ["--engine", "hf", "--load-format", "dummy"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    help_text = capsys.readouterr().out
    assert "qwen3-30b-a3b" in bench.__doc__ and "qwen3-30b-a3b" in help_text and "--load-format" in help_text


def test_the_moe_shape_runs_end_to_end_on_cpu(tmp_path, monkeypatch, capsys):
    """On CPU --shape qwen3-30b-a3b is a tiny config-only Qwen3-MoE, its weights drawn by the engine."""
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    figures = run_bench(capsys, ["--shape", "qwen3-30b-a3b", *TINY_RUN, "--bandwidth", "1000", "--peak-tflops", "10"])
    check_consistent(figures)
    assert not list((tmp_path / "random-qwen3-moe-tiny").glob("*.safetensors"))
    config = AutoConfig.from_pretrained(tmp_path / "random-qwen3-moe-tiny")
    assert figures["num_params"] == bench.config_parameters(config)
    assert 0 < figures["expert_read_bytes"] < figures["weight_read_bytes"]
    assert 0 < figures["experts_touched_fraction"] <= 1 and figures["active_params"] < figures["num_params"]


def test_workload_option_takes_one_several_or_all():
    assert bench.workload_names("standard,prefill-heavy") == ("standard", "prefill-heavy")
    assert bench.workload_names("all") == bench.WORKLOADS
    with pytest.raises(argparse.ArgumentTypeError, match="unknown workload 'fast'"):
        bench.workload_names("standard,fast")


def test_the_like_for_like_structured_preset_needs_1024_records():
    """json-records-1024, issue #39's side by side: a document of fewer than 1,024 records does not complete it,
    and the shortest record is 38 characters, so no request of up to 1,024 tokens completes it (no tokenizer's
    tokens average 38 characters) and every engine masks all its steps, whatever it does after completion."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string
    grammar = xgr.Grammar.from_json_schema(json.dumps(bench.STRUCTURED_PRESETS["json-records-1024"]["json"]))
    record = json.dumps({"id": 0, "name": "", "tags": [], "score": 0}, separators=(",", ":"))
    assert len(record) == 38
    assert _is_grammar_accept_string(grammar, "[" + ",".join([record] * 1024) + "]")
    assert not _is_grammar_accept_string(grammar, "[" + ",".join([record] * 1023) + "]")


def test_the_scheduler_simulation_counts_what_a_kv_cache_of_that_size_makes_the_scheduler_do(monkeypatch):
    """benchmarks/simulate_scheduler.py: with room for everything the standard workload's requests all start at
    once, nothing is recomputed, and decode takes the longest output's steps; in a cache too small for them the
    scheduler preempts, and the watermark makes it recompute less."""
    from benchmarks import simulate_scheduler
    from nanovllm.engine import scheduler as scheduler_module
    workload = bench.make_workload(32, 1024, 1024, seed=0)
    roomy = simulate_scheduler.simulate(200_000, 16, num_seqs=32)
    assert roomy["preemptions"] == 0 and roomy["prefill_tokens"] == sum(map(len, workload.prompts))
    assert roomy["decode_steps"] == max(workload.max_tokens) - 1
    tight = {}
    for watermark in (0.0, 0.05):
        monkeypatch.setattr(scheduler_module, "WATERMARK", watermark)
        tight[watermark] = simulate_scheduler.simulate(6_000, 16, num_seqs=32)
    assert tight[0.0]["preemptions"] > tight[0.05]["preemptions"] > 0
    assert tight[0.0]["prefill_tokens"] > tight[0.05]["prefill_tokens"] > roomy["prefill_tokens"]


def test_the_side_by_side_profile_files_both_engines_kernels_where_they_belong():
    """benchmarks/peer_profile.py's per-step table: kernel names of ours and of vLLM 0.26.0 as an H100 profile
    lists them (vLLM's Inductor kernels carry the name of the GEMM whose input they quantize)."""
    from benchmarks.peer_profile import CATEGORIES, ELEMENTWISE, category
    expected = {
        "_decode_kernel": "attention", "_reduce_kernel": "attention",
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<": "attention",
        "void cutlass::device_kernel<flash::FlashAttnFwdCombine<cute::tuple<cute::C<8>, cute::C<128> >": "attention",
        "nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT": "GEMMs (projections, LM head)",
        "void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8<": "GEMMs (projections, LM head)",
        "_skinny_gemm_kernel": "GEMMs (projections, LM head)", "_gemv_kernel": "GEMMs (projections, LM head)",
        "triton_red_fused__to_copy_abs_clamp_cutlass_scaled_mm_div_fused_add_rms_norm_max_mul_reciprocal": ELEMENTWISE,
        "_silu_and_mul_quant_kernel": ELEMENTWISE, "_rotate_qk_kernel": ELEMENTWISE,
        "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16>": ELEMENTWISE,
        "_gate_up_kernel": "MoE experts", "fused_moe_kernel": "MoE experts",
        "_chunk_argmax_kernel": "sampling", "_gumbel_sample_kernel": "sampling",
        "Memcpy HtoD (Pinned -> Device)": "copies and fills", "Memset (Device)": "copies and fills",
    }
    assert {name: category(name) for name in expected} == expected
    assert {category(name) for name in expected} == {name for name, _ in CATEGORIES}


def test_spec_mechanics_verifies_the_drafts_it_makes(checkpoint, capsys, monkeypatch):
    """benchmarks/bench_spec_mechanics.py (issue #40's 8B mechanics): its random and oracle modes verify drafts
    at every step, the oracle's all accepted and its tokens plain decoding's. (The engine asks the proposer
    whether lookup may match before it proposes; a benchmark that replaced `propose` alone measured plain
    decoding in every mode.)"""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_spec_mechanics.py"
    spec = importlib.util.spec_from_file_location("bench_spec_mechanics", path)
    mechanics = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mechanics)
    monkeypatch.setattr("sys.argv", ["bench_spec_mechanics.py", "--model", str(checkpoint), "--device", "cpu",
                                     "--prompt-len", "16", "--max-tokens", "6", "--k", "3",
                                     "--modes", "random,oracle", "--json"])
    mechanics.main()
    runs = {run["mode"]: run for run in map(json.loads, capsys.readouterr().out.strip().splitlines()[-4:])}
    assert set(runs) == {"plain", "random", "oracle", "plain again"}
    assert runs["plain"]["verifications"] == 0 and runs["plain again"]["verifications"] == 0
    assert runs["random"]["verifications"] >= 2 and runs["random"]["draft_tokens"] >= 3
    oracle = runs["oracle"]
    assert oracle["verifications"] >= 1 and oracle["accepted_tokens"] == oracle["draft_tokens"] >= 3
    assert oracle["same_tokens"] and oracle["tokens"] == 6


def test_the_side_by_side_profile_takes_a_small_batch_alone(checkpoint, capsys, monkeypatch):
    """peer_profile.py --profile-only --profile-seqs 2: no timed workload, the profiled steps of the workload's
    first two prompts (on the CPU the table's GPU time is zero; the run and its report are what is checked)."""
    from benchmarks import peer_profile
    monkeypatch.setattr("sys.argv", ["peer_profile.py", str(checkpoint), "--engine", "ours", "--device", "cpu",
                                     "--profile-only", "--profile-seqs", "2", "--rows", "3"])
    peer_profile.main()
    out = capsys.readouterr().out
    assert '"workload": "standard"' not in out                  # the timed run was left out
    assert "2 cached prompts" in out and "decode steps of 2 sequences" in out
    monkeypatch.setattr("sys.argv", ["peer_profile.py", str(checkpoint), "--engine", "ours", "--profile-seqs", "0"])
    with pytest.raises(SystemExit):
        peer_profile.main()
    monkeypatch.setattr("sys.argv", ["peer_profile.py", str(checkpoint), "--engine", "vllm", "--device", "cpu"])
    with pytest.raises(SystemExit):
        peer_profile.main()
