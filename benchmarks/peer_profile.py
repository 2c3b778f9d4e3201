"""One engine, ours or vLLM, on bench.py's standard workload, then a profiled short run: where each engine's GPU
time goes, kernel by kernel, on the same prompts.

    PYTHONPATH=. python benchmarks/peer_profile.py --engine ours MODEL_DIR [--quantization fp8]
    VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=<vllm site>:. python benchmarks/peer_profile.py --engine vllm \\
        MODEL_DIR [--quantization fp8] [--dummy-range 0.035]
    ... [--structured-outputs json-records-1024] [--no-profile]     # issue #39's side by side (xgrammar in both;
                                                                    # a schema no request completes: like for like)
    ... [--full-warm-up]      # a warm-up as large as the run (vLLM JIT-compiles MoE tiles inside it otherwise)
    ... [--profile-seqs 32] [--profile-only]     # the profiled steps of 32 sequences; no timed workload

Both engines load `load_format="dummy"` weights (MODEL_DIR holds config.json). The standard workload (256
requests, bench.make_workload, ignore_eos, T 0.6) is timed once; then the same 256 prompts run with 24 output
tokens (their prompts cut to whole 256-token pages, now cached) and again, one token longer each, under
torch.profiler: one step of 256 new tokens, then decode steps of 256 sequences (--profile-seqs: the first N of
them, a small batch's steps); the table lists the kernels
by GPU time, with calls and time a call, then a step's GPU time by kind (attention, GEMMs, MoE experts, the
small kernels, sampling, copies; CATEGORIES names them for both engines).

--dummy-range (vLLM only): vLLM draws dummy weights uniform in [-1e-3, 1e-3], norm weights included, and
with them a mixture-of-experts router sends every token to the same few experts (its grouped GEMMs then read a
fraction of the experts' bytes). Ours draws N(0, 0.02) matrices and unit norms, whose routing spreads over
all experts. Uniform in [-0.035, 0.035] (std 0.02) gives vLLM the same spread, so both do the same work.
vLLM's engine must run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) for the profiler to see it.
"""
import argparse
import json
import re
import sys
from pathlib import Path
from time import perf_counter

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import STRUCTURED_PRESETS, make_workload  # noqa: E402

PROFILED_TOKENS = 24
PAGE = 256          # our KV page (vLLM's 16 divides it)


ELEMENTWISE = "norms, activations, RoPE, K/V store, quantization, the rest"
# kernel name patterns of both engines (ours: Triton kernels by name, cuBLAS's nvjet; vLLM's: FlashAttention 3,
# CUTLASS, Inductor's fused Triton kernels), first match wins: the per-step table's rows
CATEGORIES = (
    ("attention", re.compile(r"decode_kernel|prefill_kernel|_reduce_kernel|FlashAttn|flash::|paged_attention")),
    ("MoE experts", re.compile(r"fused_moe|_gate_up_kernel|_down_kernel|moe_align|topk|_route")),
    # Inductor's fused kernels (vLLM) are named after every op they hold, cutlass_scaled_mm's quantization too
    (ELEMENTWISE, re.compile(r"^triton_")),
    ("GEMMs (projections, LM head)", re.compile(r"nvjet|gemm|gemv|cutlass|sm90_xmma|ampere_|_scaled_mm")),
    ("sampling", re.compile(r"argmax|gumbel|sample|temperature|_pick_kernel|top_k|top_p|softmax")),
    ("copies and fills", re.compile(r"Memcpy|Memset|memcpy|copy_kernel|FillFunctor|gather|scatter|index")),
    (ELEMENTWISE, re.compile(r".")),
)


def category(kernel: str) -> str:
    """The per-step table's row for a kernel's name."""
    return next(name for name, pattern in CATEGORIES if pattern.search(kernel))


def paged_prompt(prompt: list[int], page: int = PAGE) -> list[int]:
    """The prompt cut to whole pages of `page` tokens, or repeated to one page where it is shorter."""
    if len(prompt) < page:
        prompt = prompt * -(-page // len(prompt))
    return prompt[:len(prompt) // page * page]


def widen_vllm_dummy_weights(bound: float) -> None:
    """vLLM's initialize_dummy_weights with uniform(-bound, bound) in place of its default range."""
    import vllm.model_executor.model_loader.dummy_loader as dummy_loader
    import vllm.model_executor.model_loader.weight_utils as weight_utils
    original = weight_utils.initialize_dummy_weights

    def widened(model, *args, **kwargs):
        kwargs.pop("low", None)
        kwargs.pop("high", None)
        return original(model, *args, low=-bound, high=bound, **kwargs)

    weight_utils.initialize_dummy_weights = widened
    if hasattr(dummy_loader, "initialize_dummy_weights"):
        dummy_loader.initialize_dummy_weights = widened


def engine(name: str, model: str, quantization: str | None, structured: dict | None = None, device: str = "cuda"):
    """(generate(prompts, max_tokens list, temperature) -> output token count, exit). `structured`: every
    request under these StructuredOutputsParams fields (vLLM's names in both engines). `device`: ours only."""
    if name == "ours":
        from nanovllm import LLM, SamplingParams
        llm = LLM(model, load_format="dummy", quantization=quantization, max_model_len=16384, device=device)
        extra = {} if structured is None else {"structured_outputs": structured}

        def generate(prompts, max_tokens, temperature):
            params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, **extra)
                      for m in max_tokens]
            return sum(len(out["token_ids"]) for out in llm.generate(prompts, params, use_tqdm=False))
        return generate, llm.exit
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model, load_format="dummy", quantization=quantization, max_model_len=16384, enforce_eager=False)
    extra = {}
    if structured is not None:
        from vllm.sampling_params import StructuredOutputsParams
        extra = {"structured_outputs": StructuredOutputsParams(**structured)}

    def generate(prompts, max_tokens, temperature):
        params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, **extra)
                  for m in max_tokens]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return sum(len(out.outputs[0].token_ids) for out in outs)
    return generate, lambda: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--engine", choices=("ours", "vllm"), required=True)
    parser.add_argument("--quantization", choices=("fp8",), default=None)
    parser.add_argument("--dummy-range", type=float, default=None, help="vLLM: dummy weights uniform(-x, x)")
    parser.add_argument("--rows", type=int, default=25, help="kernels listed")
    parser.add_argument("--structured-outputs", metavar="PRESET|JSON",
                        help=f"every request under a schema: {', '.join(STRUCTURED_PRESETS)} or the fields as JSON")
    parser.add_argument("--no-profile", action="store_true", help="the timed workload only")
    parser.add_argument("--full-warm-up", action="store_true",
                        help="before the timed run, another seed's 256 requests cut to 128 output tokens (every "
                             "prefill size and decode batch the run meets, so no kernel compiles inside it)")
    parser.add_argument("--profile-seqs", type=int, default=256,
                        help="sequences in the profiled steps (the workload's first N prompts)")
    parser.add_argument("--profile-only", action="store_true", help="no timed workload before the profile")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="ours: cpu for tests (on a GPU box too, where an engine on the GPU beside the GPU "
                             "tests' would take the memory they count on)")
    args = parser.parse_args()
    if not 1 <= args.profile_seqs <= 256:
        parser.error("--profile-seqs takes 1 to 256 (the workload's requests)")
    if args.profile_only and args.no_profile:
        parser.error("--profile-only and --no-profile leave nothing to run")
    if args.dummy_range is not None:
        if args.engine != "vllm":
            parser.error("--dummy-range applies to vLLM's dummy weights")
        widen_vllm_dummy_weights(args.dummy_range)
    if args.device == "cpu" and args.engine != "ours":
        parser.error("--device cpu runs ours only (vLLM's build here is CUDA's)")
    structured = None
    if args.structured_outputs:
        structured = STRUCTURED_PRESETS.get(args.structured_outputs) or json.loads(args.structured_outputs)
    generate, exit_engine = engine(args.engine, args.model, args.quantization, structured, args.device)
    workload = make_workload(256, 1024, 1024, seed=0)
    generate(workload.prompts[:2], [16, 16], 0.6)                       # warm-up
    if args.full_warm_up:   # vLLM's own warm-up leaves some MoE tiles to compile inside the first big batches
        other = make_workload(256, 1024, 1024, seed=1)
        generate(other.prompts, [min(m, 128) for m in other.max_tokens], 0.6)
    if not args.profile_only:
        start = perf_counter()
        tokens = generate(workload.prompts, workload.max_tokens, 0.6)
        elapsed = perf_counter() - start
        print(json.dumps(dict(engine=args.engine, workload="standard", structured_outputs=args.structured_outputs,
                              seconds=elapsed, output_tokens=tokens, output_tok_per_s=tokens / elapsed)), flush=True)
    if args.no_profile:
        exit_engine()
        return
    # the profiled prompts: the workload's, cut (or, under 256 tokens, repeated) to whole 256-token pages, so
    # that both engines find every one cached whole (ours pages 256 tokens, vLLM 16) and the window is one
    # step of 256 new tokens and decode steps of 256 sequences (or of --profile-seqs)
    prompts = [paged_prompt(prompt) for prompt in workload.prompts[:args.profile_seqs]]
    num_seqs = len(prompts)
    short = [PROFILED_TOKENS] * num_seqs
    generate(prompts, short, 0.6)                                       # every prompt now in the prefix cache
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = perf_counter()
        generate([prompt + [7] for prompt in prompts], short, 0.6)
        elapsed = perf_counter() - start
    exit_engine()
    events = [e for e in prof.key_averages() if e.device_type != DeviceType.CPU and e.self_device_time_total > 0]
    busy_us = sum(e.self_device_time_total for e in events)
    print(f"profiled: {elapsed:.3f} s wall, GPU busy {busy_us / 1e6:.3f} s: {num_seqs} cached prompts of "
          f"{sum(map(len, prompts)) / len(prompts):.0f} tokens on average + 1 token each, "
          f"{PROFILED_TOKENS} output tokens")
    print(f"{'GPU ms':>10} {'calls':>7} {'us/call':>9}  kernel")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.rows]:
        print(f"{e.self_device_time_total / 1e3:10.2f} {e.count:7d} {e.self_device_time_total / e.count:9.2f}  "
              f"{e.key[:110]}")
    totals = dict.fromkeys((name for name, _ in CATEGORIES), 0.0)
    for e in events:
        totals[category(e.key)] += e.self_device_time_total
    print(f"per step ({PROFILED_TOKENS} steps: one of {num_seqs} new tokens, the rest decode steps of {num_seqs} "
          "sequences):")
    for name, us in totals.items():
        print(f"{us / PROFILED_TOKENS / 1e3:10.3f} ms  {name}")
    print(f"{busy_us / PROFILED_TOKENS / 1e3:10.3f} ms  GPU busy")


if __name__ == "__main__":
    main()
