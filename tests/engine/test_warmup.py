"""The start-up warm-up, run on CPU: the verification pass (speculative decoding) samples the most rows a
verification step can hold, with every costly option, so that on a GPU their memory is in the peak the KV
cache's sizing leaves room for; the cached paths' pass decodes a lone sequence and a large batch."""
import pytest
import torch
import torch.distributed as dist

from nanovllm import LLM, SamplingParams
from nanovllm.engine import warmup
from nanovllm.kernels.decode_attention import large_batch
from nanovllm.sampling_params import MAX_LOGPROBS
from groupings import record_groupings

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


@pytest.mark.parametrize("max_num_seqs, large", [(64, True), (4, False)])
@pytest.mark.parametrize("unsplit", [None, 3])
def test_the_cached_paths_warm_up_also_decodes_a_large_batch(tiny_model, monkeypatch, max_num_seqs, large, unsplit):
    """Besides a lone sequence's eager decode, one of the fewest sequences whose step takes decode attention's
    large-batch tiles (decode_attention.large_batch: on a GPU the other compiled kernel), where a step can
    hold that many, and before it, where there is one (a bf16 cache on a GPU: unsplit here, as on a GPU), one
    of the fewest whose small-batch tiles read unsplit (decode_attention.unsplit_batch); the engine serves
    requests after them as before."""
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16, max_model_len=64, num_kvcache_blocks=32,
             max_num_seqs=max_num_seqs) as llm:
        runner = llm.model_runner
        decodes = _record_decode_batches(runner, monkeypatch)
        monkeypatch.setattr(warmup, "unsplit_batch", lambda *args: unsplit)
        warmup.warmup_cached_paths(runner)
        first = large_batch(llm.config.hf_config.num_key_value_heads, runner.device, llm.config.kv_cache_dtype)
        assert first <= 64 and decodes == [1] + ([unsplit] if unsplit else []) + ([first] if large else [])
        out = llm.generate([[1, 2, 3, 4]] * 3, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        assert all(len(o["token_ids"]) == 4 for o in out)


@pytest.mark.parametrize("unsplit", [None, 3])
def test_tensor_parallel_ranks_warm_up_the_same_large_batch(tiny_model, monkeypatch, unsplit):
    """Ranks agree on the large batch and on the unsplit one (the most any of them needs: GPUs with other SM
    counts differ), so that every rank runs the same steps and their collectives pair up."""
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16, max_model_len=64, num_kvcache_blocks=32,
             max_num_seqs=64) as llm:
        runner = llm.model_runner
        decodes = _record_decode_batches(runner, monkeypatch)
        asked = []

        def all_reduce(x, op=dist.ReduceOp.SUM):
            if op != dist.ReduceOp.MAX:         # the model's own (one rank in truth: nothing to add)
                return x
            asked.append((x.item(), op))
            return torch.tensor([20])           # another rank's count

        monkeypatch.setattr(runner, "world_size", 2)
        monkeypatch.setattr(runner.tp, "all_reduce", all_reduce)
        monkeypatch.setattr(warmup, "unsplit_batch", lambda *args: unsplit)
        warmup.warmup_cached_paths(runner)
        kv_heads = llm.config.hf_config.num_key_value_heads // 2
        large = (large_batch(kv_heads, runner.device, llm.config.kv_cache_dtype), dist.ReduceOp.MAX)
        assert asked == ([(unsplit, dist.ReduceOp.MAX)] if unsplit else []) + [large]
        assert decodes == ([1, 20, 20] if unsplit else [1, 20])


def test_where_rows_may_share_pages_warm_up_decodes_each_batch_both_ways(tiny_model, monkeypatch):
    """A backend that reads shared pages once for a group (ours on a GPU): warm-up's decode batches run as they
    come and with their shared first page grouped, two rows grouped as well; the runner's setting is left as
    it was."""
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16, max_model_len=64, num_kvcache_blocks=32,
             max_num_seqs=64) as llm:
        runner = llm.model_runner
        monkeypatch.setattr(runner, "share_prefixes", True)
        decodes = _record_decode_batches(runner, monkeypatch)
        grouped = record_groupings(monkeypatch)
        monkeypatch.setattr(warmup, "unsplit_batch", lambda *args: 3)
        warmup.warmup_cached_paths(runner)
        large = large_batch(llm.config.hf_config.num_key_value_heads, runner.device, llm.config.kv_cache_dtype)
        assert decodes == [1, 2, 3, 3, large, large]
        assert [None if g is None else g[0].tolist() for g in grouped] == [[16] * n for n in (2, 3, large)]
        assert runner.share_prefixes is True


def _record_decode_batches(runner, monkeypatch) -> list[int]:
    """The batch sizes of the decode steps runner.run is given from now on."""
    decodes = []
    run = runner.run
    monkeypatch.setattr(runner, "run", lambda seqs, is_prefill, *a, **kw:
                        (is_prefill or decodes.append(len(seqs))) and None or run(seqs, is_prefill, *a, **kw))
    return decodes
