"""bench.py on CPU: the workload is upstream's draw, the floor matches DESIGN.md's worked numbers, and a
tiny end-to-end run of each engine reports consistent figures."""
import importlib.util
import json
import random
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from nanovllm.utils.random_checkpoint import QWEN3_0_6B, write_random_checkpoint

_spec = importlib.util.spec_from_file_location("bench", Path(__file__).resolve().parents[1] / "bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY_RUN = ["--num-seqs", "4", "--max-input-len", "32", "--max-output-len", "8", "--seed", "3", "--json"]


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
    assert sum(workload.max_tokens) == 133_966          # DESIGN.md's output token count
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
    all_figures = bench.main(["--model", str(checkpoint), "--workload", "all", "--json"])
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
