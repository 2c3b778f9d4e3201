"""CUDA graph buckets (the graphs themselves are compared with eager runs in test_gpu.py)."""
from nanovllm.engine.cuda_graphs import cuda_graph_batch_sizes, prefill_graph_lengths


def test_decode_batch_buckets():
    assert cuda_graph_batch_sizes(512) == [1, 2, 4, 8] + list(range(16, 513, 16))
    assert cuda_graph_batch_sizes(1000)[-1] == 512
    assert cuda_graph_batch_sizes(20) == [1, 2, 4, 8, 16]
    assert cuda_graph_batch_sizes(3) == [1, 2]


def test_lone_prompt_prefill_buckets_stay_within_the_step_and_model_limits():
    assert prefill_graph_lengths(16384, 16384) == [64, 128, 256, 512, 1024, 2048]
    assert prefill_graph_lengths(16384, 1000) == [64, 128, 256, 512]
    assert prefill_graph_lengths(300, 4096) == [64, 128, 256]
    assert prefill_graph_lengths(32, 4096) == []
