"""Structured outputs' token masks on the logits: the Triton kernel (interpreter on CPU, the full Qwen3
vocabulary on CUDA) and its torch version against a bit-by-bit definition and against xgrammar's own
apply_token_bitmask_inplace, which reads the same layout."""
import pytest
import torch

from nanovllm.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
VOCABS = [1000, 151936] if CUDA else [77, 1000]     # 77: the last word only partly used


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1                 # everything allowed
    if rows > 1:
        bitmask[1] = 0              # nothing allowed
        bitmask[1, 0] = 1 << 3      # but token 3
    return bitmask


def definition(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Token t of batch row rows[i] survives iff bit t % 32 of word t // 32 of bitmask[i] is set."""
    out = logits.clone()
    for i, row in enumerate(rows.tolist()):
        for t in range(logits.size(1)):
            word = int(bitmask[i, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_and_torch_mask_exactly_the_tokens_whose_bits_are_clear(vocab, dtype):
    batch = 6
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32)       # masked rows in any order; rows 1, 3, 5 untouched
    bitmask = random_bitmask(len(rows), vocab, seed=vocab)
    expected = definition(logits, bitmask, rows) if vocab <= 1000 else None
    for apply in (apply_token_bitmask, apply_token_bitmask_reference):
        got = logits.to(DEVICE)
        apply(got, bitmask.to(DEVICE), rows.to(DEVICE))
        got = got.cpu()
        if expected is None:        # the full vocabulary: against the torch version
            expected = got
        assert torch.equal(got, expected), apply.__name__
    assert torch.equal(expected[[1, 3, 5]], logits[[1, 3, 5]])
    assert torch.equal(expected[4], logits[4])                  # all bits set
    assert torch.isinf(expected[0]).sum() == vocab - 1 and expected[0, 3] == logits[0, 3]


def test_it_agrees_with_xgrammars_own_application():
    xgr = pytest.importorskip("xgrammar")
    vocab = 1000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    bitmask = random_bitmask(3, vocab, seed=2)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask)        # row i by bitmask row i, on the CPU
    ours = logits.to(DEVICE)
    apply_token_bitmask(ours, bitmask.to(DEVICE), torch.arange(3, dtype=torch.int32, device=DEVICE))
    assert torch.equal(ours.cpu(), theirs)


def test_no_rows_is_a_no_op():
    logits = torch.randn(2, 64)
    before = logits.clone()
    apply_token_bitmask(logits, torch.empty(0, 2, dtype=torch.int32), torch.empty(0, dtype=torch.int32))
    assert torch.equal(logits, before)
