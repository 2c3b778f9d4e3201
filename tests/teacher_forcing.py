"""Teacher forcing through the engine's own model runner: log-probs at the last prompt position and at
each decode step of a given continuation, with or without CUDA graphs (GPU tests)."""

import torch
import torch.nn.functional as F

import oracle
from nanovllm import SamplingParams
from nanovllm.engine.sequence import Sequence
from nanovllm.utils.context import reset_context

NUM_FORCED = 48      # decode positions teacher-forced per sequence
TIE_MARGIN = 0.1     # nats: closer top-2 logits are near-ties that bf16 rounding alone may flip


def random_prompts(n, seed, lengths=(20, 300)):
    """The GPU tests' prompts: ids below 10,000, as in bench.py's workload."""
    return oracle.random_prompts(n, 10000, lengths, seed)


@torch.inference_mode()
def forced_logprobs(llm, prompts, continuations, use_graphs=True, num_forced=NUM_FORCED):
    """Our log-probs at the last prompt position (prefill) and at each teacher-forced decode step."""
    runner, bm = llm.model_runner, llm.scheduler.block_manager
    seqs = [Sequence(p, SamplingParams(), llm.config.kvcache_block_size) for p in prompts]
    for seq in seqs:
        copy = bm.allocate(seq)
        if copy is not None:                        # a partial prefix-cache hit: the scheduler's step would copy
            runner.copy_blocks([copy])
        seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens
    was_eager = runner.enforce_eager
    runner.enforce_eager = not use_graphs
    steps = []
    try:
        logits = runner.run_model(*runner.prepare_prefill(seqs), True, len(seqs))
        reset_context()
        steps.append(logits.float().log_softmax(-1))
        for i in range(num_forced):
            for seq, cont in zip(seqs, continuations):
                seq.num_cached_tokens = len(seq)
                seq.append_token(cont[i])
                bm.may_append(seq)
            logits = runner.run_model(*runner.prepare_decode(seqs), False, len(seqs))
            reset_context()
            steps.append(logits.float().log_softmax(-1))
    finally:
        runner.enforce_eager = was_eager
        for seq in seqs:
            bm.deallocate(seq)
    return torch.stack(steps, 1)                   # [batch, 1 + num_forced, vocab]


@torch.inference_mode()
def hf_forced_logprobs(hf, prompts, continuations, num_forced=NUM_FORCED):
    """transformers' log-probs at the same positions: the last prompt token's and each forced token's."""
    rows = []
    for prompt, cont in zip(prompts, continuations):
        ids = torch.tensor([prompt + cont[:num_forced]], device=next(hf.parameters()).device)
        logits = hf(input_ids=ids).logits[0, len(prompt) - 1:].float()
        rows.append(logits.log_softmax(-1))
    return torch.stack(rows)


def compare(ours, reference, margin=TIE_MARGIN) -> dict:
    """How two runs' log-probs agree: the share of decided positions (reference's top-1 leads by more than
    `margin`), top-1 agreement on them, the largest and 99th-percentile gap of the reference top-1's
    log-prob, and mean KL."""
    top2 = reference.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > margin
    same_top1 = ours.argmax(-1) == reference.argmax(-1)
    their_top = reference.argmax(-1, keepdim=True)
    top_diff = (ours.gather(-1, their_top) - reference.gather(-1, their_top)).abs().flatten().float()
    return dict(decided=decided.float().mean().item(),
                agreement=same_top1[decided].sum().item() / max(1, decided.sum().item()),
                top_logprob_diff=top_diff.max().item(), top_logprob_diff_p99=top_diff.quantile(0.99).item(),
                kl=F.kl_div(ours, reference, log_target=True, reduction="none").sum(-1).mean().item())
