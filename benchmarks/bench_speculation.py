"""Speculative decoding where it pays: one stream of a real model asked to repeat or lightly edit a passage in
its prompt (issue #40's lookup workload), without speculation and with each configuration given.

    python benchmarks/bench_speculation.py                                    # the default model, n-gram k=31
    python benchmarks/bench_speculation.py --device cpu --max-tokens 80
    python benchmarks/bench_speculation.py --spec '{"method": "ngram", "num_speculative_tokens": 4}' \\
        --spec '{"method": "draft_model", "model": "DRAFT_DIR", "num_speculative_tokens": 4}'

Each request runs alone (greedy, one at a time, after a warm-up request of the same kind on another passage,
so that no path the timed requests take compiles inside them), so the figure is one stream's tokens a second:
of the median of --repeat passes over the conversations (the counts are a pass's). Ours keeps every
configuration's engine (no speculation among them) alive in one process and takes their passes in turn, so
that the ratios are of passes side by side: a lone small model's step is host work, which drifts by tens of
percent between processes.

    VLLM_SITE=/tmp/vllm-site; PYTHONPATH=$VLLM_SITE python benchmarks/bench_speculation.py --engine vllm \
        --dtype bfloat16 --spec '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, \
        "prompt_lookup_min": 2}'      # vLLM on the same conversations (../shared/peer/ stages it on a GPU)

--engine vllm runs vLLM's LLM.chat on the same checkpoint and conversations with the same speculative_config
(its keys are vLLM's), each configuration's engine in a spawned process of its own (vLLM's engine core in a
process of its own beneath it, as by default), with its acceptance from LLM.get_metrics(). --dtype sets both
engines' dtype (vLLM's "auto" runs a float32 checkpoint, as the default SmolLM2 is converted, in bfloat16 on a
GPU; ours keeps it). Printed per configuration: tokens/s, ms/token, its speed-up over no speculation, drafts
accepted of those proposed, the mean tokens a verification step gained, and how many completions equal the
plain run's text (all of them on a CPU in float32; on a GPU in bf16 a near tie may go either way). --json
prints one JSON object per configuration.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm import LLM, SamplingParams  # noqa: E402

PASSAGES = [
    "Paged attention stores the key and value cache in fixed-size blocks, so memory is allocated on demand and "
    "shared between requests that start with the same prompt. A scheduler decides each step which requests run, "
    "and preempts the newest when the cache runs out.",
    "The quick brown fox jumps over the lazy dog. The dog, unimpressed, goes back to sleep, while the fox trots "
    "off to look for something more interesting to jump over before the sun goes down.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "for i in range(10):\n    print(i, fibonacci(i))\n",
    "Speculative decoding drafts several tokens cheaply and lets the large model check them all in one step; "
    "every token it accepts is a step saved, and the output is exactly what the large model alone would write.",
]
ASKS = ["Repeat this passage word for word:\n\n{}",
        "Rewrite this passage, changing only its first sentence:\n\n{}",
        "Copy the following text exactly:\n\n{}"]


def conversations() -> list[list[dict]]:
    return [[{"role": "user", "content": ask.format(passage)}] for passage in PASSAGES for ask in ASKS]


WARM_UP = [{"role": "user", "content": ASKS[0].format(
    "A warm-up passage, not timed: it takes the engine through drafting and verification once, with as many "
    "tokens as the timed requests, so that the figures are steady-state ones.")}]
STATS = ("spec_decode_num_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens")
VLLM_STATS = dict(zip(STATS, ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                              "vllm:spec_decode_num_accepted_tokens")))


def one_pass(chat, max_tokens: int) -> tuple[list[str], int, float]:
    """chat(conversation, max_tokens) -> (text, token count) over every conversation, one at a time."""
    texts, tokens, seconds = [], 0, 0.0
    for conversation in conversations():
        start = perf_counter()
        text, count = chat(conversation, max_tokens)
        seconds += perf_counter() - start
        texts.append(text)
        tokens += count
    return texts, tokens, seconds


def timed_chats(chat, max_tokens: int, repeat: int = 1) -> tuple[list[str], int, float]:
    """`repeat` passes; the seconds are the median pass's (a lone small model's step is a few hundred
    microseconds of host work, so one pass varies by tens of percent with the machine)."""
    passes = [one_pass(chat, max_tokens) for _ in range(repeat)]
    return passes[-1][0], passes[-1][1], statistics.median(seconds for _, _, seconds in passes)


def run_ours(model: str, device: str, specs: list[dict | None], max_tokens: int, max_model_len: int,
             dtype: str, repeat: int) -> list[tuple[list[str], int, float, dict]]:
    """Every configuration's engine alive in this one process, their passes taken in turn (plain, spec 1,
    spec 2, ..., plain, ...): a lone small model's step is host work, which drifts by tens of percent from
    one process to the next and over a minute within one, so the ratios come from passes side by side."""
    import triton
    engines = []
    try:
        for spec in specs:     # a KV cache of a few sequences each (one runs at a time), so that all fit
            engines.append(LLM(model, device=device, max_model_len=max_model_len, speculative_config=spec,
                               dtype=dtype, num_kvcache_blocks=4 * -(-max_model_len // 256)))

        def chat_with(llm):
            def chat(conversation, limit):
                out = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=limit), use_tqdm=False)[0]
                return out["text"], len(out["token_ids"])
            return chat
        chats = [chat_with(llm) for llm in engines]
        for chat in chats:
            chat(WARM_UP, max_tokens)
        before = [dict(llm.stats) for llm in engines]
        # kernels that start-up did not compile and a request did (their compile time lands in the figure)
        compiled = []
        triton.knobs.runtime.jit_cache_hook = lambda *, fn, **_: compiled.append(fn.name) and False
        try:
            passes = [[one_pass(chat, max_tokens) for chat in chats] for _ in range(repeat)]
        finally:
            triton.knobs.runtime.jit_cache_hook = None
        results = []
        for i, llm in enumerate(engines):
            texts, tokens, _ = passes[-1][i]
            seconds = statistics.median(each[i][2] for each in passes)
            stats = {name: (llm.stats.get(name, 0) - before[i].get(name, 0)) / repeat for name in STATS}
            results.append((texts, tokens, seconds, dict(stats, compiled_after_start_up=sorted(set(compiled)))))
        return results
    finally:
        for llm in engines:
            llm.exit()


def run_vllm(model: str, spec: dict | None, max_tokens: int, max_model_len: int,
             dtype: str, repeat: int) -> tuple[list[str], int, float, dict]:
    """vLLM's engine in a process of its own (spawned: this one may hold CUDA, and an engine that ends in a
    process does not give all its memory back before the next one measures what is free), which may start
    vLLM's own engine-core process as vLLM does by default."""
    import multiprocessing
    import queue
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    worker = context.Process(target=_vllm_worker, args=(results, model, spec, max_tokens, max_model_len, dtype,
                                                         repeat))
    worker.start()
    try:
        while True:
            try:
                outcome = results.get(timeout=5)
                break
            except queue.Empty:
                if not worker.is_alive():
                    raise RuntimeError(f"vLLM's worker exited with code {worker.exitcode} before its result")
    finally:
        worker.join(timeout=60)
    if isinstance(outcome, str):
        raise RuntimeError(f"vLLM's worker failed:\n{outcome}")
    return outcome


def _vllm_worker(results, *args) -> None:
    import traceback
    try:
        results.put(_run_vllm_here(*args))
    except BaseException:
        results.put(traceback.format_exc())


def _run_vllm_here(model: str, spec: dict | None, max_tokens: int, max_model_len: int,
                   dtype: str, repeat: int) -> tuple[list[str], int, float, dict]:
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmSamplingParams
    llm = VllmLLM(model, dtype=dtype, max_model_len=max_model_len, speculative_config=spec,
                  gpu_memory_utilization=0.5, disable_log_stats=False)     # get_metrics() needs stat logging

    def chat(conversation, limit):
        out = llm.chat(conversation, VllmSamplingParams(temperature=0.0, max_tokens=limit), use_tqdm=False)[0]
        return out.outputs[0].text, len(out.outputs[0].token_ids)

    def counters() -> dict:
        values = {metric.name: getattr(metric, "value", 0) for metric in llm.get_metrics()}
        return {ours: values.get(theirs, 0) for ours, theirs in VLLM_STATS.items()}

    chat(WARM_UP, max_tokens)
    before = counters()
    texts, tokens, seconds = timed_chats(chat, max_tokens, repeat)
    after = counters()
    return texts, tokens, seconds, {name: (after[name] - before[name]) / repeat for name in STATS} | {
        "compiled_after_start_up": None}


def run(model: str, device: str, specs: list[dict | None], max_tokens: int, max_model_len: int,
        engine: str = "ours", dtype: str = "auto", repeat: int = 1) -> list[dict]:
    """One result a configuration, in the order given."""
    if engine == "vllm":
        outcomes = [run_vllm(model, spec, max_tokens, max_model_len, dtype, repeat) for spec in specs]
    else:
        outcomes = run_ours(model, device, specs, max_tokens, max_model_len, dtype, repeat)
    return [summary(spec, engine, *outcome) for spec, outcome in zip(specs, outcomes)]


def summary(spec: dict | None, engine: str, texts: list[str], tokens: int, seconds: float, stats: dict) -> dict:
    drafted, accepted, steps = (stats["spec_decode_draft_tokens"], stats["spec_decode_accepted_tokens"],
                                stats["spec_decode_num_drafts"])
    return {"engine": engine, "spec": spec, "tokens": tokens, "seconds": round(seconds, 4),
            "tok_per_s": round(tokens / seconds, 2),
            "ms_per_token": round(seconds / tokens * 1e3, 4), "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": round(accepted / drafted, 4) if drafted else None,
            "mean_gained_per_verification": round(1 + accepted / steps, 3) if steps else None,
            "compiled_after_start_up": stats["compiled_after_start_up"], "texts": texts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded SmolLM2)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--spec", action="append", type=json.loads, metavar="JSON",
                        help="a speculative_config (repeatable); default n-gram, k = 31, lookup 2..4 "
                             "(copying accepts long runs: on an H100 k = 31 beat 15 and 63 here)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--engine", choices=("ours", "vllm"), default="ours")
    parser.add_argument("--dtype", default="auto", help="both engines' dtype (auto: each engine's own choice)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="passes over the conversations, the median timed (default 5 on a GPU, 1 on CPU)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.model is None:
        from nanovllm.utils.gguf_checkpoint import default_model
        args.model = default_model()
    specs = args.spec or [{"method": "ngram", "num_speculative_tokens": 31, "prompt_lookup_max": 4,
                           "prompt_lookup_min": 2}]
    options = dict(engine=args.engine, dtype=args.dtype, repeat=args.repeat or (5 if device == "cuda" else 1))
    results = run(str(args.model), device, [None] + specs, args.max_tokens, args.max_model_len, **options)
    plain = results[0]
    plain_texts = plain["texts"]
    for result in results:
        result["speedup"] = round(result["tok_per_s"] / plain["tok_per_s"], 3)
        result["same_text"] = sum(a == b for a, b in zip(result["texts"], plain_texts))
        texts = result.pop("texts")
        if args.json:
            print(json.dumps({**result, "device": device, "requests": len(texts)}))
        else:
            name = "no speculation" if result["spec"] is None else json.dumps(result["spec"])
            print(f"{name}: {result['tok_per_s']:.1f} tok/s ({result['ms_per_token']:.2f} ms/token, "
                  f"{result['speedup']:.2f}x), {result['accepted_tokens']:g} of {result['draft_tokens']:g} drafts "
                  f"accepted, {result['mean_gained_per_verification']} tokens a verification, "
                  f"{result['same_text']}/{len(texts)} texts as without"
                  + (f"; compiled after start-up: {result['compiled_after_start_up']}"
                     if result["compiled_after_start_up"] else ""))


if __name__ == "__main__":
    main()
