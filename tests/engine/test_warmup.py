"""The start-up warm-up's verification pass (speculative decoding), run on CPU: it samples the most rows a
verification step can hold, with every costly option, so that on a GPU their memory is in the peak the KV
cache's sizing leaves room for."""
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine import warmup
from nanovllm.sampling_params import MAX_LOGPROBS

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.cpu_only]     # the engine is device="cpu"

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "adaptive": False}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens, rows", [(8, 512, 8 * 4), (64, 100, 25 * 4)])
def test_the_verification_warm_up_samples_a_full_step(tiny_model, make_checkpoint, monkeypatch, method, max_num_seqs,
                                                       max_num_batched_tokens, rows):
    """With a draft model the pass weighs the drafts with laws q of every row, as a sampled step does."""
    spec = SPEC if method == "ngram" else {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False,
                                           "model": str(make_checkpoint(num_hidden_layers=1, seed=5))}
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16, max_model_len=64, num_kvcache_blocks=32,
             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
             speculative_config=spec) as llm:
        runner = llm.model_runner
        seen = []
        sample = runner.rejection_sampler.forward
        monkeypatch.setattr(runner.rejection_sampler, "forward",
                            lambda logits, tensors, draft_rows, draft_probs=None:
                            seen.append((logits.shape, tensors, draft_rows, draft_probs))
                            or sample(logits, tensors, draft_rows, draft_probs))
        warmup.warmup_verify(runner)
        (shape, tensors, draft_rows, draft_probs), = seen
        # as many sequences as the step holds (max_num_seqs, or the token budget over 1 + k rows each)
        assert shape == (rows, llm.config.hf_config.vocab_size)
        assert draft_rows.seq_of_row.numel() == rows
        assert (draft_probs is None) == (method == "ngram")
        assert draft_probs is None or draft_probs.shape == shape
        assert tensors.penalties is not None and tensors.penalties.rows.numel() == rows    # every row penalized
        assert tensors.max_logprobs == MAX_LOGPROBS and tensors.top_k is not None
        assert not runner.penalty_state.rows          # the pass's state rows are free again
        out = llm.generate([[1, 2, 3, 1, 2, 3, 1, 2]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        assert len(out[0]["token_ids"]) == 8 and llm.is_finished()
