"""Triton sampling kernel: greedy rows are torch.argmax exactly, sampled rows follow softmax(logits / T)
(interpreter on CPU, full vocabulary size on CUDA)."""
import pytest
import torch

from nanovllm.kernels.sampling import sample

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_are_the_argmax_across_chunks(dtype):
    torch.manual_seed(0)
    logits = torch.randn(6, 300, device=DEVICE).to(dtype)     # 5 chunks of 64, the last one partial
    logits[1, 299] = 50.0                                      # the maximum in the partial chunk
    logits[2, 10] = logits[2, 200] = 50.0                      # a tie across chunks: the lower index wins
    logits[3, 70] = logits[3, 71] = 50.0                       # a tie inside one chunk
    tokens = sample(logits, torch.zeros(6, device=DEVICE), chunk=64, block=16)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.float().argmax(-1))
    assert tokens[1:4].tolist() == [299, 10, 70]


def test_sampled_rows_follow_the_softmax():
    torch.manual_seed(1)
    n = 20000 if CUDA else 1500
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0], device=DEVICE)
    for temperature in (0.7, 1.5) if CUDA else (0.7,):
        tokens = sample(logits.expand(n, -1).contiguous(), torch.full((n,), temperature, device=DEVICE))
        freq = torch.bincount(tokens, minlength=4).float().cpu() / n
        expected = torch.softmax(logits.cpu() / temperature, -1)
        # 4 standard deviations of a frequency estimated from n draws
        assert torch.allclose(freq, expected, atol=4 * (0.25 / n) ** 0.5), (temperature, freq, expected)


def test_greedy_and_sampled_rows_mix_and_the_input_is_untouched():
    torch.manual_seed(2)
    logits = torch.randn(32, 40, device=DEVICE)
    before = logits.clone()
    temperatures = torch.tensor([0.0, 1.0] * 16, device=DEVICE)
    tokens = sample(logits, temperatures, chunk=16, block=16)
    assert torch.equal(logits, before)
    assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))
    assert not torch.equal(tokens[1::2], logits[1::2].argmax(-1))     # 16 draws at T=1 are not all the mode
    assert ((tokens >= 0) & (tokens < 40)).all()


def test_the_draw_follows_torch_manual_seed():
    logits = torch.randn(16, 50, device=DEVICE)
    temperatures = torch.ones(16, device=DEVICE)
    draws = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        draws.append(sample(logits, temperatures, chunk=32, block=16))
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2])


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_full_vocabulary_batch():
    """A decode step's shape: 256 rows of Qwen3's 151936-token vocabulary in bf16."""
    torch.manual_seed(3)
    logits = torch.randn(256, 151936, device="cuda", dtype=torch.bfloat16)
    greedy = sample(logits, torch.zeros(256, device="cuda"))
    assert torch.equal(greedy, logits.float().argmax(-1))
    hot = logits.clone()
    hot[:, 123456] = 30.0                     # one token far ahead: a T=0.6 draw takes it
    assert (sample(hot, torch.full((256,), 0.6, device="cuda")) == 123456).all()
