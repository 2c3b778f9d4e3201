"""Where a bench.py run spends its time: per-step wall time for prefill and decode, the host's share
(preparing inputs; waiting for the device, which is ~0 when the host is the slower side), and, over a window of steady-state decode steps under torch.profiler, how much of
each step the GPU is busy, the kernels that dominate, and the all-reduce (NCCL) time per step.

    PYTHONPATH=. python benchmarks/profile_engine.py [--model DIR | --shape qwen3-8b] [--tensor-parallel-size N]
        [--workload standard|long-context|prefill-heavy|shared-prefix|single-stream] [--window decode|prefill]
"""
import argparse
import sys
from pathlib import Path
from time import perf_counter

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import (MAX_MODEL_LEN, RANDOM_SHAPES, WORKLOAD_MAX_MODEL_LEN, WORKLOADS,  # noqa: E402
                   default_model, draw_workload)
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.sampled_tokens import SampledTokens  # noqa: E402


def kernel_summary(prof, kind: str, num_steps: int, wall_s: float) -> None:
    """GPU-busy time per step (sum of kernel and memcpy times; they do not overlap on one stream). Only
    device-side events count: a CPU op's device time is its kernels' again."""
    events = [e for e in prof.key_averages() if e.device_type != DeviceType.CPU and e.self_device_time_total > 0]
    busy_us = sum(e.self_device_time_total for e in events)
    # NCCL's own kernels (the profiler also files their time under CPU-side records such as nccl:gather);
    # a collective's kernel time includes waiting for the slowest rank to arrive
    nccl = [e for e in events if e.key.startswith("ncclDevKernel")]
    one_shot = [e for e in events if e.key == "_one_shot_kernel"]     # ours, over peer memory (also waits)
    allreduce_us = sum(e.self_device_time_total for e in [*one_shot, *(e for e in nccl if "AllReduce" in e.key)])
    other_us = sum(e.self_device_time_total for e in nccl if "AllReduce" not in e.key)
    launches = sum(e.count for e in events)
    print(f"profiled window: {num_steps} {kind} steps, wall {wall_s / num_steps * 1e3:.2f} ms/step, "
          f"GPU busy {busy_us / num_steps / 1e3:.2f} ms/step ({busy_us / 1e6 / wall_s:.0%}), "
          f"{launches / num_steps:.0f} kernels/step, all-reduce {allreduce_us / num_steps / 1e3:.3f} ms/step, "
          f"other collectives (logits gather) {other_us / num_steps / 1e3:.3f} ms/step")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--shape", choices=RANDOM_SHAPES, default="qwen3-0.6b")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--num-seqs", type=int, default=256, help="the standard workload's request count")
    parser.add_argument("--workload", choices=WORKLOADS, default="standard", help="bench.py's draw of that name")
    parser.add_argument("--window", choices=("decode", "prefill"), default="decode",
                        help="the kind of steps profiled: after 100 decode steps, or after the first 2 prefill steps")
    parser.add_argument("--profile-steps", type=int, default=20, help="steps of that kind under the profiler")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="every request's (1.1: penalties' cost)")
    parser.add_argument("--quantization", choices=("fp8",), default=None)
    parser.add_argument("--disable-custom-all-reduce", action="store_true", help="NCCL for every all-reduce")
    parser.add_argument("--window-only", action="store_true", help="stop after the profiled window (the per-run "
                        "totals then cover only the steps so far)")
    args = parser.parse_args()
    model = args.model or default_model("cuda", args.shape)
    workload = draw_workload(args.workload, "cuda", num_seqs=args.num_seqs, max_input_len=1024, max_output_len=1024)
    max_model_len = MAX_MODEL_LEN if args.workload == "standard" else WORKLOAD_MAX_MODEL_LEN
    # config-only checkpoints (the 30B-A3B shape, or --model a directory without weights): dummy weights
    load_format = "auto" if any(Path(model).glob("*.safetensors")) else "dummy"
    llm = LLM(str(model), max_model_len=max_model_len, tensor_parallel_size=args.tensor_parallel_size,
              enforce_eager=args.enforce_eager, disable_custom_all_reduce=args.disable_custom_all_reduce,
              load_format=load_format, quantization=args.quantization)
    temperature = 0.6 if workload.temperature is None else workload.temperature
    llm.generate(["warmup"], SamplingParams(max_tokens=4), use_tqdm=False)
    for prompt, max_tokens in zip(workload.prompts, workload.max_tokens):
        llm.add_request(prompt, SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=max_tokens,
                                                   repetition_penalty=args.repetition_penalty))
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
    # the engine launches step t+1 before it waits for step t's tokens: the time spent waiting is the
    # host idling on the device; the rest of a step's wall time is host work (scheduling, preparing
    # inputs, launching, postprocessing), which the device overlaps unless it is the longer of the two
    waited_s = {"prefill": 0.0, "decode": 0.0}
    real_tolist = SampledTokens.tolist
    kind_of_step = ["prefill"]

    def tolist(self):
        t = perf_counter()
        out = real_tolist(self)
        waited_s[kind_of_step[0]] += perf_counter() - t
        return out

    SampledTokens.tolist = tolist
    steps = {"prefill": [], "decode": []}
    prof, window_s, window_steps = None, 0.0, 0
    steps_before_window = 100 if args.window == "decode" else 2    # steady state, past the first compiles

    def step() -> str:
        t = perf_counter()
        _, num_tokens = llm.step()
        kind_of_step[0] = "prefill" if num_tokens > 0 else "decode"    # waits in the next step are for this one
        steps[kind_of_step[0]].append((perf_counter() - t, abs(num_tokens)))
        return kind_of_step[0]

    while not llm.is_finished():
        if prof is None and len(steps[args.window]) >= steps_before_window:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t = perf_counter()
                while window_steps < args.profile_steps and not llm.is_finished():
                    if step() == args.window:    # steps of the other kind in between are profiled too
                        window_steps += 1
                window_s = perf_counter() - t
            if args.window_only:
                break
        else:
            step()
    llm.exit()
    for kind, rows in steps.items():
        total = sum(s for s, _ in rows)
        tokens = sum(n for _, n in rows)
        print(f"{kind}: {len(rows)} steps, {total:.2f}s, {tokens} tokens ({tokens / max(total, 1e-9):.0f} tok/s), "
              f"preparing inputs {prepare_s[kind]:.2f}s ({prepare_s[kind] / max(total, 1e-9):.0%}), "
              f"host waiting for the device {waited_s[kind]:.2f}s ({waited_s[kind] / max(total, 1e-9):.0%})")
        if rows:
            slowest = sorted(rows, reverse=True)[:3]
            print(f"  slowest steps: {', '.join(f'{s * 1e3:.1f}ms/{n}' for s, n in slowest)}")
    if prof is not None and window_steps:
        kernel_summary(prof, args.window, window_steps, window_s)


if __name__ == "__main__":
    main()
