"""The model's-dtype GEMM (nanovllm.layers.quantization.unquantized.dense_linear): which kernel a call takes, and
that every path computes x @ W^T + b."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels import skinny_gemm
from nanovllm.layers.quantization.unquantized import dense_linear

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("rows", [1, 3])
def test_the_cpu_runs_torchs_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 64, generator=gen), torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    assert torch.equal(dense_linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(dense_linear(x, w, b, skinny_gemm.CONFIGS), F.linear(x, w, b))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows, tables", [(1, None), (1, skinny_gemm.CONFIGS), (2, None), (2, skinny_gemm.CONFIGS),
                                          (64, skinny_gemm.CONFIGS)])
def test_one_row_streams_through_the_gemv_on_a_gpu(rows, tables, with_bias, monkeypatch):
    """One row (a lone sequence's decode step, a decoder projection or the LM head) takes the GEMV; more rows
    take the skinny GEMM where the caller passes its tiles, else cuBLAS; all within bf16's rounding of a
    float32 product. Leading dimensions are kept."""
    taken = []
    for name in ("gemv", "skinny_gemm"):
        kernel = getattr(skinny_gemm, name)
        monkeypatch.setattr(skinny_gemm, name, lambda *a, _k=kernel, _n=name, **kw: taken.append(_n) or _k(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 1, 2048, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(3000, 2048, generator=gen, device="cuda") * 0.03).bfloat16()
    b = torch.randn(3000, generator=gen, device="cuda").bfloat16() if with_bias else None
    out = dense_linear(x, w, b, tables)
    expected_kernel = "gemv" if rows == 1 else "skinny_gemm" if tables and skinny_gemm.choose_config(rows, tables) \
        else None
    assert taken == ([expected_kernel] if expected_kernel else [])
    assert out.shape == (rows, 1, 3000) and out.dtype == torch.bfloat16
    reference = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(out.float(), reference, rtol=1.6e-2, atol=1e-2)
