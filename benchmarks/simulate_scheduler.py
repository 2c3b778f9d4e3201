"""The scheduler alone on bench.py's standard workload in a KV cache of a given size: how many preemptions, how
many tokens prefilled (recomputation included), how many prefill and decode steps, and the mean decode batch. No
model runs (every sampled token is 7, every request ignores eos), so a run takes seconds on any machine, and a
scheduling policy or a KV page size can be judged before a GPU confirms it. For a mixture-of-experts model whose
decode step reads nearly every expert whatever its batch (Qwen3-30B-A3B above ~40 sequences), the decode steps
are most of the run's time, and a prefill step of a few recomputed sequences costs about one of them.

    PYTHONPATH=. python benchmarks/simulate_scheduler.py [--kv-tokens 128000] [--block-size 256,32]
        [--watermark 0,0.01]

128,000 tokens: what one H100 holds for Qwen3-30B-A3B in bf16 (bench.py's KV line).
"""
import argparse
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import make_workload  # noqa: E402
from nanovllm.engine import scheduler as scheduler_module  # noqa: E402
from nanovllm.engine.scheduler import Scheduler  # noqa: E402
from nanovllm.engine.sequence import Sequence  # noqa: E402
from nanovllm.sampling_params import SamplingParams  # noqa: E402


def simulate(kv_tokens: int, block_size: int, num_seqs: int = 256, max_num_seqs: int = 512,
             max_num_batched_tokens: int = 16384) -> dict:
    """One run of the standard workload's requests through a Scheduler of kv_tokens // block_size blocks."""
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=16384, eos_token_ids=frozenset({-2}), kvcache_block_size=block_size,
                             enable_prefix_caching=True, speculative_config=None)
    scheduler = Scheduler(config, kv_tokens // block_size)
    workload = make_workload(num_seqs, 1024, 1024, seed=0)
    for prompt, max_tokens in zip(workload.prompts, workload.max_tokens):
        scheduler.add(Sequence(prompt, SamplingParams(ignore_eos=True, max_tokens=max_tokens), block_size))
    prefill_steps = decode_steps = prefill_tokens = decoded = 0
    while not scheduler.is_finished():
        seqs, is_prefill = scheduler.schedule()
        if is_prefill:
            prefill_steps += 1
            prefill_tokens += sum(seq.num_scheduled_tokens for seq in seqs)
        elif seqs:
            decode_steps += 1
            decoded += len(seqs)
        scheduler.postprocess(scheduler.launched(seqs), [7] * len(seqs))
    return dict(preemptions=scheduler.num_preemptions, prefill_tokens=prefill_tokens, prefill_steps=prefill_steps,
                decode_steps=decode_steps, mean_decode_batch=decoded / max(decode_steps, 1),
                prefix_hit_tokens=scheduler.num_hit_tokens)


def main() -> None:
    logging.getLogger(scheduler_module.__name__).setLevel(logging.ERROR)   # the first preemption's hint, every run
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-tokens", type=int, default=128_000)
    parser.add_argument("--block-size", default="256,32", help="comma-separated KV page sizes")
    parser.add_argument("--watermark", default=f"0,{scheduler_module.WATERMARK}",
                        help="comma-separated fractions of the blocks kept free when a waiting sequence starts")
    parser.add_argument("--num-seqs", type=int, default=256)
    args = parser.parse_args()
    print(f"{'page':>5} {'watermark':>9} {'preempt':>8} {'prefill tok':>12} {'prefill steps':>13} "
          f"{'decode steps':>12} {'mean batch':>10}")
    for block_size in map(int, args.block_size.split(",")):
        for watermark in map(float, args.watermark.split(",")):
            scheduler_module.WATERMARK = watermark
            r = simulate(args.kv_tokens, block_size, args.num_seqs)
            print(f"{block_size:5d} {watermark:9.3f} {r['preemptions']:8d} {r['prefill_tokens']:12,d} "
                  f"{r['prefill_steps']:13d} {r['decode_steps']:12d} {r['mean_decode_batch']:10.1f}")


if __name__ == "__main__":
    main()
