"""CUDA graph buckets (the graphs themselves are compared with eager runs in test_gpu.py)."""
from types import SimpleNamespace

from nanovllm.engine.cuda_graphs import cuda_graph_batch_sizes, decode_graph_rows, prefill_graph_lengths
from nanovllm.engine.spec_decode import SpeculativeDecoding


def test_decode_batch_buckets_hold_the_largest_batch_up_to_512():
    assert cuda_graph_batch_sizes(512) == [1, 2, 4, 8] + list(range(16, 513, 16))
    assert cuda_graph_batch_sizes(1000)[-1] == 512
    assert cuda_graph_batch_sizes(20) == [1, 2, 4, 8, 16, 32]
    assert cuda_graph_batch_sizes(3) == [1, 2, 4]
    assert cuda_graph_batch_sizes(1) == [1]


def test_a_verification_step_fits_the_largest_decode_graph():
    """Speculative decoding's verification is a decode step of k + 1 rows a sequence: the graphs are
    captured for max_num_seqs * (k + 1) rows, and the drafts of a step are cut to the largest graph's rows
    (more would run eagerly)."""
    assert decode_graph_rows(256) == 256 and decode_graph_rows(1, 4) == 5
    assert cuda_graph_batch_sizes(decode_graph_rows(1, 4))[-1] == 8

    def max_rows(**options):
        spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                "adaptive": True}
        config = SimpleNamespace(**{"speculative_config": spec, "max_model_len": 4096, "max_num_batched_tokens": 8192,
                                    "enforce_eager": False, "device": "cuda", "max_num_seqs": 256, **options})
        return SpeculativeDecoding(config, SimpleNamespace(block_manager=None)).max_rows
    assert max_rows() == 512
    assert max_rows(max_num_seqs=1) == 8
    assert max_rows(max_num_seqs=1, max_num_batched_tokens=4) == 4    # and to the step's token budget
    assert max_rows(enforce_eager=True) == max_rows(device="cpu") == 8192


def test_lone_prompt_prefill_buckets_stay_within_the_step_and_model_limits():
    assert prefill_graph_lengths(16384, 16384) == [64, 128, 256, 512, 1024, 2048]
    assert prefill_graph_lengths(16384, 1000) == [64, 128, 256, 512]
    assert prefill_graph_lengths(300, 4096) == [64, 128, 256]
    assert prefill_graph_lengths(32, 4096) == []


def test_every_replay_hands_decode_attention_a_permutation_of_its_bucket():
    """The graphs' decode_order buffer: the step's order first, the padding rows after it in place, whatever
    larger step wrote before (a verification's rows, a batch shrinking and growing); a lone sequence writes
    nothing (its order is [0])."""
    import torch

    from nanovllm.engine.cuda_graphs import CudaGraphs
    graphs = CudaGraphs(None, 16, 4, [], 8, torch.float32, torch.device("cpu"))
    buffer = graphs.vars["decode_order"]
    steps = [(5, [4, 2, 0, 1, 3]), (3, [1, 0, 2]), (1, [0]), (7, None), (12, list(range(11, -1, -1))), (2, [1, 0]),
             (9, [8, 0, 1, 2, 3, 4, 5, 6, 7]), (1, [0])]
    for bs, order in steps:
        graphs._decode_order(bs, None if order is None else torch.tensor(order, dtype=torch.int32))
        expected = (order or list(range(bs))) + list(range(bs, 16))
        assert buffer.tolist() == expected, (bs, order)
