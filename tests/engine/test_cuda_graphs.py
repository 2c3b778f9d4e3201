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


def test_shared_prefix_graphs_cover_every_bucket_from_8_rows():
    """The buckets with a second graph whose attention reads shared pages once: 8, 16, 32, then multiples of
    64 and the largest bucket, so a step of 8 rows or more always finds one that holds it."""
    from nanovllm.engine.cuda_graphs import shared_prefix_batch_sizes
    assert shared_prefix_batch_sizes(cuda_graph_batch_sizes(512)) == [8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert shared_prefix_batch_sizes(cuda_graph_batch_sizes(100)) == [8, 16, 32, 64, 112]
    assert shared_prefix_batch_sizes(cuda_graph_batch_sizes(4)) == []


def test_every_shared_prefix_replay_leaves_no_group_of_an_earlier_step_behind():
    """The graphs' shared-prefix buffers after each step: the step's groups, and past them rows that share
    nothing (0 tokens) and items of no rows, whatever a larger step wrote before; a step without groups
    clears what the last one wrote (a shared-prefix graph may replay next with fewer)."""
    import torch

    from nanovllm.engine.cuda_graphs import CudaGraphs
    graphs = CudaGraphs(None, 32, 4, [], 8, torch.float32, torch.device("cpu"), shared_prefixes=True)
    v = graphs.vars
    as_int32 = lambda rows: torch.tensor(rows, dtype=torch.int32)
    steps = [(as_int32([32] * 12), as_int32([[0, 0, 6], [6, 6, 6]]), as_int32(range(12))),
             (as_int32([16, 16, 0, 16]), as_int32([[0, 0, 3]]), as_int32([0, 1, 3])),
             None,
             (as_int32([48] * 30), as_int32([[0, 0, 15], [15, 15, 15]]), as_int32(range(30)))]
    for shared in steps:
        graphs._shared_prefix(shared)
        num_rows, num_items = (0, 0) if shared is None else (len(shared[0]), len(shared[1]))
        assert v["shared_lens"][:num_rows].tolist() == ([] if shared is None else shared[0].tolist())
        assert not v["shared_lens"][num_rows:].any() and not v["shared_items"][num_items:].any()
        if shared is not None:
            assert torch.equal(v["shared_items"][:num_items], shared[1])
            assert torch.equal(v["shared_members"][:len(shared[2])], shared[2])
