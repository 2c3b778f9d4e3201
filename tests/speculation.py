"""What the speculative-decoding tests share (tests/engine/test_spec_decode*.py): a CPU engine with a small
paged cache, the prompts and greedy settings they share, the outputs' token lists, the draft counts, greedy runs
that draft every step, a run checked step by step, the idle check, the law tests' run, and the seeded-repeat
specification of a drafter whose draws are random (a draft model, an EAGLE-3 head)."""
from nanovllm import LLM, SamplingParams
from block_invariants import check_invariants
from mixed_batch import assert_mixed_outputs

BLOCK = 16
VOCAB = 512                 # the test checkpoints' (make_checkpoint's default)
# prompts that repeat themselves (n-gram lookup finds drafts in them; a drafter meets its easy case)
REPEATING = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 8 + [14], [40, 41] * 10, [300 + i % 7 for i in range(33)]]
MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def engine(model, spec: dict | None = None, **kwargs) -> LLM:
    settings = dict(device="cpu", kvcache_block_size=BLOCK, max_model_len=256, num_kvcache_blocks=96)
    return LLM(str(model), speculative_config=spec, **{**settings, **kwargs})


def tokens(outputs: list[dict]) -> list[list[list[int]]]:
    return [[c["token_ids"] for c in out["outputs"]] for out in outputs]


def assert_idle(llm: LLM) -> None:
    assert llm.is_finished() and not llm.scheduler.block_manager.used_block_ids


def drafted(llm: LLM, before: dict) -> tuple[int, int, int]:
    """(drafts, draft tokens, accepted tokens) since `before` (an earlier llm.stats)."""
    stats = llm.stats
    return tuple(stats[key] - before[key] for key in
                 ("spec_decode_num_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens"))


def greedy_drafting_every_step(llm: LLM, k: int, prompts: list[list[int]], greedy_reference: list[dict]
                               ) -> tuple[int, int]:
    """Greedy completions of `prompts` are plain decoding's tokens, and every decode step with room for a draft
    speculates (a sequence gains at most k + 1 tokens a step, and has room while it lacks 2 or more); returns
    (draft tokens, accepted tokens)."""
    before = llm.stats
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outputs) == tokens(greedy_reference)
    num_drafts, num_draft, num_accepted = drafted(llm, before)
    assert num_drafts >= len(prompts) * -(-(MAX_TOKENS - 2) // (k + 1))
    assert num_drafts <= num_draft <= k * num_drafts
    return num_draft, num_accepted


def completions_step_by_step(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Each prompt's completion, the engine driven one step at a time and checked after every step: the block
    manager's invariants (block_invariants), and no block reserved for drafts outliving its step."""
    scheduler = llm.scheduler
    ids = [llm.add_request(prompt, params) for prompt in prompts]
    completions = {}
    while not llm.is_finished():
        finished, _ = llm.step()
        completions.update(finished)
        live = [*scheduler.waiting, *scheduler.running, *scheduler.finishing]
        check_invariants(scheduler.block_manager, live)
        assert all(len(seq.block_table) <= seq.num_blocks for seq in live)
    return [completions[i] for i in ids]


def law_completions(model, spec: dict, prompt: list[int], params: list[SamplingParams],
                    num: int) -> tuple[list[list[int]], dict]:
    """The law tests' run: one request of `prompt` per params, `num` completions in all, all in one batch;
    every completion and the engine's stats, the engine left idle."""
    with engine(model, spec, max_num_seqs=num, num_kvcache_blocks=num + 16) as llm:
        outputs = tokens(llm.generate([prompt] * len(params), params, use_tqdm=False))
        stats = llm.stats
        assert_idle(llm)
    completions = [completion for output in outputs for completion in output]
    assert len(completions) == num
    return completions, stats


def assert_seeded_draws_repeat(model, spec: dict, prompts: list[list[int]]) -> None:
    """Two engines of the same configuration, the same seeds: the same tokens (the drafter's draws, the
    acceptance tests and the residual draws are all the request's); other seeds: other tokens, and a
    request's two completions draw apart."""
    def params(seed: int) -> list[SamplingParams]:
        return [SamplingParams(n=2, temperature=0.8, seed=seed + i, max_tokens=24, ignore_eos=True)
                for i in range(len(prompts))]
    with engine(model, spec) as llm:
        first = tokens(llm.generate(prompts, params(100), use_tqdm=False))
        other = tokens(llm.generate(prompts, params(200), use_tqdm=False))
        stats = llm.stats
        assert 0 < stats["spec_decode_accepted_tokens"] < stats["spec_decode_draft_tokens"]
        assert_idle(llm)
    with engine(model, spec) as llm:
        assert tokens(llm.generate(prompts, params(100), use_tqdm=False)) == first
    pairs = [(a, b) for request_a, request_b in zip(first, other) for a, b in zip(request_a, request_b)]
    assert sum(a != b for a, b in pairs) >= len(pairs) - 1
    assert sum(a != b for a, b in first) >= len(first) - 1


def assert_a_mixed_batch_ends_as_plain_decoding(model, spec: dict, prompts: list[list[int]]) -> dict:
    """What users mix, in one batch with a drafter: greedy requests ending on a stop string (their text and
    tokens plain decoding's), sampled n = 3 requests whose completions end at different steps (stop token ids
    over a tenth of the vocabulary, varied max_tokens), and a request aborted mid-run; every request ends,
    nothing hangs, and afterwards no block is held. Returns the speculating engine's llm.stats."""
    with engine(model) as llm:
        vocab = llm.config.hf_config.vocab_size
        free = llm.generate(prompts[:3], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                            use_tqdm=False)
        # each stop string two characters from the middle of what plain decoding writes: it ends mid-run
        middles = [out["text"][len(out["text"]) // 2:][:2] for out in free]
        greedy = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[m] if m.strip() else None)
                  for m in middles]
        plain = llm.generate(prompts[:3], greedy, use_tqdm=False)
    assert any(out["finish_reason"] == "stop" for out in plain)
    stops = list(range(7, vocab, 10))
    sampled = [SamplingParams(n=3, temperature=1.0, seed=60 + i, max_tokens=8 + 6 * i, stop_token_ids=stops)
               for i in range(3)]
    with engine(model, spec) as llm:
        aborted = llm.add_request(prompts[3], SamplingParams(temperature=0.8, max_tokens=200, ignore_eos=True))
        for _ in range(3):
            llm.step()
        llm.abort_request(aborted)
        outputs = llm.generate(prompts[:3] + prompts[:3], greedy + sampled, use_tqdm=False)
        stats = llm.stats
        assert stats["spec_decode_draft_tokens"] > 0
        assert_idle(llm)
    assert_mixed_outputs(outputs[:3], plain, outputs[3:], sampled)
    return stats
