"""Throughput benchmark: nano-vllm's standard workload, measured against the hardware floor.

    python bench.py                      # nanovllm; on a GPU the Qwen3-0.6B shape with random weights
    python bench.py --engine hf          # the same workload through transformers' continuous batching
    python bench.py --model DIR --json   # any checkpoint; a JSON object of every figure as the last line
    python bench.py --workload all       # five regimes: standard, single-stream, long-context, prefill-heavy,
                                         # shared-prefix, each with its own floor
    python bench.py --shape qwen3-30b-a3b   # Qwen3-30B-A3B's mixture-of-experts shape, random weights drawn
                                            # by the engine (load_format="dummy"; nothing written but config.json)
    python bench.py --shape qwen3-8b --quantization fp8 --load-format dummy   # FP8 weights, quantized at load

The workload is drawn exactly as nano-vllm's bench.py draws it (random.seed(0); all prompts, then all
output lengths), so token counts match upstream's. The floor is what the hardware cannot beat: decode
reads every running sequence's KV cache and all weights each step (bandwidth-bound), prefill is
matmul arithmetic (compute-bound). See "Performance yardsticks" in docs/architecture.md. A mixture-of-experts model
(Qwen3-MoE, Mixtral) reads its dense weights each step but only the experts the step's tokens pick (the
expectation under uniform routing), and its prefill computes each token's active parameters only. FP8
weights (--quantization fp8, or an FP8 checkpoint) count one byte per attention/MLP projection weight (the
embeddings, LM head and norms stay in the model's dtype), and their prefill GEMMs run at twice the peak
FLOP/s (FP8 tensor cores).
"""
import argparse
import json
import math
import os
import random
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

MAX_MODEL_LEN = 4096
TINY_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=10240, max_position_embeddings=MAX_MODEL_LEN)
DEFAULTS = {"cuda": dict(num_seqs=256, max_input_len=1024, max_output_len=1024),    # upstream's workload
            "cpu": dict(num_seqs=16, max_input_len=128, max_output_len=64)}       # a minute or two on CPU
ENGINE_KNOBS = ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
                "kv_cache_dtype", "disable_custom_all_reduce", "load_format", "quantization", "speculative_config",
                "kvcache_block_size")
SPEC_STATS = ("spec_decode_num_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens")


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    shared_tokens: list[int] | None = None   # per prompt: leading tokens an earlier prompt already computed
    temperature: float | None = None         # None: the command line's; single-stream is greedy


def make_workload(num_seqs: int, max_input_len: int, max_output_len: int, seed: int = 0) -> Workload:
    """Upstream's draw: lengths uniform in [100, max] (lowered to max/2 for maxima under 200)."""
    rng = random.Random(seed)
    low_in, low_out = (max(1, min(100, n // 2)) for n in (max_input_len, max_output_len))
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(low_in, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [rng.randint(low_out, max_output_len) for _ in range(num_seqs)]
    return Workload(prompts, max_tokens)


# --workload: the five regimes of issue #14, drawn at a GPU's scale and at a small CPU scale. Token ids
# are uniform in [0, 10000) as upstream's; every request ignores eos.
WORKLOADS = ("standard", "single-stream", "long-context", "prefill-heavy", "shared-prefix")
WORKLOAD_MAX_MODEL_LEN = 16384
WORKLOAD_SIZES = {
    "cuda": {"single-stream": dict(prompt_len=512, output_len=1024),
             "long-context": dict(num_seqs=16, prompt_len=12000, output_len=512),
             "prefill-heavy": dict(num_seqs=512, prompt_len=2000, output_len=8),
             "shared-prefix": dict(num_prefixes=8, prefix_len=2000, num_suffixes=32, suffix_len=64, output_len=256)},
    "cpu": {"single-stream": dict(prompt_len=32, output_len=16),
            "long-context": dict(num_seqs=2, prompt_len=384, output_len=8),
            "prefill-heavy": dict(num_seqs=8, prompt_len=64, output_len=2),
            # two full blocks of the default kvcache_block_size (256) per prefix, so the prefix cache can share them
            "shared-prefix": dict(num_prefixes=2, prefix_len=512, num_suffixes=4, suffix_len=8, output_len=4)},
}


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(0, 9999) for _ in range(n)]


def draw_workload(name: str, device: str, seed: int = 0, **standard) -> Workload:
    """One of WORKLOADS at the device's scale; `standard` takes make_workload's sizes."""
    if name == "standard":
        return make_workload(**standard, seed=seed)
    # a stream of its own per workload: with one seed for all, every workload's first prompt would start
    # with the same tokens, and the prefix cache would carry hits from one workload into the next
    size, rng = WORKLOAD_SIZES[device][name], random.Random(f"{name}/{seed}")
    if name == "single-stream":
        return Workload([random_tokens(rng, size["prompt_len"])], [size["output_len"]], temperature=0.0)
    if name in ("long-context", "prefill-heavy"):
        return Workload([random_tokens(rng, size["prompt_len"]) for _ in range(size["num_seqs"])],
                        [size["output_len"]] * size["num_seqs"])
    prefixes = [random_tokens(rng, size["prefix_len"]) for _ in range(size["num_prefixes"])]
    prompts, shared = [], []
    for prefix in prefixes:                  # each prefix's suffixes together: its first prompt computes it
        for i in range(size["num_suffixes"]):
            prompts.append(prefix + random_tokens(rng, size["suffix_len"]))
            shared.append(size["prefix_len"] if i else 0)
    return Workload(prompts, [size["output_len"]] * len(prompts), shared_tokens=shared)


RANDOM_SHAPES = ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b")
# shapes too big to write: config.json alone, the engine draws the weights (load_format="dummy")
DUMMY_SHAPES = ("qwen3-30b-a3b",)
TINY_MOE_SHAPE = dict(TINY_SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[])


def default_model(device: str, shape: str = "qwen3-0.6b") -> Path:
    """A random-weight checkpoint, written once: a published Qwen3 shape in bf16 on a GPU (0.6B unless
    `shape` says 8B or 30B-A3B), a tiny one on CPU (a tiny Qwen3-MoE for the 30B-A3B shape). The
    30B-A3B shape's directory holds config.json and the tokenizer alone (run it with load_format="dummy")."""
    from nanovllm.utils.gguf_checkpoint import cache_root
    from benchmarks.random_checkpoint import QWEN3_0_6B, QWEN3_8B, QWEN3_30B_A3B, write_random_checkpoint

    root, options = cache_root(), {}
    if shape in DUMMY_SHAPES:
        options = dict(architecture="Qwen3MoeForCausalLM", weights=False)
    if device == "cuda":
        path, dtype = root / f"random-{shape}", torch.bfloat16
        shape = {"qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}.get(shape, QWEN3_0_6B)
    elif shape in DUMMY_SHAPES:
        path, dtype, shape = root / "random-qwen3-moe-tiny", torch.float32, TINY_MOE_SHAPE
    else:
        path, dtype, shape = root / "random-qwen3-tiny", torch.float32, TINY_SHAPE
    if not (path / "config.json").is_file():
        what = "config-only checkpoint" if options else "random-weight checkpoint"
        print(f"Writing a {what} to {path} (once)")
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        write_random_checkpoint(partial, dtype=dtype, device=device, **options, **shape)
        partial.rename(path)             # a crash midway never leaves a half-written checkpoint behind
    return path


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, iters: int = 20) -> float:
    """Copy bandwidth in bytes/s, counting the bytes read plus the bytes written."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    elapsed = perf_counter() - start
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()         # leave the engine all the memory it sizes its KV cache from
    return 2 * n * iters / elapsed


def measure_cpu_flops(n: int = 512, iters: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = perf_counter()
    for _ in range(iters):
        a @ b
    return 2 * n ** 3 * iters / (perf_counter() - start)


def count_parameters(model_dir: str | Path, tied: bool) -> int:
    """Parameters stored in the checkpoint, a tied embedding counted once."""
    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                if not (tied and name.endswith("lm_head.weight")):
                    total += math.prod(f.get_slice(name).get_shape())
    return total


DENSE_FAMILIES = ("llama", "qwen2", "qwen3")      # the model_types config_parameters counts
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts model's routed experts: the layers that have them (sparse_layers), how many
    each layer holds (num_experts), how many a token picks (top_k), and each expert's size: a SwiGLU MLP
    of gate, up and down projections, hidden_size x intermediate_size each, no biases."""
    sparse_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int

    @property
    def params_per_expert(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def params(self) -> int:
        """Every expert of every sparse layer (the routers are not experts: they count as dense)."""
        return len(self.sparse_layers) * self.num_experts * self.params_per_expert

    @property
    def active_params(self) -> int:
        """The expert parameters one token computes with: top_k experts in each sparse layer."""
        return len(self.sparse_layers) * self.top_k * self.params_per_expert

    def expected_touched(self, num_tokens: int) -> float:
        """Distinct experts of one layer that num_tokens tokens pick, in expectation under uniform routing
        (what random weights give): a token picks a given expert with probability top_k / num_experts,
        independently of the other tokens, so the expert stays untouched with probability
        (1 - top_k / num_experts) ** num_tokens. One token touches top_k; many touch them all."""
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** num_tokens)


def moe_experts(hf_config) -> Experts | None:
    """The routed experts of a Qwen3-MoE or Mixtral config; None for a dense model. Qwen3-MoE's layer i
    is sparse iff i is not in mlp_only_layers, num_experts > 0 and (i + 1) % decoder_sparse_step == 0
    (the others have a dense MLP of intermediate_size); every Mixtral layer is sparse."""
    hf = hf_config
    family = getattr(hf, "model_type", None)
    if family == "qwen3_moe":
        num_experts, dense = hf.num_experts, set(getattr(hf, "mlp_only_layers", None) or [])
        step = getattr(hf, "decoder_sparse_step", 1)
        sparse = tuple(i for i in range(hf.num_hidden_layers)
                       if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        size = hf.moe_intermediate_size
    elif family == "mixtral":
        num_experts, sparse, size = hf.num_local_experts, tuple(range(hf.num_hidden_layers)), hf.intermediate_size
    elif family in DENSE_FAMILIES:
        return None
    else:
        # a family whose routed experts we do not know (shared experts, ...) must not pass for dense
        if getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None):
            raise ValueError(f"the floor does not know the experts of model_type {family!r}")
        return None
    if not sparse:
        return None
    return Experts(sparse, num_experts, hf.num_experts_per_tok, hf.hidden_size, size)


def config_parameters(hf_config) -> int:
    """The parameters a checkpoint of this config stores, counted from the config alone (what
    count_parameters counts in its safetensors; a tied embedding counted once): embeddings, per layer
    two RMSNorms, attention (q/k/v/o, their biases where the family has them, Qwen3's per-head q/k
    norms) and a dense MLP or a router and its experts, then the final norm and the LM head."""
    hf = hf_config
    family = getattr(hf, "model_type", None)
    if family not in DENSE_FAMILIES + MOE_FAMILIES:
        raise ValueError(f"cannot count the parameters of model_type {family!r} from its config; "
                         f"known: {', '.join(DENSE_FAMILIES + MOE_FAMILIES)}")
    hidden, q = hf.hidden_size, hf.num_attention_heads * head_dim(hf)
    kv = hf.num_key_value_heads * head_dim(hf)
    attention = hidden * (q + 2 * kv) + q * hidden
    if family == "qwen2":                                 # q/k/v biases always, none on o
        attention += q + 2 * kv
    elif family != "mixtral" and getattr(hf, "attention_bias", False):
        attention += q + 2 * kv + hidden
    if family in ("qwen3", "qwen3_moe"):
        attention += 2 * head_dim(hf)                     # q_norm, k_norm
    mlp = 3 * hidden * hf.intermediate_size
    if family == "llama" and getattr(hf, "mlp_bias", False):
        mlp += 2 * hf.intermediate_size + hidden
    experts = moe_experts(hf)
    num_sparse = len(experts.sparse_layers) if experts else 0
    layers = (hf.num_hidden_layers * (attention + 2 * hidden) + (hf.num_hidden_layers - num_sparse) * mlp
              + (num_sparse * experts.num_experts * hidden + experts.params if experts else 0))   # routers, experts
    embedding = hf.vocab_size * hidden
    return embedding * (1 if getattr(hf, "tie_word_embeddings", False) else 2) + layers + hidden


def linear_parameters(hf_config) -> int:
    """The decoder's attention (q/k/v/o) and dense MLP (gate/up/down) weights, biases aside: what FP8
    quantization stores at one byte each."""
    hf = hf_config
    hidden, q = hf.hidden_size, hf.num_attention_heads * head_dim(hf)
    kv = hf.num_key_value_heads * head_dim(hf)
    experts = moe_experts(hf)
    dense_mlps = hf.num_hidden_layers - (len(experts.sparse_layers) if experts else 0)
    return hf.num_hidden_layers * (hidden * (q + 2 * kv) + q * hidden) + dense_mlps * 3 * hidden * hf.intermediate_size


def model_parameters(model_dir: str | Path, hf_config) -> int:
    """count_parameters of the checkpoint's safetensors; counted from the config where the directory
    has none (a config-only checkpoint run with load_format="dummy")."""
    if any(Path(model_dir).glob("*.safetensors")):
        return count_parameters(model_dir, getattr(hf_config, "tie_word_embeddings", False))
    return config_parameters(hf_config)


def hardware_floor(hf_config, num_params: int, itemsize: int, workload: Workload,
                   bandwidth: float, flops: float, kv_itemsize: int | None = None, fp8_params: int = 0,
                   fp8_experts: bool = False) -> dict:
    """Seconds the run needs at best: decode bytes over bandwidth plus prefill FLOPs over peak FLOP/s.
    Ideally every request runs at once, so the weights are read once per step of the longest output
    (a mixture-of-experts model's dense weights; of its experts only those the step's tokens pick).
    `itemsize`: the weights' bytes per value; `kv_itemsize` the KV cache's (default: the same);
    `fp8_params`: of num_params, those stored in FP8 (one byte each; their prefill FLOPs at twice the peak);
    `fp8_experts`: a mixture-of-experts model's experts are too."""
    hf = hf_config
    head_dim_ = head_dim(hf)
    kv_bytes_per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim_ * (kv_itemsize or itemsize)
    lengths = [(len(p), o) for p, o in zip(workload.prompts, workload.max_tokens)]
    shared = workload.shared_tokens or [0] * len(lengths)
    # sum_{t<o} (p + t) per request, less its shared prefix: a prefix that several requests share is read
    # once per step (a kernel can: cascade attention), counted with the request that computed it
    kv_bytes = kv_bytes_per_token * sum(o * (p - c) + o * (o - 1) // 2 for (p, o), c in zip(lengths, shared))
    steps, experts, moe = max(workload.max_tokens), moe_experts(hf), {}
    fp8_saved = fp8_params * (itemsize - 1)        # bytes a step does not read for FP8 weights
    if experts is None:
        weight_bytes, active_params = (num_params * itemsize - fp8_saved) * steps, num_params
    else:
        # step t decodes the B_t requests with max_tokens > t: the dense part (attention, norms, routers,
        # dense MLPs, and the embedding table whole, as the dense floor counts it, though a step reads only
        # its tokens' rows) is read every step, and each sparse layer reads the experts its B_t tokens
        # pick: expected_touched(B_t), the expectation under uniform routing, which random weights give
        ends, start, touched = sorted(workload.max_tokens), 0, 0.0
        for end in sorted(set(ends)):         # steps start..end-1 all run the same requests
            touched += (end - start) * experts.expected_touched(len(ends) - bisect_right(ends, start))
            start = end
        expert_itemsize = 1 if fp8_experts else itemsize
        expert_bytes = len(experts.sparse_layers) * experts.params_per_expert * touched * expert_itemsize
        weight_bytes = ((num_params - experts.params) * itemsize - fp8_saved) * steps + expert_bytes
        active_params = num_params - experts.params + experts.active_params      # per token
        moe = dict(expert_read_bytes=expert_bytes, num_params=num_params, active_params=active_params,
                   experts_touched_fraction=expert_bytes / (experts.params * expert_itemsize * steps))
    embedding = hf.vocab_size * hf.hidden_size     # a lookup, not a matmul; the head runs for last tokens only
    body = active_params - embedding * (1 if getattr(hf, "tie_word_embeddings", False) else 2)
    attention = 2 * hf.num_hidden_layers * hf.num_attention_heads * head_dim_   # QK^T + PV, causal, per p(p+1)
    # tokens c..p-1 of a prompt whose first c are shared: the body for p - c tokens, attention over i + 1 keys
    prefill_flops = sum(2 * body * (p - c) + 2 * embedding + attention * (p * (p + 1) - c * (c + 1))
                        for (p, _), c in zip(lengths, shared))
    fp8 = {}
    fp8_active = fp8_params + (experts.active_params if fp8_experts and experts else 0)    # per token
    if fp8_active:       # FP8 tensor cores: twice the FLOP/s, so those FLOPs count half
        fp8 = dict(fp8_params=fp8_params, fp8_experts=bool(fp8_experts and experts),
                   fp8_prefill_flops=sum(2 * fp8_active * (p - c) for (p, _), c in zip(lengths, shared)))
    floor_s = (kv_bytes + weight_bytes) / bandwidth + (prefill_flops - fp8.get("fp8_prefill_flops", 0) / 2) / flops
    return dict(kv_read_bytes=kv_bytes, weight_read_bytes=weight_bytes, prefill_flops=prefill_flops,
                bandwidth_gbps=bandwidth / 1e9, peak_tflops=flops / 1e12, floor_s=floor_s, **moe, **fp8)


# --structured-outputs presets: constraints that a random-weight model rarely completes within max_tokens
# (ignore_eos), so that every decode step of every request is masked; json-records-1024 cannot be completed
# at all within 1,024 tokens (1,024 records of a few tokens each), so that every engine, whatever it does once
# a grammar is complete, generates every request's max_tokens under the mask (a side by side's like for like)
_RECORD = {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "score": {"type": "number"}}, "required": ["id", "name", "tags", "score"]}
STRUCTURED_PRESETS = {
    "json-records": {"json": {"type": "array", "items": _RECORD}},
    "json-records-1024": {"json": {"type": "array", "items": _RECORD, "minItems": 1024}},
    "regex-words": {"regex": "([a-z]+ )+"},
}


def sampling_options(args: argparse.Namespace) -> dict:
    """The SamplingParams fields the command line sets (the standard workload: temperature 0.6 alone)."""
    options = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                   logprobs=args.logprobs, n=args.n, repetition_penalty=args.repetition_penalty,
                   presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
    if args.structured_outputs is not None:
        options["structured_outputs"] = STRUCTURED_PRESETS.get(args.structured_outputs) or json.loads(args.structured_outputs)
    return options


def make_engine(args: argparse.Namespace, model: Path, max_model_len: int = MAX_MODEL_LEN):
    from nanovllm import LLM, SamplingParams

    knobs = {name: getattr(args, name) for name in ENGINE_KNOBS if getattr(args, name) is not None}
    llm = LLM(str(model), device=args.device, enforce_eager=args.enforce_eager, max_model_len=max_model_len, **knobs)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    return llm


def run_workload(llm, workload: Workload, options: dict, desc: str = "nanovllm") -> dict:
    """Drive add_request/step ourselves, so each step's wall time can be filed under prefill or decode
    by its sign. A step launches its batch and then waits for the batch before it, so the split is off
    by one step where prefill turns to decode: the last prefill batch's device time (tens of
    milliseconds) is filed under decode. The total is exact."""
    from nanovllm import SamplingParams

    preemptions_before, hits_before = llm.stats["num_preemptions"], llm.stats["num_prefix_cache_hit_tokens"]
    spec_before = {name: llm.stats[name] for name in SPEC_STATS if name in llm.stats}
    if workload.temperature is not None:
        options = dict(options, temperature=workload.temperature)
    params = [SamplingParams(ignore_eos=True, max_tokens=m, **options) for m in workload.max_tokens]
    prefill_s = decode_s = 0.0
    generated = 0
    with tqdm(total=len(params) * options.get("n", 1), desc=desc, unit="seq", dynamic_ncols=True) as pbar:
        start = perf_counter()
        for prompt, sp in zip(workload.prompts, params):
            llm.add_request(prompt, sp)
        while not llm.is_finished():
            step_start = perf_counter()
            finished, num_tokens = llm.step()
            if num_tokens > 0:
                prefill_s += perf_counter() - step_start
            else:
                decode_s += perf_counter() - step_start
            generated += sum(len(token_ids) for _, token_ids in finished)
            pbar.update(len(finished))
        elapsed = perf_counter() - start
    stats, config = llm.stats, llm.config
    spec = {name: stats[name] - before for name, before in spec_before.items()}    # with --speculative-config
    return dict(**spec, time_s=elapsed, generated=generated, prefill_time_s=prefill_s, decode_time_s=decode_s,
                num_preemptions=stats["num_preemptions"] - preemptions_before,
                prefix_cache_hit_tokens=stats["num_prefix_cache_hit_tokens"] - hits_before,
                peak_kv_blocks=stats["num_peak_used_blocks"], num_kv_blocks=llm.model_runner.num_kvcache_blocks,
                hf_config=config.hf_config, dtype=config.dtype, kv_cache_dtype=config.kv_cache_dtype,
                kv_block_size=config.kvcache_block_size, quantization=config.quantization,
                num_devices=config.tensor_parallel_size if config.device == "cuda" else 1)


def run_nanovllm(args: argparse.Namespace, model: Path, workload: Workload) -> dict:
    llm = make_engine(args, model)
    try:
        return run_workload(llm, workload, sampling_options(args))
    finally:
        llm.exit()


def collect_hf(manager, request_ids: list[str | None], pbar: tqdm | None) -> int:
    """Wait for every request to finish; returns the number of tokens they generated."""
    if None in request_ids:
        raise RuntimeError("transformers' continuous batching manager refused a request")
    pending, generated = set(request_ids), 0
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped with requests unfinished")
        elif result.request_id in pending and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"transformers failed request {result.request_id}: {result.error}")
            pending.remove(result.request_id)
            generated += len(result.generated_tokens)
            if pbar is not None:
                pbar.update(1)
    return generated


def run_hf(model: Path, workload: Workload, device: torch.device) -> dict:
    """transformers' continuous batching on the same workload: one request per prompt with its own
    max_new_tokens, eos disabled (-1 is never sampled), temperature 0.6 over the whole vocabulary.
    "sdpa" is the spelling both 5.17 (which makes it "paged|sdpa") and later 5.x accept; both switch
    to flash attention by themselves when it is installed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32 if device.type == "cpu" else "auto",
                                                    attn_implementation="sdpa").to(device)
    generation_config = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, eos_token_id=-1)
    hints = WorkloadHints(max_prompt_length=max(map(len, workload.prompts)),
                          max_generated_length=max(workload.max_tokens), num_requests=len(workload.prompts))
    cb_config = ContinuousBatchingConfig()
    if device.type == "cpu":   # else transformers sizes its cache and batch from total RAM: minutes on CPU
        cb_config.num_blocks = sum(math.ceil((len(p) + o) / 256) for p, o in zip(workload.prompts, workload.max_tokens))
        cb_config.max_batch_tokens = min(16384, sum(map(len, workload.prompts)))
    warmup_ids = AutoTokenizer.from_pretrained(model).encode("Benchmark: ")
    with hf_model.continuous_batching_context_manager(generation_config=generation_config, workload_hints=hints,
                                                      continuous_batching_config=cb_config) as manager:
        collect_hf(manager, [manager.add_request(warmup_ids, max_new_tokens=64, eos_token_id=-1)], None)
        with tqdm(total=len(workload.prompts), desc="transformers", unit="req", dynamic_ncols=True) as pbar:
            start = perf_counter()
            request_ids = [manager.add_request(prompt, max_new_tokens=m, eos_token_id=-1)
                           for prompt, m in zip(workload.prompts, workload.max_tokens)]
            generated = collect_hf(manager, request_ids, pbar)
            elapsed = perf_counter() - start
    return dict(time_s=elapsed, generated=generated, prefill_time_s=None, decode_time_s=None, num_preemptions=None,
                prefix_cache_hit_tokens=None, peak_kv_blocks=None, num_kv_blocks=None, hf_config=hf_model.config,
                dtype=hf_model.dtype, kv_cache_dtype=hf_model.dtype, quantization=None, num_devices=1)


def rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.0f}tok/s" if seconds > 0 else "-"


def report(result: dict, floor: dict, workload: Workload, n: int = 1) -> dict:
    """Print the human-readable lines (upstream's first) and return every figure for --json."""
    tokens, elapsed = n * sum(workload.max_tokens), result["time_s"]
    if result["generated"] != tokens:
        raise RuntimeError(f"the engine generated {result['generated']} tokens, the workload asks for {tokens}")
    print(f"Total: {tokens}tok, Time: {elapsed:.2f}s, Throughput: {tokens / elapsed:.2f}tok/s")
    prompt_tokens = sum(map(len, workload.prompts))
    print(f"Prompt + output: {prompt_tokens + tokens}tok, {rate(prompt_tokens + tokens, elapsed)}")
    if result["prefill_time_s"] is not None:
        prefill_s, decode_s = result["prefill_time_s"], result["decode_time_s"]
        decoded = tokens - n * len(workload.prompts)      # each completion's first token comes from its prefill
        print(f"Prefill: {prompt_tokens}tok in {prefill_s:.2f}s ({rate(prompt_tokens, prefill_s)}), "
              f"Decode: {decoded}tok in {decode_s:.2f}s ({rate(decoded, decode_s)})")
        peak, total = result["peak_kv_blocks"], result["num_kv_blocks"]
        print(f"Preemptions: {result['num_preemptions']}, Peak KV blocks in use: {peak} / {total} ({peak / total:.0%}), "
              f"prefix-cache hits: {result['prefix_cache_hit_tokens']}tok")
        print(f"KV cache: {str(result['kv_cache_dtype']).removeprefix('torch.')}, {total} blocks of "
              f"{result['kv_block_size']} = {total * result['kv_block_size']} tokens")
    else:
        print("Prefill/decode split, preemptions, KV blocks: not reported by transformers")
    spec = {}
    if "spec_decode_num_drafts" in result:
        steps, drafts, accepted = (result[name] for name in SPEC_STATS)
        spec["spec_decode_mean_accepted_length"] = accepted / max(steps, 1)
        print(f"Speculative decoding: {drafts} draft tokens in {steps} draft steps (a sequence's step with drafts), "
              f"{accepted} accepted ({accepted / max(drafts, 1):.0%}); mean accepted length "
              f"{spec['spec_decode_mean_accepted_length']:.2f} (accepted / draft steps), so "
              f"{1 + spec['spec_decode_mean_accepted_length']:.2f} tokens per draft step")
    if "fp8_params" in floor:
        experts = " and the experts" if floor["fp8_experts"] else ""
        print(f"Weights: FP8 for {floor['fp8_params'] / 1e9:.3g}B projection parameters{experts} (one byte each; their "
              f"prefill FLOPs at twice the peak), {str(result['dtype']).removeprefix('torch.')} for the rest")
    fraction = floor["floor_s"] / elapsed
    print(f"Hardware floor: {floor['floor_s']:.3g}s = {tokens / floor['floor_s']:.0f}tok/s (KV reads {floor['kv_read_bytes'] / 1e12:.3g} TB + weight "
          f"reads {floor['weight_read_bytes'] / 1e12:.3g} TB at {floor['bandwidth_gbps']:.0f} GB/s, prefill "
          f"{floor['prefill_flops']:.3g} FLOP at {floor['peak_tflops']:.3g} TFLOP/s); "
          f"fraction of floor = {fraction:.3g}")
    if "expert_read_bytes" in floor:
        expert_tb = floor["expert_read_bytes"] / 1e12
        print(f"Floor's weight reads {floor['weight_read_bytes'] / 1e12:.3g} TB = dense "
              f"{floor['weight_read_bytes'] / 1e12 - expert_tb:.3g} TB + experts {expert_tb:.3g} TB (experts touched: "
              f"{floor['experts_touched_fraction']:.1%} of the expert bytes, expected under uniform routing); "
              f"prefill at {floor['active_params'] / 1e9:.3g}B active of {floor['num_params'] / 1e9:.3g}B parameters")
    figures = {k: v for k, v in result.items() if k not in ("hf_config", "dtype", "kv_cache_dtype", "generated")}
    return dict(figures, total_tokens=tokens, prompt_tokens=prompt_tokens, throughput=tokens / elapsed,
                prompt_and_output_throughput=(prompt_tokens + tokens) / elapsed,
                dtype=str(result["dtype"]).removeprefix("torch."),
                kv_cache_dtype=str(result["kv_cache_dtype"]).removeprefix("torch."), **floor,
                fraction_of_floor=fraction, **spec)


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def workload_names(text: str) -> tuple[str, ...]:
    """--workload: "all", or one or more of WORKLOADS, comma-separated."""
    names = WORKLOADS if text == "all" else tuple(text.split(","))
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown workload {unknown[0]!r}: choose from {', '.join(WORKLOADS)}, all")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("nanovllm", "hf"), default="nanovllm",
                        help="nanovllm, or transformers' continuous batching (generate_batch's manager)")
    parser.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory; default: a random-weight "
                        "one written once under $NANOVLLM_CACHE (default ~/.cache/nanovllm): Qwen3-0.6B's shape "
                        "on a GPU, a tiny shape on CPU")
    parser.add_argument("--shape", choices=RANDOM_SHAPES, default="qwen3-0.6b",
                        help="the published shape of the random-weight default model on a GPU (qwen3-8b: "
                        "36 layers, hidden 4096, 32 q / 8 kv heads, for tensor-parallel runs; qwen3-30b-a3b: "
                        "Qwen3-MoE, 48 layers of 128 experts, 8 per token, config.json only and the engine's "
                        "random weights (--load-format dummy), a tiny Qwen3-MoE on CPU)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="where the engine runs, and the scale of the "
                        "defaults and workloads (default: cuda when a GPU is present, else cpu)")
    parser.add_argument("--num-seqs", type=int, help="number of requests (default: 256 on a GPU, 16 on CPU)")
    parser.add_argument("--max-input-len", type=int, help="prompt lengths are uniform in [100, this] "
                        "(lower bound this/2 below 200; default: 1024 on a GPU, 128 on CPU)")
    parser.add_argument("--max-output-len", type=int, help="output lengths (max_tokens) are uniform in "
                        "[100, this] (lower bound this/2 below 200; default: 1024 on a GPU, 64 on CPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload draw (default: 0, as upstream)")
    parser.add_argument("--bandwidth", type=float, help="device memory bandwidth in GB/s (read + write) for the "
                        "floor; default: measured by timing a large device-to-device copy")
    parser.add_argument("--peak-tflops", type=float, help="peak matmul TFLOP/s for the prefill part of the floor; "
                        "default: 800 on CUDA, a measured float32 matmul on CPU")
    parser.add_argument("--workload", type=workload_names,
                        help="one of the five regimes, several comma-separated, or all of them (on one engine "
                        "with max_model_len "
                        f"{WORKLOAD_MAX_MODEL_LEN} on a GPU): standard (the default workload), single-stream (1 "
                        "request, 512-token prompt, 1,024 tokens greedy; also ms/token and time to first token), "
                        "long-context (16 x 12,000-token prompts, 512 out), prefill-heavy (512 x 2,000, 8 out), "
                        "shared-prefix (8 prefixes of 2,000 tokens x 32 suffixes of 64, 256 out); small sizes on CPU")
    parser.add_argument("--json", action="store_true", help="also print every figure as one JSON object, last line "
                        "(with --workload: one object per workload, each on its own line)")
    sampling = parser.add_argument_group("sampling (nanovllm; the standard workload is temperature 0.6 alone; "
                                         "Qwen3's own settings: --top-p 0.95 --top-k 20)")
    sampling.add_argument("--temperature", type=float, default=0.6)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--logprobs", type=int, help="top log-probs returned per token")
    sampling.add_argument("--n", type=int, default=1, help="completions per prompt (the throughput counts them all)")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0,
                          help="over prompt and output (1.1 is in many checkpoints' generation_config.json)")
    sampling.add_argument("--presence-penalty", type=float, default=0.0)
    sampling.add_argument("--frequency-penalty", type=float, default=0.0)
    sampling.add_argument("--structured-outputs", metavar="JSON|PRESET",
                          help="every request under this constraint: StructuredOutputsParams' fields as JSON "
                               "(e.g. '{\"regex\": \"[a-z ]+\"}'), or a preset: " + ", ".join(STRUCTURED_PRESETS))
    engine = parser.add_argument_group("nanovllm engine knobs (default: the engine's own)")
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, no torch.compile")
    engine.add_argument("--tensor-parallel-size", type=int,
                        help="devices to shard over; the floor then counts that many devices' bandwidth and FLOP/s")
    engine.add_argument("--max-num-seqs", type=int, help="most sequences in one batch")
    engine.add_argument("--max-num-batched-tokens", type=int, help="most tokens in one prefill step")
    engine.add_argument("--gpu-memory-utilization", type=float, help="fraction of GPU memory the engine may use")
    engine.add_argument("--disable-custom-all-reduce", action="store_true", default=None,
                        help="tensor parallel: every all-reduce through NCCL, none through peer memory")
    engine.add_argument("--kvcache-block-size", type=int,
                        help="tokens per KV cache page (a power of two >= 16; default 256)")
    engine.add_argument("--kv-cache-dtype", choices=("auto", "fp8"),
                        help="KV cache storage: the model's dtype (auto) or float8_e4m3fn; the floor counts its bytes")
    engine.add_argument("--quantization", choices=("fp8",),
                        help="FP8 weights, quantized at load (an FP8 checkpoint is FP8 without it); the floor counts "
                        "one byte per projection weight")
    engine.add_argument("--speculative-config", type=json_object, metavar="JSON",
                        help="speculative decoding, vLLM's keys, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'; "
                        "the report adds the drafts accepted")
    engine.add_argument("--load-format", choices=("auto", "dummy"),
                        help="the checkpoint's weights (auto) or seeded random ones drawn from config.json alone "
                        "(dummy; the floor then counts the parameters from the config); --shape qwen3-30b-a3b "
                        "forces dummy")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.engine == "hf" and args.workload is not None:
        parser.error("--workload runs the nanovllm engine only")
    dummy_shape = args.model is None and args.shape in DUMMY_SHAPES
    if args.engine == "hf" and dummy_shape:
        parser.error(f"--shape {args.shape} has no weights on disk for transformers to load")
    if args.engine == "hf" and (args.enforce_eager or any(getattr(args, k) is not None for k in ENGINE_KNOBS)):
        parser.error("the nanovllm engine knobs do not apply to --engine hf")
    if args.engine == "hf" and sampling_options(args) != sampling_options(parser.parse_args([])):
        parser.error("the sampling options apply to nanovllm only (--engine hf samples at temperature 0.6)")
    if dummy_shape:
        if args.load_format == "auto":
            parser.error(f"--shape {args.shape} is config.json alone: it runs with --load-format dummy")
        args.load_format = "dummy"
    try:
        from nanovllm import SamplingParams
        SamplingParams(**sampling_options(args))
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    for name in ("num_seqs", "max_input_len", "max_output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(x is not None and not x > 0 for x in (args.bandwidth, args.peak_tflops)):
        parser.error("--bandwidth and --peak-tflops must be > 0")
    if args.max_input_len + args.max_output_len > MAX_MODEL_LEN:
        parser.error(f"--max-input-len + --max-output-len must be <= max_model_len={MAX_MODEL_LEN}")
    return args


def floor_for(result: dict, model: Path, workload: Workload, bandwidth: float, flops: float) -> dict:
    hf_config = result["hf_config"]
    num_params = model_parameters(model, hf_config)
    fp8_params = linear_parameters(hf_config) if result["quantization"] == "fp8" else 0
    return hardware_floor(hf_config, num_params, result["dtype"].itemsize, workload, bandwidth * result["num_devices"],
                          flops * result["num_devices"], result["kv_cache_dtype"].itemsize, fp8_params,
                          fp8_experts=result["quantization"] == "fp8")


def run_workloads(args: argparse.Namespace, model: Path, bandwidth: float, flops: float) -> list[dict]:
    """--workload: each named workload in turn on one engine (warmed up once), a report and (--json) a
    JSON line each."""
    from nanovllm import SamplingParams

    names = args.workload
    standard = dict(num_seqs=args.num_seqs, max_input_len=args.max_input_len, max_output_len=args.max_output_len)
    max_model_len = WORKLOAD_MAX_MODEL_LEN if args.device == "cuda" else MAX_MODEL_LEN
    llm = make_engine(args, model, max_model_len)
    all_figures = []
    try:
        for name in names:
            workload = draw_workload(name, args.device, args.seed, **standard)
            extra = {}
            if name == "single-stream":      # a lone request of the same length, on its own (not cached)
                lone = draw_workload(name, args.device, args.seed + 1).prompts[0]
                start = perf_counter()
                llm.generate([lone], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
                extra["ttft_ms"] = (perf_counter() - start) * 1e3
            print(f"== {name}: {len(workload.prompts)} requests, {sum(map(len, workload.prompts))} prompt tokens, "
                  f"{sum(workload.max_tokens)} to generate ==")
            result = run_workload(llm, workload, sampling_options(args), desc=name)
            figures = report(result, floor_for(result, model, workload, bandwidth, flops), workload, args.n)
            if name == "single-stream":
                extra["ms_per_token"] = figures["time_s"] * 1e3 / figures["total_tokens"]
                print(f"Single stream: {extra['ms_per_token']:.3f} ms/token, time to first token of a lone "
                      f"{len(workload.prompts[0])}-token request {extra['ttft_ms']:.1f} ms")
            figures = dict(workload=name, engine="nanovllm", model=str(model), device=args.device,
                           max_model_len=llm.config.max_model_len, seed=args.seed, **sampling_options(args),
                           **figures, **extra)
            if workload.temperature is not None:
                figures["temperature"] = workload.temperature
            if args.json:
                print(json.dumps(figures))
            all_figures.append(figures)
    finally:
        llm.exit()
    return all_figures


def main(argv: list[str] | None = None) -> dict | list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    bandwidth = args.bandwidth * 1e9 if args.bandwidth is not None else measure_bandwidth(device)
    flops = (args.peak_tflops * 1e12 if args.peak_tflops is not None
             else 800e12 if device.type == "cuda" else measure_cpu_flops())
    model = args.model or default_model(device.type, args.shape)
    if args.workload is not None:
        return run_workloads(args, model, bandwidth, flops)
    workload = make_workload(args.num_seqs, args.max_input_len, args.max_output_len, args.seed)
    if args.engine == "nanovllm":
        result = run_nanovllm(args, model, workload)
    else:
        result = run_hf(model, workload, device)
    floor = floor_for(result, model, workload, bandwidth, flops)
    figures = dict(engine=args.engine, model=str(model), device=device.type, num_seqs=args.num_seqs,
                   max_input_len=args.max_input_len, max_output_len=args.max_output_len, seed=args.seed,
                   **(sampling_options(args) if args.engine == "nanovllm" else {}),
                   **report(result, floor, workload, args.n if args.engine == "nanovllm" else 1))
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
