"""Sampling options on bench.py's standard workload, one engine, interleaved runs (each twice):

    python benchmarks/bench_sampling.py [--repeats 2] [--configs all|base] [bench.py options]
    python benchmarks/bench_sampling.py --time-penalties [--penalty-rows 256] [--penalty-vocab 151936]

Runs every setting a request can ask for (temperature alone, greedy, Qwen3's filters, min_p, log-probs,
penalties, seeds, n) in turn, `--repeats` times, and prints one line per run and a table: each setting's
throughput relative to temperature alone, and its first run against its second (a first run that pays
for compilation the engine's warm-up missed shows as < 1; the goal is >= 0.97). Every Triton
compilation during a run is counted and named, so a stall points at its kernel. Each run draws fresh
token ids (same lengths), so no run finds another's prompts in the prefix cache.

--time-penalties times one decode step's penalty work alone on the GPU (no engine): rows x vocab
bfloat16 logits, every row penalized (repetition 1.1, frequency 0.5, presence 0.5) from state tables
twice as tall as the batch, state rows shuffled; the old path (gather the rows' prompt flags and counts,
torch's elementwise ops, index_put_ for the counts) against the Triton kernels (nanovllm.kernels.penalties),
with the kernel's block size swept. It checks first that both paths give the same logits and counts.
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


def cuda_time_us(fn, iters: int = 50) -> float:
    """Mean time of fn() on the GPU, in microseconds, after a few warm-up calls."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def time_penalties(rows: int, vocab: int) -> None:
    if not torch.cuda.is_available():
        sys.exit("--time-penalties times CUDA kernels: no GPU here, nothing timed")
    from nanovllm.kernels import penalties as penalty_kernels
    from nanovllm.layers.logits_processor import apply_penalties as torch_penalties
    device = torch.device("cuda")
    torch.manual_seed(0)
    states = 2 * rows
    prompt_mask = torch.rand(states, vocab, device=device) < 1000 / vocab       # ~1000-token prompts
    counts = torch.randint(1, 4, (states, vocab), dtype=torch.int32, device=device)
    counts *= (torch.rand(states, vocab, device=device) < 300 / vocab).to(torch.int32)     # ~300 outputs
    state_rows = torch.randperm(states, device=device)[:rows]
    batch_rows = torch.arange(rows, device=device)
    weights = [torch.full((rows,), w, device=device) for w in (1.1, 0.5, 0.5)]
    logits = (torch.randn(rows, vocab, device=device) * 3).to(torch.bfloat16)
    tokens = torch.randint(0, vocab, (rows,), device=device)

    def old(x, c):
        torch_penalties(x, batch_rows, state_rows, prompt_mask, c, *weights)     # gathers the rows, then torch ops
        c.index_put_((state_rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def new(x, c, block=1024):
        penalty_kernels.apply_penalties(x, batch_rows, state_rows, prompt_mask, c, *weights, block=block)
        penalty_kernels.count_tokens(c, state_rows, tokens)

    results = [(fn, logits.clone(), counts.clone()) for fn in (old, new)]
    for fn, x, c in results:
        fn(x, c)
    same = all(torch.equal(a, b) for a, b in zip(results[0][1:], results[1][1:]))
    print(json.dumps(dict(rows=rows, vocab=vocab, logits="bfloat16", same_logits_and_counts=same)))
    x, c = logits.clone(), counts.clone()       # edited in place on every call: the timing does not care
    bytes_moved = rows * vocab * (2 + 2 + 1 + 4)    # logits read and written, prompt flags, counts
    report = {"old: gather + torch ops": cuda_time_us(lambda: torch_penalties(x, batch_rows, state_rows, prompt_mask,
                                                                              c, *weights)),
              "old: index_put_ count": cuda_time_us(lambda: c.index_put_(
                  (state_rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)),
              "old: both": cuda_time_us(lambda: old(x, c))}
    for block in (512, 1024, 2048, 4096):
        report[f"kernel: penalties, block {block}"] = cuda_time_us(lambda: penalty_kernels.apply_penalties(
            x, batch_rows, state_rows, prompt_mask, c, *weights, block=block))
    report["kernel: count"] = cuda_time_us(lambda: penalty_kernels.count_tokens(c, state_rows, tokens))
    report["kernel: both (block 1024)"] = cuda_time_us(lambda: new(x, c))
    for name, us in report.items():
        extra = f"{bytes_moved / us / 1e3:8.0f} GB/s" if name.startswith("kernel: penalties") else ""
        print(f"{name:36s} {us:9.1f} us  {extra}")
    print(f"old / new: {report['old: both'] / report['kernel: both (block 1024)']:.1f}x; "
          f"device: {torch.cuda.get_device_name()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--configs", choices=("all", "base"), default="all")
    parser.add_argument("--time-penalties", action="store_true",
                        help="time the penalty kernels against the old torch path alone, then exit")
    parser.add_argument("--penalty-rows", type=int, default=256)
    parser.add_argument("--penalty-vocab", type=int, default=151936)
    own, rest = parser.parse_known_args()
    if own.time_penalties:
        time_penalties(own.penalty_rows, own.penalty_vocab)
        return
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
