"""Sampling options on bench.py's standard workload, one engine, interleaved runs (each twice):

    python benchmarks/bench_sampling.py [--repeats 2] [--configs all|base] [bench.py options]

Runs every setting a request can ask for (temperature alone, greedy, Qwen3's filters, min_p, log-probs,
penalties, seeds, n) in turn, `--repeats` times, and prints one line per run and a table: each setting's
throughput relative to temperature alone, and its first run against its second (a first run that pays
for compilation the engine's warm-up missed shows as < 1; the goal is >= 0.97). Every Triton
compilation during a run is counted and named, so a stall points at its kernel. Each run draws fresh
token ids (same lengths), so no run finds another's prompts in the prefix cache.
"""
import argparse
import dataclasses
import json
import random
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

BASE = {"temperature 0.6": dict(temperature=0.6),
        "qwen3 (0.6, top_p 0.95, top_k 20)": dict(temperature=0.6, top_p=0.95, top_k=20),
        "temperature 0.6 + logprobs=5": dict(temperature=0.6, logprobs=5)}
MORE = {"greedy": dict(temperature=0.0),
        "min_p 0.05": dict(temperature=0.6, min_p=0.05),
        "penalties (rep 1.1, presence 0.5, frequency 0.5)": dict(temperature=0.6, repetition_penalty=1.1,
                                                                  presence_penalty=0.5, frequency_penalty=0.5),
        "seed": dict(temperature=0.6, seed=1234),
        "n=2": dict(temperature=0.6, n=2)}


class CompileLog:
    """Names every Triton kernel specialization compiled (or loaded) while it is on."""

    def __init__(self):
        self.names: Counter = Counter()
        import triton
        self.knobs = triton.knobs.runtime
        self.knobs.jit_cache_hook = self._hook

    def _hook(self, *, fn, **_):
        self.names[fn.name] += 1
        return False        # never skip the compilation: only watch it

    def take(self) -> dict:
        names, self.names = dict(self.names), Counter()
        return names


def fresh_prompts(workload: bench.Workload, seed: int) -> bench.Workload:
    """The same lengths with other token ids (uniform in [0, 10000), as bench.py draws them)."""
    rng = random.Random(seed)
    return dataclasses.replace(workload, prompts=[[rng.randrange(10000) for _ in p] for p in workload.prompts])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--configs", choices=("all", "base"), default="all")
    own, rest = parser.parse_known_args()
    args = bench.parse_args(rest)
    configs = {**BASE, **MORE} if own.configs == "all" else BASE
    workload = bench.make_workload(args.num_seqs, args.max_input_len, args.max_output_len, args.seed)
    log = CompileLog()
    llm = bench.make_engine(args, args.model or bench.default_model(args.device, args.shape))
    print(json.dumps(dict(compiled_at_start=sum(log.take().values()))))
    results = {name: [] for name in configs}
    try:
        for repeat in range(own.repeats):
            for i, (name, options) in enumerate(configs.items()):
                run = fresh_prompts(workload, 1000 * repeat + i)
                result = bench.run_workload(llm, run, options, desc=name)
                tokens = sum(workload.max_tokens) * options.get("n", 1)
                assert result["generated"] == tokens
                results[name].append(tokens / result["time_s"])
                print(json.dumps(dict(config=name, time_s=result["time_s"], throughput=tokens / result["time_s"],
                                      decode_time_s=result["decode_time_s"], prefill_time_s=result["prefill_time_s"],
                                      compiled=log.take())))
    finally:
        llm.exit()
    base = max(results["temperature 0.6"])
    print(f"\n{'config':50s} {'tok/s (each run)':30s} {'best/temp':>9s} {'1st/2nd':>8s}")
    for name, rates in results.items():
        first = f"{rates[0] / rates[1]:.3f}" if len(rates) > 1 else "-"
        print(f"{name:50s} {' '.join(f'{r:9.0f}' for r in rates):30s} {max(rates) / base:9.3f} {first:>8s}")
    print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, "
          f"kv cache: {args.kv_cache_dtype}")


if __name__ == "__main__":
    main()
