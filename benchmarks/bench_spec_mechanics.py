"""Speculative decoding's mechanics on one stream (issue #40's 8B goals), with drafts made to order:

    python benchmarks/bench_spec_mechanics.py --shape qwen3-8b --load-format dummy [--k 4] [--max-tokens 256]

One engine (n-gram method, its proposer replaced), one 512-token random prompt, greedy, run in these modes
(plain again at the end: the noise):

  plain     no speculation: plain decoding (a decode step a token, CUDA graphs, steps pipelined);
  random    k random drafts every step, speculating every step: nearly none accepted, so each step is a
            verification of k + 1 tokens that yields about one token (its ms/token over plain's is what a
            verification step costs against a decode step: goal <= 1.25x);
  adaptive  the same random drafts under the adaptive policy (the engine's default), which should find that
            speculation does not pay (goal: <= 10% slower than plain);
  oracle    the drafts are the known greedy continuation (a benchmark-only proposer): every draft accepted,
            k + 1 tokens a verification (goal: >= 3.5x plain's tokens a second). Known from the random run:
            its verifications of k + 1 rows compute each token as the oracle's verifications will (same
            kernels, same batch shape), where plain decoding's one row may part from them at a near tie of a
            random bf16 model; if the oracle run still parts somewhere, it is run again on its own output
            (up to 3 times; printed: the runs it took).

Printed per mode: ms/token, tokens a second, its ratio to plain, drafts proposed and accepted, and whether the
greedy tokens equal plain decoding's (with bf16 a near tie between the verification's batch of k + 1 rows and
plain decoding's one row may go either way: other GEMM tilings). --json prints one JSON object per mode.
"""
import argparse
import json
import random
import sys
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.spec_decode import SpeculationPolicy  # noqa: E402

MODES = ("plain", "random", "adaptive", "oracle")
STATS = ("spec_decode_num_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens")


def make_proposer(mode: str, k: int, vocab: int, continuation: list[int], seed: int = 0):
    """propose(seqs, room) -> drafts, as NgramProposer.propose: room[i] drafts at most for seqs[i]."""
    rng = random.Random(seed)

    def propose(seqs, room):
        drafts = []
        for seq, most in zip(seqs, room):
            length = max(0, min(k, most))
            if mode == "oracle":
                done = seq.num_completion_tokens
                drafts.append(continuation[done:done + length])
            elif mode in ("random", "adaptive"):
                drafts.append([rng.randrange(vocab) for _ in range(length)])
            else:
                drafts.append([])
        return drafts
    return propose


def run_mode(llm, mode: str, k: int, prompt: list[int], max_tokens: int, continuation: list[int]) -> dict:
    spec = llm.spec_decode
    spec.proposer.propose = make_proposer(mode, k, llm.config.hf_config.vocab_size, continuation)
    # the engine asks first whether lookup could find a match (a random prompt has none): every mode but
    # plain has its drafts
    spec.proposer.may_propose = lambda seqs: mode != "plain"
    # plain: never speculate (steps pipelined, as an engine without speculation runs them); random, oracle:
    # every step; adaptive: the engine's policy, from scratch
    policy = spec.policy = SpeculationPolicy(adaptive=mode != "plain")
    if mode == "plain":
        policy.speculate = lambda batch_size: False
    elif mode != "adaptive":
        policy.adaptive = False
    llm.scheduler.block_manager.hash_to_block_id.clear()      # the prompt is computed afresh every run
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = {name: llm.stats[name] for name in STATS}
    start = perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    seconds = perf_counter() - start
    drafts = {name: llm.stats[name] - before[name] for name in STATS}
    if mode in ("random", "oracle") and not drafts["spec_decode_num_drafts"]:
        raise RuntimeError(f"{mode}: no step verified a draft (the engine no longer asks the proposer as this "
                           "benchmark replaces it)")
    tokens = out["token_ids"]
    return dict(mode=mode, seconds=round(seconds, 4), tokens=len(tokens),
                ms_per_token=round(seconds * 1e3 / len(tokens), 4), tok_per_s=round(len(tokens) / seconds, 2),
                draft_tokens=drafts["spec_decode_draft_tokens"], accepted_tokens=drafts["spec_decode_accepted_tokens"],
                verifications=drafts["spec_decode_num_drafts"], token_ids=tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--shape", default="qwen3-0.6b", help="bench.py's random shapes (a GPU: qwen3-8b)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 512 on a GPU, 32 on CPU")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 256 on a GPU, 24 on CPU")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device == "cuda"
    model = args.model or bench.default_model(device, args.shape)
    prompt_len = args.prompt_len or (512 if gpu else 32)
    max_tokens = args.max_tokens or (256 if gpu else 24)
    prompt = bench.random_tokens(random.Random(0), prompt_len)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "adaptive": False}
    knobs = {} if args.load_format == "auto" else {"load_format": args.load_format}
    with LLM(str(model), device=device, quantization=args.quantization, speculative_config=spec,
             max_model_len=prompt_len + max_tokens + 64, **knobs) as llm:
        llm.generate([bench.random_tokens(random.Random(1), prompt_len)],        # warm-up, not timed
                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        plain = run_mode(llm, "plain", args.k, prompt, max_tokens, [])
        results, known = [plain], plain["token_ids"]
        for mode in args.modes.split(","):
            if mode == "oracle":
                for attempt in range(1, 4):
                    result = run_mode(llm, mode, args.k, prompt, max_tokens, known)
                    result["runs"], known = attempt, result["token_ids"]
                    if result["accepted_tokens"] == result["draft_tokens"]:
                        break
                results.append(result)
            elif mode != "plain":
                results.append(run_mode(llm, mode, args.k, prompt, max_tokens, known))
                if mode == "random":
                    known = results[-1]["token_ids"]
        results.append(dict(run_mode(llm, "plain", args.k, prompt, max_tokens, []), mode="plain again"))
    plain_tokens = plain["token_ids"]
    for result in results:
        result["vs_plain"] = round(result["tok_per_s"] / plain["tok_per_s"], 3)
        result["same_tokens"] = result.pop("token_ids") == plain_tokens
    for result in results:
        if args.json:
            print(json.dumps(dict(result, device=device, shape=args.shape, k=args.k, prompt_len=prompt_len)))
        else:
            print(f"{result['mode']:11s} {result['ms_per_token']:8.3f} ms/token {result['tok_per_s']:9.1f} tok/s "
                  f"{result['vs_plain']:6.3f}x plain, {result['accepted_tokens']} of {result['draft_tokens']} drafts "
                  f"accepted in {result['verifications']} verifications, greedy tokens "
                  f"{'equal to' if result['same_tokens'] else 'differ from'} plain decoding's"
                  + (f" ({result['runs']} runs)" if "runs" in result else ""))


if __name__ == "__main__":
    main()
