"""Sampling options on bench.py's standard workload, one engine, interleaved runs (each twice):

    python benchmarks/bench_sampling.py [--repeats 2]

temperature 0.6 alone (the standard workload), Qwen3's settings (temperature 0.6, top_p 0.95, top_k 20),
and temperature 0.6 with logprobs=5. Prints one line per run and a table of throughput relative to
temperature alone (the issue's goals: Qwen3's settings >= 97%, logprobs=5 >= 95%).
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

CONFIGS = {"temperature 0.6": dict(temperature=0.6),
           "qwen3 (0.6, top_p 0.95, top_k 20)": dict(temperature=0.6, top_p=0.95, top_k=20),
           "temperature 0.6 + logprobs=5": dict(temperature=0.6, logprobs=5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    own, rest = parser.parse_known_args()
    args = bench.parse_args(rest)
    workload = bench.make_workload(args.num_seqs, args.max_input_len, args.max_output_len, args.seed)
    llm = bench.make_engine(args, args.model or bench.default_model(args.device, args.shape))
    results = {name: [] for name in CONFIGS}
    try:
        for _ in range(own.repeats):
            for name, options in CONFIGS.items():
                result = bench.run_workload(llm, workload, options, desc=name)
                tokens = sum(workload.max_tokens)
                assert result["generated"] == tokens
                results[name].append(tokens / result["time_s"])
                print(json.dumps(dict(config=name, time_s=result["time_s"], throughput=tokens / result["time_s"],
                                      decode_time_s=result["decode_time_s"], prefill_time_s=result["prefill_time_s"])))
    finally:
        llm.exit()
    base = max(results["temperature 0.6"])
    print(f"\n{'config':40s} {'tok/s (each run)':28s} best/best(temperature)")
    for name, rates in results.items():
        print(f"{name:40s} {' '.join(f'{r:9.0f}' for r in rates):28s} {max(rates) / base:.3f}")
    print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")


if __name__ == "__main__":
    main()
