"""What the speculative-decoding tests share (tests/engine/test_spec_decode*.py): a CPU engine with a small
paged cache, the outputs' token lists, the idle check, and the seeded-repeat specification of a drafter whose
draws are random (a draft model, an EAGLE-3 head)."""
from nanovllm import LLM, SamplingParams

BLOCK = 16


def engine(model, spec: dict | None = None, **kwargs) -> LLM:
    settings = dict(device="cpu", kvcache_block_size=BLOCK, max_model_len=256, num_kvcache_blocks=96)
    return LLM(str(model), speculative_config=spec, **{**settings, **kwargs})


def tokens(outputs: list[dict]) -> list[list[list[int]]]:
    return [[c["token_ids"] for c in out["outputs"]] for out in outputs]


def assert_idle(llm: LLM) -> None:
    assert llm.is_finished() and not llm.scheduler.block_manager.used_block_ids


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
