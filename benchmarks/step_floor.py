"""bench.py with every forward pass of the timed run timed on the device, and its decode steps filed by batch
size against their floor: the weights (all but the embedding table) plus the batch's KV cache read once at the
copy rate. Says which batch sizes a workload's decode time goes to and how far each is from what the memory
allows (bench.py's own figures are for the whole run).

    PYTHONPATH=. python benchmarks/step_floor.py --shape qwen3-8b --load-format dummy [--quantization fp8]
    BANDWIDTH=3.0e12 PYTHONPATH=. python benchmarks/step_floor.py ...     # another copy rate (bytes/s)

Every argument goes to bench.py (one --workload at a time: the report is of the last run). A forward pass is
ModelRunner.run_model between two CUDA events (the graph replay or the eager model, logits included; sampling and
the gaps between steps are "the rest"). The KV read of a decode step is the sum of its sequences' lengths; the
copy rate defaults to an H100's measured ~2.99 TB/s.
The weight term counts every parameter: for a mixture of experts, every expert (a bound, not the floor of a step
whose tokens pick a few; bench.py's own floor counts the expected experts).
On a CPU the events are the host's clock (a dry run of the report).
"""
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402
import nanovllm.engine.model_runner as model_runner  # noqa: E402

BANDWIDTH = float(os.environ.get("BANDWIDTH", "2.99e12"))
BUCKET = 32         # decode rows a line of the table


class HostEvent:
    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: "HostEvent") -> float:
        return (other.t - self.t) * 1e3


def new_event():
    return torch.cuda.Event(enable_timing=True) if torch.cuda.is_available() else HostEvent()


class StepTimer:
    """Wraps ModelRunner.run (a decode step's KV length, known on the host) and run_model (the events)."""

    def __init__(self):
        self.records: list[tuple[bool, int, int, int, object, object]] = []
        self.weight_bytes = self.kv_bytes_a_token = 0
        self._context_tokens = 0

    def install(self) -> None:
        run, run_model, timer = model_runner.ModelRunner.run, model_runner.ModelRunner.run_model, self

        def timed_run(runner, seqs, is_prefill, *args, **kwargs):
            timer._context_tokens = 0 if is_prefill else sum(len(seq) for seq in seqs)
            return run(runner, seqs, is_prefill, *args, **kwargs)

        def timed_run_model(runner, input_ids, positions, is_prefill, num_seqs):
            if not timer.weight_bytes:
                timer.measure(runner)
            start, end = new_event(), new_event()
            start.record()
            out = run_model(runner, input_ids, positions, is_prefill, num_seqs)
            end.record()
            timer.records.append((is_prefill, num_seqs, input_ids.numel(), timer._context_tokens, start, end))
            return out

        model_runner.ModelRunner.run, model_runner.ModelRunner.run_model = timed_run, timed_run_model

    def measure(self, runner) -> None:
        hf = runner.config.hf_config
        self.weight_bytes = sum(p.numel() * p.element_size() for name, p in runner.model.named_parameters()
                                if "embed_tokens" not in name)
        element = torch.empty(0, dtype=runner.config.kv_cache_dtype).element_size()    # resolved by Config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.kv_bytes_a_token = hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 2 * element

    def report(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        records = self.records
        span = records[0][4].elapsed_time(records[-1][5])
        prefill_ms = prefill_tokens = busy = 0.0
        buckets: dict[int, list[float]] = {}
        weights_ms = self.weight_bytes / BANDWIDTH * 1e3
        for is_prefill, rows, tokens, context_tokens, start, end in records:
            ms = start.elapsed_time(end)
            busy += ms
            if is_prefill:
                prefill_ms += ms
                prefill_tokens += tokens
                continue
            line = buckets.setdefault(min(rows // BUCKET, 256 // BUCKET - 1), [0, 0.0, 0.0])
            line[0] += 1
            line[1] += ms
            line[2] += context_tokens * self.kv_bytes_a_token / BANDWIDTH * 1e3
        print(f"\nweights read a step {self.weight_bytes / 1e9:.2f} GB ({weights_ms:.2f} ms), KV "
              f"{self.kv_bytes_a_token} B a token, copy rate {BANDWIDTH / 1e12:.2f} TB/s")
        print(f"device span {span / 1e3:.2f} s: forward passes {busy / 1e3:.2f} s (prefill {prefill_ms / 1e3:.2f} s "
              f"for {int(prefill_tokens)} tokens), the rest {(span - busy) / 1e3:.2f} s")
        print("| decode rows | steps | ms a step | floor ms (weights + KV) | % of floor | total s | floor s |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        total = floor = 0.0
        for key in sorted(buckets):
            steps, ms, kv_ms = buckets[key]
            line_floor = steps * weights_ms + kv_ms
            total, floor = total + ms, floor + line_floor
            rows = f"{key * BUCKET}+" if key == 256 // BUCKET - 1 else f"{key * BUCKET}-{key * BUCKET + BUCKET - 1}"
            print(f"| {rows} | {steps} | {ms / steps:.2f} | {line_floor / steps:.2f} ({weights_ms:.2f} + "
                  f"{kv_ms / steps:.2f}) | {100 * line_floor / ms:.1f}% | {ms / 1e3:.2f} | {line_floor / 1e3:.2f} |")
        if total:
            print(f"| all decode | | | | {100 * floor / total:.1f}% | {total / 1e3:.2f} | {floor / 1e3:.2f} |")


def main(argv: list[str] | None = None) -> None:
    timer = StepTimer()
    timer.install()
    run_workload = bench.run_workload

    def timed_workload(*args, **kwargs):
        timer.records.clear()           # the engine's warm-up and graph capture left out
        return run_workload(*args, **kwargs)

    bench.run_workload = timed_workload
    bench.main(argv)
    timer.report()


if __name__ == "__main__":
    main(sys.argv[1:])
