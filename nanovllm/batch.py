"""Data-parallel batch inference on Ray Data: one LLM per replica, rows streamed through.

    python -m nanovllm.batch MODEL --input IN.jsonl --output OUT.jsonl --replicas 2 --temperature 0

A row has an "id" and one of "prompt" (text), "prompt_token_ids" or "messages" (a chat, through the
chat template), optionally "sampling_params" (a dict over the command line's). Each output row is
{"id", "text", "token_ids", "finish_reason"}, or {"id", "error"} for a row the engine refuses.

Built on the public API only, and nothing in the core imports it: Ray is the optional `ray` extra.
"""
import argparse
import dataclasses
import json
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from nanovllm.config import Config
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.cli_args import add_dataclass_options, dataclass_kwargs

PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")


def _missing(value) -> bool:
    """A field the row does not have: readers fill it with null (Arrow) or NaN (pandas' JSON reader)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _defined(mapping: dict | None) -> dict:
    """A row's dict without the fields filled in for other rows (a struct column has every row's keys)."""
    return {k: v for k, v in (mapping or {}).items() if not _missing(v)} if isinstance(mapping, dict) else {}


class Replica:
    """One engine, in one Ray actor (its tensor-parallel workers inside it). Each call gets a batch of
    rows (a pyarrow Table) and answers every row: a bad row becomes an error row, never a failed batch."""

    def __init__(self, model: str, sampling_params: dict, llm_kwargs: dict):
        from nanovllm import LLM
        self.llm = LLM(model, **llm_kwargs)
        self.sampling_params = sampling_params
        self.name = f"{os.uname().nodename}:{os.getpid()}"

    def _request(self, row: dict) -> tuple[Any, SamplingParams]:
        given = [key for key in PROMPT_KEYS if not _missing(row.get(key))]
        if len(given) != 1:
            raise ValueError(f"a row needs exactly one of {PROMPT_KEYS}, got {given or 'none'}")
        key = given[0]
        prompt = row[key]
        if key == "messages":
            prompt = self.llm.chat_prompt([_defined(message) for message in prompt])
        elif key == "prompt_token_ids":
            prompt = list(prompt)
        elif isinstance(prompt, str) and prompt:    # tokenized once: checked and generated as token ids
            prompt = self.llm.tokenizer.encode(prompt)
        params = SamplingParams(**{**self.sampling_params, **_defined(row.get("sampling_params"))})
        self.llm.check_request(prompt, params)
        return prompt, params

    def __call__(self, batch) -> dict[str, list]:
        rows = batch.to_pylist()
        answers: list[dict] = [{} for _ in rows]
        requests, start = [], time.perf_counter()
        for i, row in enumerate(rows):
            try:
                requests.append((i, *self._request(row)))
            except (ValueError, TypeError, KeyError) as error:
                answers[i] = {"error": f"{type(error).__name__}: {error}"}
        if requests:
            outputs = self.llm.generate([p for _, p, _ in requests], [sp for _, _, sp in requests], use_tqdm=False)
            for (i, _, _), output in zip(requests, outputs):
                answers[i] = {key: output[key] for key in ("text", "token_ids", "finish_reason")}
        columns = {"id": [row.get("id") for row in rows]}
        for key in ("text", "token_ids", "finish_reason", "error"):
            columns[key] = [answer.get(key) for answer in answers]
        columns["replica"] = [self.name] * len(rows)
        # the batch's time in this replica, spread over its rows: summed per replica, its busy time
        columns["engine_seconds"] = [(time.perf_counter() - start) / len(rows)] * len(rows)
        return columns


def generate(dataset, model: str, *, replicas: int = 1, sampling_params: SamplingParams | dict | None = None,
             batch_size: int = 256, **llm_kwargs):
    """Ray Data: `dataset` (rows as above) -> a dataset of answer rows, with a "replica" column naming
    the actor that answered and "engine_seconds" (its batch's time in that actor, spread evenly over
    the batch's rows). `replicas` actors each own an LLM(model, **llm_kwargs) and ask Ray for
    tensor_parallel_size GPUs (CPUs on a CPU machine). A replica that dies costs time, not rows: Ray
    restarts it and retries its batches. device="auto" means GPUs where the cluster has any (the driver's
    own machine may have none)."""
    import ray
    import ray.data

    Config.check_arguments(llm_kwargs)        # here, not in every replica
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    if isinstance(sampling_params, SamplingParams):
        sampling_params = dataclasses.asdict(sampling_params)
    SamplingParams(**(sampling_params or {}))              # refuse bad defaults here, not in every replica
    tp = llm_kwargs.get("tensor_parallel_size", 1)
    device = llm_kwargs.get("device", "auto")
    if device == "auto":
        if not ray.is_initialized():
            ray.init()
        device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    resources = dict(num_gpus=tp) if device == "cuda" else dict(num_cpus=tp)
    return dataset.map_batches(
        Replica, fn_constructor_args=(str(model), sampling_params or {}, llm_kwargs), batch_format="pyarrow",
        batch_size=batch_size,
        # one batch at a time per replica: the first replica up would otherwise take every batch queued
        # before the others have loaded their engines (seen on 2 GPUs: one replica answered all rows)
        compute=ray.data.ActorPoolStrategy(size=replicas, max_tasks_in_flight_per_actor=1),
        max_restarts=-1, max_task_retries=-1, **resources)


# ---- the command line --------------------------------------------------------------------------------
MAX_BLOCKS = 4096
JSON_SUFFIXES = (".jsonl", ".json")


def _count_rows(files: list[Path]) -> int:
    """Rows in Parquet files (from their metadata) or JSONL files (their newlines)."""
    import pyarrow.parquet as pq
    rows = 0
    for f in files:
        if f.suffix == ".parquet":
            rows += pq.ParquetFile(f).metadata.num_rows
        else:
            with open(f, "rb") as lines:
                rows += sum(chunk.count(b"\n") for chunk in iter(lambda: lines.read(1 << 24), b""))
    return rows


def _read(path: Path, batch_size: int):
    """The input as a dataset of about one batch per block. A map task (one block, or small blocks
    bundled up to a batch) runs in one replica: a file read as one block would keep the others idle."""
    import ray.data
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    parquet = [f for f in files if f.suffix == ".parquet"]
    files = parquet or ([f for f in files if f.suffix in JSON_SUFFIXES] if path.is_dir() else files)
    blocks = max(1, min(-(-_count_rows(files) // batch_size), MAX_BLOCKS))
    if parquet:     # Ray reads small Parquet files as one block whatever it is asked: split them after
        return ray.data.read_parquet(str(path)).repartition(blocks)
    extensions = dict(file_extensions=[s.lstrip(".") for s in JSON_SUFFIXES]) if path.is_dir() else {}
    return ray.data.read_json(str(path), lines=True, override_num_blocks=blocks, **extensions)


class _Writer:
    """OUT.jsonl: one JSON object a line ({"id", "error"} for an error row); else a directory that gets
    one Parquet file, written in row groups as the rows come."""

    def __init__(self, path: Path, rows_per_group: int = 1000):
        self.path, self.rows_per_group, self.pending, self.parquet = path, rows_per_group, [], None
        if path.suffix == ".jsonl":
            self.jsonl = open(path, "w")
        else:
            path.mkdir(parents=True, exist_ok=True)
            self.jsonl = None

    def write(self, row: dict) -> None:
        if self.jsonl is not None:
            keys = ("id", "error") if row["error"] is not None else ("id", "text", "token_ids", "finish_reason")
            self.jsonl.write(json.dumps({k: row[k] for k in keys}) + "\n")
            return
        self.pending.append(row)
        if len(self.pending) >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq
        if not self.pending:
            return
        if self.parquet is None:     # the answer columns' types fixed, whatever the first rows hold
            ids = pa.array([row["id"] for row in self.pending])
            schema = pa.schema([("id", ids.type), ("text", pa.string()), ("token_ids", pa.list_(pa.int64())),
                                ("finish_reason", pa.string()), ("error", pa.string())])
        table = pa.Table.from_pylist(self.pending, schema=self.parquet.schema if self.parquet else schema)
        if self.parquet is None:
            self.parquet = pq.ParquetWriter(self.path / "part-0.parquet", table.schema)
        self.parquet.write_table(table)
        self.pending = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.jsonl is not None:
            self.jsonl.close()
        else:
            self._flush()
            if self.parquet is not None:
                self.parquet.close()


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict, dict]:
    """The command line -> (args, the SamplingParams given, the LLM arguments given): options not
    given are left out, so the dataclasses' own defaults hold. Bad values end in argparse's error."""
    parser = argparse.ArgumentParser(prog="python -m nanovllm.batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--input", type=Path, required=True, help="a JSONL file, or a directory of JSONL or Parquet")
    parser.add_argument("--output", type=Path, required=True, help="a .jsonl file, or a directory for Parquet")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--ray-address", help="a running cluster (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--batch-size", type=int, default=256, help="rows per call to a replica")
    add_dataclass_options(parser, SamplingParams, "sampling (any SamplingParams field)")
    add_dataclass_options(parser, Config, "engine (any LLM argument)", skip=("model",))
    args = parser.parse_args(argv)
    if args.replicas < 1 or args.batch_size < 1:
        parser.error("--replicas and --batch-size must be >= 1")
    sampling_params = dataclass_kwargs(args, SamplingParams)
    llm_kwargs = dataclass_kwargs(args, Config, skip=("model",))
    try:
        SamplingParams(**sampling_params)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    return args, sampling_params, llm_kwargs


def main(argv: list[str] | None = None) -> dict:
    args, sampling_params, llm_kwargs = parse_args(argv)
    import ray
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:   # a Ray of its own for this run, counting at least one CPU more than the replicas take (for reads)
        ray.init(address="local", log_to_driver=False,
                 num_cpus=max(os.cpu_count() or 1, args.replicas * llm_kwargs.get("tensor_parallel_size", 1) + 1))
    answers = generate(_read(args.input, args.batch_size), args.model, replicas=args.replicas,
                       sampling_params=sampling_params, batch_size=args.batch_size, **llm_kwargs)
    start, rows, tokens, per_replica, busy, replica_tokens = time.perf_counter(), 0, 0, Counter(), Counter(), Counter()
    with _Writer(args.output) as out:
        for row in answers.iter_rows():      # rows stream through; the dataset never sits in one process
            replica, row_tokens = row.pop("replica"), len(row["token_ids"] or [])
            per_replica[replica] += 1
            busy[replica] += row.pop("engine_seconds")
            replica_tokens[replica] += row_tokens
            out.write(row)
            rows += 1
            tokens += row_tokens
            if rows % 100 == 0:
                elapsed = time.perf_counter() - start
                print(f"{rows} rows, {rows / elapsed:.1f} rows/s, {tokens / elapsed:.0f} tok/s", flush=True)
    elapsed = time.perf_counter() - start
    # the busiest replica's time in its engine: the run's length without start-up and Ray's own overhead
    makespan = max(busy.values(), default=0.0)
    summary = dict(rows=rows, seconds=elapsed, rows_per_s=rows / elapsed, tokens_per_s=tokens / elapsed,
                   per_replica_rows=dict(per_replica), per_replica_engine_seconds=dict(busy),
                   engine_tokens_per_s=tokens / makespan if makespan else 0.0)
    print(f"done: {rows} rows in {elapsed:.1f} s ({rows / elapsed:.1f} rows/s, {tokens / elapsed:.0f} tok/s); "
          f"in the engines: {makespan:.1f} s for the busiest replica ({summary['engine_tokens_per_s']:.0f} tok/s)")
    for replica, count in sorted(per_replica.items()):
        print(f"  replica {replica}: {count} rows, {count / elapsed:.1f} rows/s; {busy[replica]:.1f} s in its "
              f"engine, {replica_tokens[replica] / max(busy[replica], 1e-9):.0f} tok/s there")
    return summary


if __name__ == "__main__":
    main()
