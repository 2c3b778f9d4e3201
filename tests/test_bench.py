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
