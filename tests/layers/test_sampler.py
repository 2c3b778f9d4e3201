import torch

from nanovllm.layers.sampler import Sampler


def test_zero_temperature_rows_take_the_argmax():
    logits = torch.randn(5, 100)
    tokens = Sampler()(logits, torch.zeros(5))
    assert torch.equal(tokens, logits.argmax(-1))


def test_temperature_rows_follow_the_softmax_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 20000
    for temperature in (0.5, 1.0, 2.0):
        tokens = Sampler()(logits.expand(n, -1).clone(), torch.full((n,), temperature))
        freq = torch.bincount(tokens, minlength=4).float() / n
        expected = torch.softmax(logits / temperature, -1)
        assert torch.allclose(freq, expected, atol=0.015), (temperature, freq, expected)


def test_greedy_and_sampled_rows_mix_in_one_batch():
    torch.manual_seed(1)
    logits = torch.randn(64, 50)
    temperatures = torch.tensor([0.0, 1.0] * 32)
    tokens = Sampler()(logits.clone(), temperatures)
    assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))
    assert not torch.equal(tokens[1::2], logits[1::2].argmax(-1))   # 32 draws at T=1 are not all the mode


def test_input_logits_are_left_unchanged():
    logits = torch.randn(3, 10)
    before = logits.clone()
    Sampler()(logits, torch.tensor([0.0, 0.7, 1.3]))
    assert torch.equal(logits, before)
