"""The Sampler: penalties -> temperature -> min_p -> top_k -> top_p -> draw, as transformers' processors and
warpers define them, and log-probs of the raw logits. Each check runs on the torch path (CPU) and on the
Triton kernel path (the interpreter here, the GPU on a GPU box) with a small vocabulary, where the
kernels' candidates hold only a few logits, so both the candidate path and the exact bisection run."""
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from nanovllm.kernels import penalties as penalty_kernels
from nanovllm.layers.logits_processor import apply_penalties, keep_at_least
from nanovllm.layers.sampler import Penalties, Sampler, SamplingTensors
from sampling_reference import hf_probabilities

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PATHS = {"torch": False, "kernels": True}


def tensors_for(rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, keys=None, **extra) -> SamplingTensors:
    filters = top_k > 0 or top_p < 1.0 or min_p > 0.0
    t = SamplingTensors(temperatures=torch.full((rows,), temperature, device=DEVICE),
                        keys=torch.arange(rows, device=DEVICE) if keys is None else keys, **extra)
    if filters:
        t.top_k = torch.full((rows,), top_k, dtype=torch.int32, device=DEVICE)
        t.top_p = torch.full((rows,), top_p, device=DEVICE)
        t.min_p = torch.full((rows,), min_p, device=DEVICE)
        t.filter_rows = torch.arange(rows, dtype=torch.int32, device=DEVICE)
    return t


def our_probabilities(sampler, logits, temperature, top_k, top_p, min_p):
    t = tensors_for(logits.size(0), temperature, top_k, top_p, min_p)
    thresholds = sampler._thresholds(logits, t) if t.top_k is not None else torch.full(
        (logits.size(0),), float("-inf"), device=DEVICE)
    return torch.softmax(keep_at_least(logits, thresholds).cpu() / temperature, -1)


SETTINGS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 5, 1.0, 0.0), (0.7, 20, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (0.6, 20, 0.95, 0.0), (1.3, 0, 0.5, 0.05),
    (1.0, 0, 1.0, 0.2), (0.8, 3, 0.8, 0.1), (1.0, 1000, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (1.0, 200, 0.3, 0.0),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", SETTINGS)
def test_filters_keep_what_transformers_keeps_with_the_same_probabilities(path, temperature, top_k, top_p, min_p):
    torch.manual_seed(top_k + int(100 * top_p) + int(1000 * min_p))
    logits = (torch.randn(6, 200) * 2).to(DEVICE)
    logits[1] = logits[1] * 0.05            # a flat row: top_p reaches deep
    logits[2, :50] = 8.0                    # a row whose top 50 tie
    ours = our_probabilities(Sampler(PATHS[path]), logits, temperature, top_k, top_p, min_p)
    theirs = hf_probabilities(logits, temperature, top_k, top_p, min_p)
    if top_p < 1:   # a top_p boundary inside a tie is kept whole here, cut by sort order there
        ours, theirs = ours[[0, 1, 3, 4, 5]], theirs[[0, 1, 3, 4, 5]]
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_ties_with_the_top_k_or_top_p_boundary_token_stay(path):
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0] + [-5.0] * 10], device=DEVICE)
    kept = our_probabilities(Sampler(PATHS[path]), logits, 1.0, 2, 1.0, 0.0)[0] > 0
    assert kept.tolist()[:6] == [True, True, True, True, False, False]
    kept = our_probabilities(Sampler(PATHS[path]), logits, 1.0, 0, 0.6, 0.0)[0] > 0
    assert kept.tolist()[:6] == [True, True, True, True, False, False]


def draw_frequencies(sampler, logits_row, n, **filters):
    """n draws from one row: its threshold is found once, then n rows with their own keys draw."""
    t = tensors_for(1, **filters)
    row = logits_row.to(DEVICE)
    thresholds = sampler._thresholds(row, t) if t.top_k is not None else torch.tensor([float("-inf")], device=DEVICE)
    keys = torch.arange(n, device=DEVICE) * 7919
    tokens = sampler._draw(row.expand(n, -1).contiguous(), t.temperatures.expand(n).contiguous(),
                           thresholds.expand(n).contiguous(), keys)
    return torch.bincount(tokens.cpu(), minlength=row.size(1)).float() / n


# the interpreter runs a kernel program in ~20 ms: fewer draws there, all of them on a GPU
DRAWS = {"torch": 4000, "kernels": 20000 if DEVICE == "cuda" else 400}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [(1.0, 0, 1.0, 0.0), (0.7, 4, 1.0, 0.0),
                                                             (1.0, 0, 0.8, 0.0), (1.5, 6, 0.9, 0.05)])
def test_draws_follow_the_filtered_distribution_and_never_leave_the_kept_set(path, temperature, top_k, top_p, min_p):
    torch.manual_seed(3)
    row = torch.randn(1, 12) * 1.5
    n = DRAWS[path]
    freq = draw_frequencies(Sampler(PATHS[path]), row, n, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p)
    expected = hf_probabilities(row, temperature, top_k, top_p, min_p)[0]
    assert (freq[expected == 0] == 0).all()
    assert torch.all((freq - expected).abs() <= 4 * (expected * (1 - expected) / n).sqrt() + 1e-3), (freq, expected)


@pytest.mark.parametrize("path", PATHS)
def test_a_row_draws_by_its_key_alone_wherever_it_sits(path):
    torch.manual_seed(4)
    logits = torch.randn(8, 300, device=DEVICE)
    sampler = Sampler(PATHS[path])
    keys = torch.arange(100, 108, device=DEVICE)
    batch = sampler(logits, tensors_for(8, top_p=0.9, keys=keys)).token_ids
    order = torch.randperm(8, device=DEVICE)
    shuffled = sampler(logits[order], tensors_for(8, top_p=0.9, keys=keys[order])).token_ids
    assert torch.equal(shuffled, batch[order])
    alone = sampler(logits[3:4], tensors_for(1, top_p=0.9, keys=keys[3:4])).token_ids
    assert alone.item() == batch[3].item()
    others = torch.stack([sampler(logits[3:4], tensors_for(1, keys=torch.tensor([k], device=DEVICE))).token_ids
                          for k in range(20)])
    assert others.unique().numel() > 1       # different keys, different draws


@pytest.mark.parametrize("path", PATHS)
def test_zero_temperature_rows_take_the_argmax_and_the_input_is_untouched(path):
    torch.manual_seed(5)
    logits = torch.randn(6, 100, device=DEVICE)
    before = logits.clone()
    t = tensors_for(6, top_k=3)
    t.temperatures[::2] = 0.0
    tokens = Sampler(PATHS[path])(logits, t).token_ids
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k", [0, 5])
def test_logprobs_are_the_log_softmax_of_the_raw_logits(path, k):
    torch.manual_seed(6)
    logits = torch.randn(5, 300, device=DEVICE) * 3
    penalties = Penalties(rows=torch.tensor([1], device=DEVICE), state_rows=torch.tensor([0], device=DEVICE),
                          prompt_mask=torch.ones(1, 300, dtype=torch.bool, device=DEVICE),
                          output_counts=torch.zeros(1, 300, dtype=torch.int32, device=DEVICE),
                          repetition=torch.tensor([2.0], device=DEVICE), frequency=torch.zeros(1, device=DEVICE),
                          presence=torch.zeros(1, device=DEVICE))
    out = Sampler(PATHS[path])(logits, tensors_for(5, temperature=0.5, top_k=10, max_logprobs=k, penalties=penalties))
    reference = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.token_ids.unsqueeze(1)).squeeze(1),
                               atol=1e-4, rtol=0)
    top = reference.topk(k, dim=1)
    assert out.top_token_ids.shape == (5, k)
    assert torch.equal(out.top_token_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs, top.values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("path", PATHS)
def test_repetition_penalty_equals_transformers_and_presence_frequency_the_definition(path):
    """The penalties read each row's state from the tables where it lies (rows 4, 0, 2 of five)."""
    torch.manual_seed(7)
    logits = torch.randn(3, 50, device=DEVICE) * 3
    prompt = [[1, 2, 3], [4, 4, 5], [9]]
    output = [[3, 7, 7], [], [10, 10, 10, 11]]
    state_rows = [4, 0, 2]
    prompt_mask = torch.zeros(5, 50, dtype=torch.bool, device=DEVICE)
    counts = torch.zeros(5, 50, dtype=torch.int32, device=DEVICE)
    prompt_mask[1, :25] = prompt_mask[3] = True       # other sequences' state
    counts[1, 25:] = counts[3, ::3] = 2
    for row in range(3):
        prompt_mask[state_rows[row], prompt[row]] = True
        for token in output[row]:
            counts[state_rows[row], token] += 1
    repetition, frequency, presence = [1.3, 0.7, 1.0], [0.0, 0.5, 0.4], [0.0, -1.0, 0.6]
    ours = logits.clone()
    penalize = penalty_kernels.apply_penalties if PATHS[path] else apply_penalties
    penalize(ours, torch.arange(3, device=DEVICE), torch.tensor(state_rows, device=DEVICE), prompt_mask, counts,
             torch.tensor(repetition, device=DEVICE), torch.tensor(frequency, device=DEVICE),
             torch.tensor(presence, device=DEVICE))
    for row in range(3):
        expected = RepetitionPenaltyLogitsProcessor(repetition[row])(
            torch.tensor([prompt[row] + output[row]]), logits[row:row + 1].cpu().clone())[0]
        for token in set(output[row]):
            expected[token] -= frequency[row] * output[row].count(token) + presence[row]
        torch.testing.assert_close(ours[row].cpu(), expected)


def flat_rows(vocab: int = 640) -> torch.Tensor:
    """Rows where more logits pass the candidates' floor than their buffer holds (512), at a vocabulary
    the candidate pass splits into 40 chunks: all equal; 600 equal maxima then lower values; and 600
    equal values then, past them, the three largest (the buffer fills before it reaches them, in the
    interpreter's program order; on a GPU the atomics' order is anyone's)."""
    torch.manual_seed(8)
    logits = torch.randn(3, vocab, device=DEVICE) * 0.5 - 2.0
    logits[0] = 0.5
    logits[1, :600] = 4.0
    logits[2, :600] = 2.0
    logits[2, [610, 620, 630]] = torch.tensor([6.0, 5.0, 6.0], device=DEVICE)
    return logits


@pytest.mark.parametrize("how", ["plain", "filters", "penalties"])
def test_logprobs_of_flat_rows_are_a_true_top_k_on_the_kernel_path(how):
    """Log-probs through the finishing kernel (plain, with filters) and through the candidates alone
    (a penalty edits the logits first): each listed id's log-prob is the log_softmax's, and they are
    the k largest; the sampled token's own log-prob comes too."""
    logits = flat_rows()
    rows, vocab, k = logits.size(0), logits.size(1), 5
    extra = dict(max_logprobs=k)
    if how == "penalties":
        extra["penalties"] = Penalties(rows=torch.tensor([1], device=DEVICE),
                                       state_rows=torch.tensor([0], device=DEVICE), prompt_mask=torch.ones(1, vocab, dtype=torch.bool, device=DEVICE),
                                       output_counts=torch.zeros(1, vocab, dtype=torch.int32, device=DEVICE),
                                       repetition=torch.tensor([1.5], device=DEVICE),
                                       frequency=torch.zeros(1, device=DEVICE), presence=torch.zeros(1, device=DEVICE))
    t = tensors_for(rows, temperature=0.8, top_k=40 if how == "filters" else 0, **extra)
    out = Sampler(True)(logits, t)
    reference = torch.log_softmax(logits.float(), -1)
    top = reference.topk(k, dim=1).values
    torch.testing.assert_close(out.top_logprobs, top, atol=1e-5, rtol=0)
    torch.testing.assert_close(reference.gather(1, out.top_token_ids), top, atol=1e-5, rtol=0)
    # distinct ids, ties lowest id first (as everywhere in the sampler)
    assert out.top_token_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [610, 630, 620, 0, 1]]
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.token_ids.unsqueeze(1)).squeeze(1),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", PATHS)
def test_allowed_tokens_then_logit_bias_come_before_penalties_and_log_probs_stay_raw(path):
    """Row 0 may only draw tokens 3, 7 and 11 (whatever its filters and temperature); row 1's bias lifts a
    low token above the rest (greedy follows the bias); row 2 is untouched. The edits come before the
    penalties (a penalty sees the biased logit, as in vLLM's sampler) and log-probs are of the raw logits."""
    torch.manual_seed(9)
    logits = torch.randn(3, 200, device=DEVICE) * 2
    logits[0, [3, 7, 11]] = 0.5             # equally likely once allowed: a dozen draws reach all three
    raw = logits.clone()
    low = int(logits[1].argmin())
    allowed = (torch.tensor([0], device=DEVICE), torch.tensor([0], device=DEVICE),
               torch.zeros(3, dtype=torch.int64, device=DEVICE), torch.tensor([3, 7, 11], device=DEVICE))
    bias = (torch.tensor([1, 1], device=DEVICE), torch.tensor([low, 5], device=DEVICE),
            torch.tensor([60.0, -1.5], device=DEVICE))
    penalties = Penalties(rows=torch.tensor([1], device=DEVICE), state_rows=torch.tensor([0], device=DEVICE),
                          prompt_mask=torch.zeros(1, 200, dtype=torch.bool, device=DEVICE),
                          output_counts=torch.zeros(1, 200, dtype=torch.int32, device=DEVICE),
                          repetition=torch.tensor([2.0], device=DEVICE), frequency=torch.zeros(1, device=DEVICE),
                          presence=torch.zeros(1, device=DEVICE))
    penalties.output_counts[0, low] = 1     # the bias (+60) then the repetition penalty (halves it): still first
    sampler = Sampler(PATHS[path])
    drawn = set()
    for seed in range(12):
        t = tensors_for(3, temperature=1.5, top_k=150, keys=torch.full((3,), seed, device=DEVICE),
                        allowed=allowed, bias=bias, penalties=penalties, max_logprobs=2)
        t.temperatures[1] = 0.0
        out = sampler(logits, t)
        drawn.add(int(out.token_ids[0]))
        assert int(out.token_ids[1]) == low
        reference = torch.log_softmax(raw.float(), -1)      # raw: neither the mask nor the bias
        torch.testing.assert_close(out.logprobs, reference.gather(1, out.token_ids.unsqueeze(1)).squeeze(1),
                                   atol=1e-4, rtol=0)
        assert torch.equal(logits, raw)
    assert drawn == {3, 7, 11}
    expected = raw.clone()
    expected[0, [i for i in range(200) if i not in (3, 7, 11)]] = float("-inf")
    expected[1, low] = (expected[1, low] + 60.0) / 2        # penalized after the bias (before it: 2x + 60)
    expected[1, 5] -= 1.5
    probs = sampler.probabilities(logits, tensors_for(3, temperature=1.0, allowed=allowed, bias=bias,
                                                      penalties=penalties))
    torch.testing.assert_close(probs, torch.softmax(expected.float(), -1), atol=1e-5, rtol=1e-4)
