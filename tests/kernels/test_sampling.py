"""Triton sampling kernel: greedy rows are torch.argmax exactly, sampled rows follow softmax(logits / T)
(interpreter on CPU, full vocabulary size on CUDA)."""
import pytest
import torch

from nanovllm.kernels.sampling import candidates, exact_thresholds, sample

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


@pytest.mark.parametrize("vocab, k", [(300, 5), (300, 19), (1000, 40)])
def test_candidates_hold_each_rows_largest_logits_and_its_normalizers(vocab, k):
    torch.manual_seed(vocab + k)
    logits = torch.randn(4, vocab, device=DEVICE) * 2
    logits[1, :k + 3] = 5.0                       # ties at the top: lowest ids first
    temperatures = torch.tensor([0.7, 1.0, 0.0, 2.0], device=DEVICE)
    values, ids, floors, complete, row_max, log_z, z_t = candidates(logits, temperatures, k)
    assert complete.all()
    reference = logits.float().sort(dim=1, descending=True, stable=True)
    assert torch.equal(values[:, :k], reference.values[:, :k]) and torch.equal(ids[:, :k], reference.indices[:, :k])
    held = values > float("-inf")
    assert torch.equal(held.sum(1), (logits >= floors.unsqueeze(1)).sum(1))    # every logit >= the floor
    torch.testing.assert_close(log_z, logits.float().logsumexp(1))
    t = torch.where(temperatures == 0, 1.0, temperatures).unsqueeze(1)
    torch.testing.assert_close(z_t, torch.exp((logits - row_max.unsqueeze(1)) / t).sum(1))


def test_candidates_of_a_row_that_overflows_their_buffer_start_with_its_exact_top_k():
    """600 logits tie above the floor, the three largest past them: the buffer (512) overflows before
    the largest come (the interpreter runs programs in order), so the row's top k come from the row
    itself; the rest are -inf pads. A row whose buffer holds every logit >= its floor is untouched."""
    torch.manual_seed(10)
    vocab, k = 640, 5
    logits = torch.randn(2, vocab, device=DEVICE) * 0.5 - 2.0
    logits[0, :600] = 2.0
    logits[0, [610, 620, 630]] = torch.tensor([6.0, 5.0, 6.0], device=DEVICE)
    values, ids, floors, complete, *_ = candidates(logits, torch.ones(2, device=DEVICE), k)
    assert complete.tolist() == [False, True]
    assert ids[0, :k].tolist() == [610, 630, 620, 0, 1] and values[0, :k].tolist() == [6.0, 6.0, 5.0, 2.0, 2.0]
    assert (values[0, k:] == float("-inf")).all()
    reference = logits[1].sort(descending=True, stable=True)
    held = int((logits[1] >= floors[1]).sum())
    assert torch.equal(values[1, :held], reference.values[:held]) and torch.equal(ids[1, :held], reference.indices[:held])
    assert (values[1, held:] == float("-inf")).all()       # pads, never NaN


def test_exact_thresholds_find_the_top_k_then_top_p_boundary_and_skip_settled_rows():
    torch.manual_seed(9)
    vocab = 500
    logits = torch.randn(4, vocab, device=DEVICE) * 2
    temperatures = torch.tensor([1.0, 0.6, 1.3, 1.0], device=DEVICE)
    top_k = torch.tensor([0, 50, 7, 3], dtype=torch.int32, device=DEVICE)
    top_p = torch.tensor([0.9, 0.95, 1.0, 0.5], device=DEVICE)
    thresholds = torch.full((4,), float("-inf"), device=DEVICE)
    thresholds[3] = 123.0                          # a settled row keeps what it has
    done = torch.tensor([0, 0, 0, 1], dtype=torch.int32, device=DEVICE)
    exact_thresholds(logits, torch.arange(4, dtype=torch.int32, device=DEVICE), temperatures, top_k, top_p,
                     thresholds, done)
    for row in range(3):
        values = logits[row].float().sort(descending=True).values
        if top_k[row] > 0:
            values = values[:top_k[row]]
        cumulative = torch.softmax(values / temperatures[row], 0).cumsum(0)
        boundary = int((cumulative < top_p[row]).sum().clamp(max=values.numel() - 1))
        assert thresholds[row].item() == values[boundary].item(), row
    assert thresholds[3].item() == 123.0


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("top_k, top_p, dtype", [(20, 0.95, torch.float32), (0, 0.9, torch.float32),
                                                  (100, 1.0, torch.bfloat16)])
def test_full_vocabulary_draws_follow_the_filtered_softmax(top_k, top_p, dtype):
    """Qwen3's vocabulary: thresholds through the candidates (top_k 20), the bisection (top_p alone, a
    top_k beyond the candidates), then 20000 keyed draws against transformers' warpers. With top_p the
    logits are float32: bf16 rows tie by the hundred deep in the distribution, and at a top_p boundary
    inside a tie we keep the whole tie where transformers cuts it by sort order."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
    from nanovllm.layers.sampler import Sampler, SamplingTensors
    torch.manual_seed(11)
    row = (torch.randn(1, 151936, device="cuda") * 2.5).to(dtype)
    scores = row.float().cpu() / 0.8
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = torch.softmax(scores, -1)[0]
    n = 20000
    t = SamplingTensors(temperatures=torch.full((n,), 0.8, device="cuda"), keys=torch.arange(n, device="cuda") * 31,
                        top_k=torch.full((n,), top_k, dtype=torch.int32, device="cuda"),
                        top_p=torch.full((n,), top_p, device="cuda"), min_p=torch.zeros(n, device="cuda"),
                        filter_rows=torch.arange(n, dtype=torch.int32, device="cuda"))
    tokens = Sampler()(row.expand(n, -1).contiguous(), t).token_ids
    freq = torch.bincount(tokens.cpu(), minlength=151936).float() / n
    assert (freq[expected == 0] == 0).all()
    assert torch.all((freq - expected).abs() <= 4 * (expected * (1 - expected) / n).sqrt() + 1e-3)


def test_a_row_drawn_among_its_candidates_gets_the_full_vocabularys_token():
    """filter_and_draw draws top_k rows among their candidates with the same per-token noise that the
    full-vocabulary kernel uses: the same key and threshold give the same token either way."""
    from nanovllm.kernels.sampling import filter_and_draw
    torch.manual_seed(12)
    rows, vocab = 12, 400
    logits = torch.randn(rows, vocab, device=DEVICE) * 2
    temperatures = torch.full((rows,), 0.9, device=DEVICE)
    keys = torch.arange(rows, device=DEVICE) * 1000003
    top_k = torch.full((rows,), 8, dtype=torch.int32, device=DEVICE)
    tokens, thresholds, *_ = filter_and_draw(logits, temperatures, keys, top_k, torch.full((rows,), 0.9, device=DEVICE),
                                             torch.zeros(rows, device=DEVICE), None)
    assert torch.equal(tokens, sample(logits, temperatures, thresholds, keys))
    assert len(set(tokens.tolist())) > 1
