"""SamplingParams(prompt_logprobs=k): output["prompt_logprobs"] is vLLM's list, None for the first prompt
token, then per token {token id: log-prob} holding the token itself and the k most likely, from the raw
logits: equal to transformers' log-softmax of the same checkpoint, whatever the chunking, the prefix
cache or n."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from oracle import load_hf_model, random_prompts

pytestmark = pytest.mark.cpu_only     # every engine is device="cpu"


@pytest.fixture(scope="module")
def reference(tiny_model):
    hf = load_hf_model(tiny_model)
    prompts = random_prompts(3, 512, (2, 45), seed=3)

    @torch.inference_mode()
    def logprobs(prompt):
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return prompts, [logprobs(p) for p in prompts]


def check(output, prompt, expected, k):
    entries = output["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        row = expected[j - 1]                   # position j - 1 predicts token j
        assert abs(entries[j][prompt[j]] - row[prompt[j]].item()) < 1e-4
        top = row.topk(k).indices.tolist() if k else []
        assert set(entries[j]) == set(top) | {prompt[j]}
        for token_id, logprob in entries[j].items():
            assert abs(logprob - row[token_id].item()) < 1e-4


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_transformers_in_chunks_and_after_cache_hits(tiny_model, reference, k):
    prompts, expected = reference
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k)
    # a 16-token step budget and 16-token blocks: prompts go in chunks, and the second round's full
    # blocks are in the prefix cache (which a request wanting its prompt's log-probs must not skip)
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16, max_num_batched_tokens=16) as llm:
        first = llm.generate(prompts, params, use_tqdm=False)
        plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        second = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k, n=2),
                              use_tqdm=False)
        assert llm.stats["num_prefix_cache_hit_tokens"] > 0
    for prompt, ref, out, again, without in zip(prompts, expected, first, second, plain):
        check(out, prompt, ref, k)
        check(again, prompt, ref, k)
        assert without["prompt_logprobs"] is None
        assert out["token_ids"] == without["token_ids"] == again["outputs"][1]["token_ids"]


def test_prompt_logprobs_are_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(TypeError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1.5)
