"""Programmatic dependent launch (nanovllm.kernels.dependent_launch): which launches ask for it, and that a
decode layer's chain of kernels, each starting before the one it reads from has finished, computes exactly what
the same kernels launched one after another compute, replay after replay of a CUDA graph."""
import pytest
import torch

from nanovllm.kernels import dependent_launch
from nanovllm.kernels.decode_attention import flash_attn_with_kvcache
from nanovllm.kernels.fp8_activations import rms_norm_quant, silu_and_mul_quant
from nanovllm.kernels.pointwise import rms_norm, silu_and_mul
from nanovllm.kernels.rotary import rotate_qk
from nanovllm.kernels.skinny_gemm import gemv, skinny_gemm

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_plain_launches_off_the_gpu():
    """The CPU (Triton's interpreter) never sees the option."""
    with dependent_launch.dependent_launches(True):
        assert dependent_launch.pdl_options(torch.device("cpu")) == {}


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs a Hopper (or later) GPU")
def test_only_launches_inside_the_switch_ask_for_it(monkeypatch):
    """Eager launches are plain (one compiled variant each, the one start-up compiles); inside
    dependent_launches(True) they ask for it, unless the module is switched off (benchmarks' baseline)."""
    cuda = torch.device("cuda")
    assert dependent_launch.pdl_options(cuda) == {}
    with dependent_launch.dependent_launches(True):
        assert dependent_launch.pdl_options(cuda) == {"PDL": True, "launch_pdl": True}
        with dependent_launch.dependent_launches(False):
            assert dependent_launch.pdl_options(cuda) == {}
        assert dependent_launch.pdl_options(cuda) == {"PDL": True, "launch_pdl": True}
    assert dependent_launch.pdl_options(cuda) == {}
    monkeypatch.setattr(dependent_launch, "ENABLED", False)
    with dependent_launch.dependent_launches(True):
        assert dependent_launch.pdl_options(cuda) == {}


def test_decode_graphs_of_few_rows_are_captured_with_dependent_launches(monkeypatch):
    """CudaGraphs switches them on while it captures its decode buckets of up to MAX_ROWS sequences, and only
    then (recorded here in place of each capture)."""
    from nanovllm.engine.cuda_graphs import CudaGraphs

    switched_on = {}
    monkeypatch.setattr(CudaGraphs, "_capture",
                        lambda self, rows, with_logits=False: switched_on.setdefault(rows, dependent_launch._active))
    graphs = CudaGraphs(None, max_decode_rows=64, max_num_blocks=4, prefill_lengths=[48], hidden_size=8,
                        dtype=torch.float32, device=torch.device("cpu"))
    graphs.capture()
    assert switched_on == {48: False} | {bs: bs <= dependent_launch.MAX_ROWS for bs in graphs.decode_sizes}
    assert any(switched_on.values()) and not all(switched_on.values())
    assert not dependent_launch._active


def decode_layer(hidden, residual, w):
    """One FP8-less and one FP8 decode layer's kernels in a row, each reading what the one before wrote: norm,
    GEMV (one row) or skinny GEMM (rows), rotary with the K/V store, paged decode attention (split, so its
    reduce runs), GEMV, norm with the residual, gate/up, SiLU, down; then the FP8 activation kernels."""
    rows = hidden.shape[0]
    linear = gemv if rows == 1 else skinny_gemm
    x = rms_norm(hidden, w["norm"], 1e-6)
    qkv = linear(x, w["qkv"])
    q, k, v = qkv.split([w["heads"] * 128, 128, 128], dim=-1)
    q, k = rotate_qk(w["positions"][:rows], q.view(rows, -1, 128), k.view(rows, 1, 128), w["cos_sin"],
                     value=v.reshape(rows, 1, 128), k_cache=w["k_cache"], v_cache=w["v_cache"],
                     slot_mapping=w["slots"][:rows])
    attn = flash_attn_with_kvcache(q.unsqueeze(1), w["k_cache"], w["v_cache"], w["seqlens"][:rows],
                                   w["block_table"][:rows]).view(rows, -1)
    x, residual = rms_norm(linear(attn, w["o"]), w["norm"], 1e-6, residual=residual)
    x = linear(silu_and_mul(linear(x, w["gate_up"])), w["down"])
    q8, scale, residual = rms_norm_quant(x, w["norm"], 1e-6, residual=residual)
    g8, g_scale = silu_and_mul_quant(torch.cat([x, x], dim=-1))
    return x + q8.float().to(x.dtype) * scale[:, None].to(x.dtype) + g8.float().to(x.dtype), residual


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs a Hopper (or later) GPU")
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_a_layer_in_a_graph_matches_plain_launches_every_replay(rows):
    """Inputs change before every replay: a kernel that read its input before its producer had finished would
    see the previous replay's values, and the outputs would differ from plain launches'."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    hidden_size, heads, page, pages = 1024, 4, 16, 32
    randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    angles = torch.rand(64, 64, generator=gen, device="cuda")
    w = dict(norm=randn(hidden_size) + 1, qkv=randn((heads + 2) * 128, hidden_size) * 0.03, heads=heads,
             o=randn(hidden_size, heads * 128) * 0.03, gate_up=randn(2 * 2048, hidden_size) * 0.03,
             down=randn(hidden_size, 2048) * 0.03, cos_sin=torch.cat([angles.cos(), angles.sin()], dim=1),
             k_cache=randn(rows * pages, page, 1, 128), v_cache=randn(rows * pages, page, 1, 128),
             positions=torch.full((rows,), 40, device="cuda"),
             slots=torch.arange(rows, device="cuda", dtype=torch.int32) * pages * page + 40,
             seqlens=torch.full((rows,), 41, device="cuda", dtype=torch.int32),
             block_table=torch.arange(rows * pages, device="cuda", dtype=torch.int32).view(rows, pages))
    static_hidden, static_residual = randn(rows, hidden_size), randn(rows, hidden_size)
    with dependent_launch.dependent_launches(True):
        decode_layer(static_hidden, static_residual, w)      # compiles the PDL variants outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out, static_res_out = decode_layer(static_hidden, static_residual, w)
    for replay in range(20):
        hidden, residual = randn(rows, hidden_size), randn(rows, hidden_size)
        static_hidden.copy_(hidden)
        static_residual.copy_(residual)
        graph.replay()
        expected_out, expected_res = decode_layer(hidden, residual, w)
        torch.testing.assert_close(static_out, expected_out, rtol=0, atol=0, msg=f"replay {replay}")
        torch.testing.assert_close(static_res_out, expected_res, rtol=0, atol=0, msg=f"replay {replay}")
