"""The model's-dtype GEMM (nanovllm.layers.quantization.unquantized.dense_linear): which kernel a call takes, and
that every path computes x @ W^T + b."""
import os

import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels import skinny_gemm
from nanovllm.layers.quantization import unquantized
from nanovllm.layers.quantization.unquantized import LT_ROWS, dense_linear

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


class _FakeBlasSwitch:
    """torch's process-wide preferred-BLAS switch, recorded (a CPU build cannot select cuBLASLt)."""

    def __init__(self, monkeypatch, fail: bool = False):
        self.backend, self.seen_by_linear, self.fail = "cublas", [], fail
        monkeypatch.setattr(torch._C, "_get_blas_preferred_backend", lambda: self.backend)
        monkeypatch.setattr(torch._C, "_set_blas_preferred_backend", self.set)
        linear = F.linear
        monkeypatch.setattr(unquantized.F, "linear", lambda *a: self.seen_by_linear.append(self.backend) or linear(*a))

    def set(self, backend):
        if self.fail and backend == torch._C._BlasBackend.Cublaslt:
            raise RuntimeError("Cannot set preferred backend to cuBLASLt if PyTorch has not been compiled with cuBLASLt.")
        self.backend = backend


def test_cublaslt_is_chosen_for_the_call_only_and_restored(monkeypatch):
    """The GEMM runs under cuBLASLt and the caller's choice comes back, also when the GEMM raises."""
    switch = _FakeBlasSwitch(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 64, generator=gen), torch.randn(48, 64, generator=gen)
    assert torch.equal(unquantized._linear_through_cublaslt(x, w, None), x @ w.T)
    assert switch.seen_by_linear == [torch._C._BlasBackend.Cublaslt] and switch.backend == "cublas"
    with pytest.raises(RuntimeError):
        unquantized._linear_through_cublaslt(x, torch.randn(48, 63), None)     # shapes that do not multiply
    assert switch.backend == "cublas"


def test_the_first_switch_in_a_process_says_nothing_on_stderr(monkeypatch, capfd):
    """torch's C++ writes a warning to stderr the first time a process selects cuBLASLt: the engine mutes that
    one call (the switch is its own doing) and nothing else."""
    switch = _FakeBlasSwitch(monkeypatch)
    set_backend = switch.set
    warn = lambda backend: backend == torch._C._BlasBackend.Cublaslt and os.write(2, b"torch: experimental\n")
    switch.set = lambda backend: warn(backend) or set_backend(backend)
    monkeypatch.setattr(torch._C, "_set_blas_preferred_backend", switch.set)
    monkeypatch.setattr(unquantized, "_switched_before", False)
    x, w = torch.ones(32, 8), torch.ones(4, 8)
    unquantized._linear_through_cublaslt(x, w, None)
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"
    unquantized._linear_through_cublaslt(x, w, None)        # later switches are not muted (torch is silent then)
    assert capfd.readouterr().err == "torch: experimental\n"
    assert switch.backend == "cublas"


def test_a_torch_without_cublaslt_runs_the_plain_linear(monkeypatch):
    """Where torch refuses cuBLASLt, the GEMM runs as before, and later calls do not ask again."""
    switch = _FakeBlasSwitch(monkeypatch, fail=True)
    asked = []
    monkeypatch.setattr(unquantized, "_select_cublaslt", lambda: asked.append(1) or switch.set(torch._C._BlasBackend.Cublaslt))
    monkeypatch.setattr(unquantized, "_BLAS", unquantized._BLAS)
    x, w = torch.ones(32, 8), torch.ones(4, 8)
    for _ in range(2):
        assert torch.equal(unquantized._linear_through_cublaslt(x, w, None), torch.full((32, 4), 8.0))
    assert switch.seen_by_linear == ["cublas", "cublas"] and switch.backend == "cublas" and len(asked) == 1


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [LT_ROWS[0] - 1, LT_ROWS[0], 96, LT_ROWS[1], LT_ROWS[1] + 1])
def test_cublaslt_takes_the_decode_batches_rows_on_a_gpu(rows, monkeypatch):
    """17-256 rows (decode steps of many sequences) run through cuBLASLt, fewer and more through cuBLAS; the
    product is x @ W^T within bf16's rounding, and torch's switch is as it was."""
    taken = []
    lt = unquantized._linear_through_cublaslt
    monkeypatch.setattr(unquantized, "_linear_through_cublaslt", lambda *a: taken.append(rows) or lt(*a))
    before = torch._C._get_blas_preferred_backend()
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 2048, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(3000, 2048, generator=gen, device="cuda") * 0.03).bfloat16()
    out = dense_linear(x, w, None)
    assert taken == ([rows] if LT_ROWS[0] <= rows <= LT_ROWS[1] else [])
    assert torch._C._get_blas_preferred_backend() == before
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, rtol=1.6e-2, atol=1e-2)
