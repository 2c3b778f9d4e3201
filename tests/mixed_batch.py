"""What a batch that mixes what users mix must give (the speculative-decoding and prefix-cache mix tests)."""
from nanovllm import SamplingParams


def assert_mixed_outputs(greedy_outputs: list[dict], expected: list[dict], sampled_outputs: list[dict],
                         sampled: list[SamplingParams]) -> None:
    """Greedy requests (ending on stop strings) end as the reference engine's: text, tokens, finish reason;
    each sampled n = 3 request has its three completions, each ended by a stop token or its length, and the
    completions ended at different steps."""
    for out, ref in zip(greedy_outputs, expected, strict=True):
        assert (out["text"], out["token_ids"], out["finish_reason"]) == \
            (ref["text"], ref["token_ids"], ref["finish_reason"])
    lengths = set()
    for out, params in zip(sampled_outputs, sampled, strict=True):
        assert len(out["outputs"]) == 3
        for completion in out["outputs"]:
            assert completion["finish_reason"] in ("stop", "length")
            assert len(completion["token_ids"]) <= params.max_tokens
            lengths.add(len(completion["token_ids"]))
    assert len(lengths) > 1         # the completions ended at different steps
