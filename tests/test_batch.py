"""Batch inference on Ray Data (nanovllm.batch): a local two-node cluster with two CPU replicas answers
every row as one in-process LLM would, bad rows become error rows, per-row sampling params hold, and a
replica killed mid-run costs no row."""
import json
import os
import signal
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")
import ray.data  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm import batch  # noqa: E402
from nanovllm.utils.gguf_checkpoint import default_model  # noqa: E402

pytestmark = [pytest.mark.timeout(600),  # Ray and replica processes: a regression must fail, not hang
              pytest.mark.cpu_only]      # every engine is device="cpu" (the Ray replicas take CPUs)

ENGINE = dict(device="cpu", max_model_len=256, enforce_eager=True)
DEFAULTS = dict(temperature=0.0, max_tokens=6)
ROWS = [{"id": 0, "prompt": "The capital of France is"},
        {"id": 1, "prompt_token_ids": [504, 3458, 282, 4649, 314]},
        {"id": 2, "messages": [{"role": "user", "content": "Name a color."}]},
        {"id": 3, "prompt": "One, two, three,", "sampling_params": {"max_tokens": 3}},
        {"id": 4, "prompt": ""},                                        # empty
        {"id": 5, "prompt_token_ids": [1, 10 ** 9]},                    # outside the vocabulary
        {"id": 6, "prompt": "word " * 400},                             # longer than max_model_len
        {"id": 7, "prompt": "Tell me a story", "sampling_params": {"temperature": 0.8, "seed": 3, "max_tokens": 5}}]
ROWS += [{"id": 8 + i, "prompt": f"Fact number {i}:"} for i in range(8)]


@pytest.fixture(scope="module")
def model():
    return str(default_model())


@pytest.fixture(scope="module")
def cluster():
    """Two nodes on this machine (logical CPUs: the replicas and the readers need room)."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def expected(model):
    """What one in-process LLM answers, row by row (None: the row must become an error row)."""
    answers = {}
    with LLM(model, **ENGINE) as llm:
        for row in ROWS:
            params = SamplingParams(**{**DEFAULTS, **row.get("sampling_params", {})})
            prompt = row.get("prompt", row.get("prompt_token_ids"))
            if "messages" in row:
                prompt = llm.chat_prompt(row["messages"])
            try:
                llm.check_request(prompt, params)
            except ValueError:
                answers[row["id"]] = None
                continue
            [out] = llm.generate([prompt], params, use_tqdm=False)
            answers[row["id"]] = (out["text"], out["token_ids"], out["finish_reason"])
    return answers


def run(model, rows, **kwargs):
    dataset = ray.data.from_items(rows, override_num_blocks=8)
    return batch.generate(dataset, model, replicas=2, sampling_params=DEFAULTS, batch_size=2, **ENGINE,
                          **kwargs)


def check(answers, expected):
    assert sorted(a["id"] for a in answers) == [row["id"] for row in ROWS]      # every row exactly once
    for answer in answers:
        want = expected[answer["id"]]
        if want is None:
            assert answer["error"] and answer["text"] is None, answer
        else:
            assert answer["error"] is None and (answer["text"], answer["token_ids"], answer["finish_reason"]) == want


def test_two_replicas_on_two_nodes_answer_as_one_llm(cluster, model, expected):
    answers = run(model, ROWS).take_all()
    check(answers, expected)
    assert len({a["replica"] for a in answers}) == 2                 # both replicas took batches
    assert all(a["engine_seconds"] > 0 for a in answers)             # each batch's time in its replica
    assert expected[3] is not None and len(expected[3][1]) == 3      # the row's own max_tokens
    assert sum(v is None for v in expected.values()) == 3           # empty, bad token id, too long


def test_a_replica_killed_mid_run_costs_no_row(cluster, model, expected):
    answers = []
    killed = False
    for answer in run(model, ROWS).iter_rows():
        answers.append(answer)
        if not killed:                   # the first answer is in: kill the replica that gave it
            os.kill(int(answer["replica"].rsplit(":", 1)[1]), signal.SIGKILL)
            killed = True
    check(answers, expected)


def test_the_command_line_writes_one_jsonl_row_per_input_row(model, expected, tmp_path):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(batch.__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "nanovllm.batch", model, "--input", str(source),
                             "--output", str(target), "--replicas", "2", "--batch-size", "2",
                             "--temperature", "0", "--max-tokens", "6", "--device", "cpu",
                             "--max-model-len", "256", "--enforce-eager"],
                            capture_output=True, text=True, timeout=400, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [row["id"] for row in ROWS]
    for row in rows:
        want = expected[row["id"]]
        if want is None:
            assert set(row) == {"id", "error"}
        else:
            assert set(row) == {"id", "text", "token_ids", "finish_reason"}
            assert (row["text"], row["token_ids"], row["finish_reason"]) == want
    assert "done: 16 rows" in result.stdout and "in the engines:" in result.stdout
    assert result.stdout.count("  replica ") == 2       # one file, read in blocks that both replicas took


@pytest.mark.parametrize("form", ["jsonl file", "parquet directory"])
def test_the_command_line_reads_about_one_block_per_batch(cluster, tmp_path, form):
    """A replica takes whole blocks: an input read as fewer blocks than batches would idle the others."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"id": i, "prompt": f"row {i}"} for i in range(15)]
    if form == "jsonl file":
        path = tmp_path / "in.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        path = tmp_path / "in"
        path.mkdir()
        pq.write_table(pa.Table.from_pylist(rows[:10]), path / "a.parquet")
        pq.write_table(pa.Table.from_pylist(rows[10:]), path / "b.parquet")
    dataset = batch._read(path, batch_size=4)
    blocks = [list(b["id"]) for b in dataset.iter_batches(batch_size=None)]     # one pass: Ray re-reads for each
    assert len(blocks) == 4 and max(map(len, blocks)) <= 4, blocks
    assert sorted(i for block in blocks for i in block) == list(range(15))


def test_a_parquet_output_keeps_its_column_types_whatever_rows_come_first(tmp_path):
    import pyarrow.parquet as pq
    rows = [{"id": 1, "text": None, "token_ids": None, "finish_reason": None, "error": "ValueError: empty"},
            {"id": 2, "text": "hi", "token_ids": [5, 6], "finish_reason": "length", "error": None}]
    with batch._Writer(tmp_path / "out", rows_per_group=1) as out:
        for row in rows:
            out.write(dict(row))
    assert pq.read_table(tmp_path / "out").to_pylist() == rows


# ---- the command line's options (parsed only: no Ray, no model) -------------------------------------
BASE = ["MODEL", "--input", "in.jsonl", "--output", "out.jsonl"]


def test_boolean_options_are_bare_flags():
    _, sampling, engine = batch.parse_args(BASE + ["--ignore-eos", "--no-skip-special-tokens", "--enforce-eager",
                                                   "--no-enable-prefix-caching", "--include-stop-str-in-output",
                                                   "--disable-custom-all-reduce"])
    assert sampling == {"ignore_eos": True, "skip_special_tokens": False, "include_stop_str_in_output": True}
    assert engine == {"enforce_eager": True, "enable_prefix_caching": False, "disable_custom_all_reduce": True}
    _, sampling, engine = batch.parse_args(BASE + ["--skip-special-tokens", "--no-ignore-eos"])
    assert sampling == {"skip_special_tokens": True, "ignore_eos": False} and engine == {}


def test_only_the_options_given_are_passed_on_typed():
    args, sampling, engine = batch.parse_args(BASE + ["--temperature", "0", "--max-tokens", "6", "--stop", "\n",
                                                      "--stop-token-ids", "[2, 3]", "--dtype", "bfloat16",
                                                      "--gpu-memory-utilization", "0.5", "--replicas", "2"])
    assert sampling == {"temperature": 0.0, "max_tokens": 6, "stop": "\n", "stop_token_ids": [2, 3]}
    assert engine == {"dtype": "bfloat16", "gpu_memory_utilization": 0.5}
    assert (args.model, args.replicas, args.batch_size) == ("MODEL", 2, 256)
    assert batch.parse_args(BASE + ["--stop", '["a", "b"]'])[1] == {"stop": ["a", "b"]}


def test_help_shows_boolean_options_as_flags(capsys):
    with pytest.raises(SystemExit):
        batch.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())       # help wraps lines where it likes
    assert "--ignore-eos, --no-ignore-eos" in text and "[--ignore-eos | --no-ignore-eos]" in text
    assert "--enable-prefix-caching, --no-enable-prefix-caching (default: True)" in text
    assert "--max-model-len INT" in text and "--ignore-eos VALUE" not in text


@pytest.mark.parametrize("extra", [["--max-tokens", "six"], ["--temperature", "hot"], ["--ignore-eos", "true"],
                                   ["--max-tokens", "0"], ["--no-such-option"]])
def test_a_bad_option_is_argparses_error(extra, capsys):
    with pytest.raises(SystemExit) as exit_:
        batch.parse_args(BASE + extra)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err
