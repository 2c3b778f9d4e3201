"""Where a bench.py run spends its time: per-step wall time for prefill and decode, the host's share
(preparing inputs) and the GPU kernels that dominate, from torch.profiler over a few steps.

    PYTHONPATH=. python benchmarks/profile_engine.py [--model DIR] [--num-seqs 256]
"""
import argparse
import sys
from pathlib import Path
from time import perf_counter

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import MAX_MODEL_LEN, default_model, make_workload  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--profile-steps", type=int, default=20, help="decode steps under the profiler")
    args = parser.parse_args()
    model = args.model or default_model("cuda")
    workload = make_workload(args.num_seqs, 1024, 1024)
    llm = LLM(str(model), max_model_len=MAX_MODEL_LEN)
    llm.generate(["warmup"], SamplingParams(max_tokens=4), use_tqdm=False)
    for prompt, max_tokens in zip(workload.prompts, workload.max_tokens):
        llm.add_request(prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens))
    runner = llm.model_runner
    prepare_s = {"prefill": 0.0, "decode": 0.0}
    real_prefill, real_decode = runner.prepare_prefill, runner.prepare_decode

    def timed(fn, kind):
        def wrapper(seqs):
            t = perf_counter()
            out = fn(seqs)
            prepare_s[kind] += perf_counter() - t
            return out
        return wrapper

    runner.prepare_prefill, runner.prepare_decode = timed(real_prefill, "prefill"), timed(real_decode, "decode")
    steps = {"prefill": [], "decode": []}
    prof = None

    def step() -> None:
        t = perf_counter()
        _, num_tokens = llm.step()
        steps["prefill" if num_tokens > 0 else "decode"].append((perf_counter() - t, abs(num_tokens)))

    while not llm.is_finished():
        if prof is None and len(steps["decode"]) == 100:          # a window of steady-state decode
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.profile_steps):
                    if not llm.is_finished():
                        step()
        else:
            step()
    llm.exit()
    for kind, rows in steps.items():
        total = sum(s for s, _ in rows)
        tokens = sum(n for _, n in rows)
        print(f"{kind}: {len(rows)} steps, {total:.2f}s, {tokens} tokens ({tokens / max(total, 1e-9):.0f} tok/s), "
              f"preparing inputs {prepare_s[kind]:.2f}s ({prepare_s[kind] / max(total, 1e-9):.0%})")
        if rows:
            slowest = sorted(rows, reverse=True)[:3]
            print(f"  slowest steps: {', '.join(f'{s * 1e3:.1f}ms/{n}' for s, n in slowest)}")
    if prof is not None:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
