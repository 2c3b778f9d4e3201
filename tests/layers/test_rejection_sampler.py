"""The rejection sampler (speculative decoding's verification): whatever the proposal, the token emitted at
a position has exactly the law plain decoding samples from there (the Sampler's: temperature, min_p,
top_k, top_p, penalties), checked with many draws against the exact distribution (Pearson's chi-square);
greedy rows accept exactly the drafts equal to the argmax; the rows' layout and the accepted counts."""
import pytest
import torch

from nanovllm.layers.rejection_sampler import (NO_DRAFT, DraftRows, RejectionSampler, num_accepted,
                                               uniforms_from_keys)
from nanovllm.layers.sampler import Penalties, Sampler, SamplingTensors
from sampling_reference import hf_probabilities, penalize

pytestmark = [pytest.mark.cpu_only, pytest.mark.timeout(120)]     # CPU tensors throughout

V = 12                  # a small vocabulary: most tokens' counts are large enough for chi-square
N = 5000                # sequences (draws) per law check
NONE, TOP_K, TOP_P, ALL = dict(), dict(top_k=4), dict(top_p=0.7), dict(top_k=6, top_p=0.9, min_p=0.05)


def ids(value) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "no-filters"
    return str(value)


def tensors_for(rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                first_key: int = 0) -> SamplingTensors:
    t = SamplingTensors(temperatures=torch.full((rows,), temperature),
                        keys=torch.arange(first_key, first_key + rows, dtype=torch.int64))
    if top_k > 0 or top_p < 1.0 or min_p > 0.0:
        t.top_k = torch.full((rows,), top_k, dtype=torch.int32)
        t.top_p, t.min_p = torch.full((rows,), top_p), torch.full((rows,), min_p)
        t.filter_rows = torch.arange(rows, dtype=torch.int32)
    return t


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's goodness of fit: P(chi2(k - 1) >= statistic), over categories expected 5 times or more."""
    statistic = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(len(counts) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic.double() / 2))


def assert_law(tokens: torch.Tensor, probabilities: torch.Tensor) -> None:
    """tokens (N draws) follow `probabilities`: none outside its support, and chi-square's p-value > 1e-3."""
    counts = torch.bincount(tokens, minlength=V).double()
    kept = probabilities > 0
    assert counts[~kept].sum() == 0, "a token the target law excludes"
    expected = probabilities.double() * len(tokens)
    big = expected >= 5                 # the rarer tokens as one category
    counts = torch.cat([counts[big], counts[kept & ~big].sum().reshape(1)])
    expected = torch.cat([expected[big], expected[kept & ~big].sum().reshape(1)])
    if expected[-1] < 5:
        counts, expected = counts[:-1], expected[:-1]
    assert chi_square_p_value(counts, expected) > 1e-3


def one_draft_each(drafts: torch.Tensor) -> DraftRows:
    """N sequences of one draft: rows (draft, bonus) each."""
    return DraftRows.from_drafts([[int(d)] for d in drafts], torch.device("cpu"))


def two_rows(target: torch.Tensor, bonus: torch.Tensor, n: int) -> torch.Tensor:
    """The logits of n sequences' rows: `target` at each first row, `bonus` at each second."""
    return torch.stack([target, bonus]).repeat(n, 1)


@pytest.fixture
def logits():
    generator = torch.Generator().manual_seed(7)
    return torch.randn(2, V, generator=generator) * 1.5


@pytest.mark.parametrize("draft, filters", [("likely", NONE), ("unlikely", NONE), ("unlikely", TOP_K),
                                             ("filtered", TOP_P), ("likely", ALL)], ids=ids)
def test_a_one_hot_proposal_emits_the_target_law(logits, filters, draft):
    """A deterministic draft d (n-gram lookup): accepted with probability p(d), else a token of p without
    d; what comes out at the position has law p, d likely, unlikely or even outside p's support."""
    sampler = Sampler(use_kernels=False)
    p = hf_probabilities(logits[0], 0.8, **filters)
    order = p.argsort(descending=True)
    d = {"likely": order[0], "unlikely": order[int((p > 0).sum()) - 1], "filtered": order[-1]}[draft]
    rows = one_draft_each(torch.full((N,), int(d)))
    output, accepted = RejectionSampler(sampler)(two_rows(logits[0], logits[1], N), tensors_for(2 * N, 0.8, **filters),
                                                 rows)
    first = output.token_ids[0::2]
    assert_law(first, p)
    assert torch.equal(accepted == 1, first == d)
    rate = float(p[d])
    assert abs(float((accepted == 1).double().mean()) - rate) < 4 * (rate * (1 - rate) / N) ** 0.5 + 1e-9
    # after an accepted draft the bonus row's token has the bonus row's law
    bonus = output.token_ids[1::2][accepted == 1]
    if len(bonus) > 1000:
        assert_law(bonus, hf_probabilities(logits[1], 0.8, **filters))


@pytest.mark.parametrize("proposal, filters", [("full", NONE), ("partial", NONE), ("partial", TOP_K),
                                                ("one-hot", TOP_P), ("full", ALL)], ids=ids)
def test_the_general_rule_emits_the_target_law_whatever_the_proposal(logits, filters, proposal):
    """Drafts drawn from q, accepted with probability min(1, p(d)/q(d)), else a draw from max(p - q, 0):
    law p at the position, for q with full support, q missing part of p's support, and q one-hot."""
    sampler = Sampler(use_kernels=False)
    p = hf_probabilities(logits[0], 0.8, **filters)
    generator = torch.Generator().manual_seed(11)
    q = torch.softmax(torch.randn(V, generator=generator), -1)
    if proposal == "partial":
        q[q.argsort()[:V // 2]] = 0
        q /= q.sum()
    elif proposal == "one-hot":
        q = torch.zeros(V)
        q[p.argmax()] = 1.0
    drafts = torch.multinomial(q, N, replacement=True, generator=generator)
    rows = one_draft_each(drafts)
    draft_probs = torch.stack([q, torch.zeros(V)]).repeat(N, 1)      # the bonus rows' q is never read
    output, accepted = RejectionSampler(sampler)(two_rows(logits[0], logits[1], N), tensors_for(2 * N, 0.8, **filters),
                                                 rows, draft_probs=draft_probs)
    first = output.token_ids[0::2]
    assert_law(first, p)
    assert torch.equal(first[accepted == 1], drafts[accepted == 1])
    acceptance = float(torch.minimum(p, q).sum())        # the expected rate: sum of min(p, q)
    bound = 4 * (acceptance * (1 - acceptance) / N) ** 0.5 + 1e-9
    assert abs(float((accepted == 1).double().mean()) - acceptance) < bound


def test_greedy_rows_accept_exactly_the_drafts_equal_to_the_argmax():
    """Temperature 0: a sequence keeps its drafts up to the first that is not the argmax of its row,
    and gains the argmax there (or the bonus row's argmax after all of them), on both rules."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(8, V, generator=generator)
    best = logits.argmax(1).tolist()
    # three sequences (rows 0-3, 4-6, 7): all 3 drafts right; the second of 2 wrong; no drafts
    drafts = [[best[0], best[1], best[2]], [best[4], (best[5] + 1) % V], []]
    rows = DraftRows.from_drafts(drafts, torch.device("cpu"))
    sampler = Sampler(use_kernels=False)
    for draft_probs in (None, torch.softmax(torch.randn(8, V, generator=generator), -1)):
        output, accepted = RejectionSampler(sampler)(logits, tensors_for(8, 0.0), rows, draft_probs=draft_probs)
        assert accepted.tolist() == [3, 1, 0]
        assert output.token_ids[[0, 1, 2, 3]].tolist() == best[:4]     # 3 drafts, then the bonus argmax
        assert output.token_ids[[4, 5]].tolist() == best[4:6]          # 1 draft, then the argmax at the miss
        assert output.token_ids[7].item() == best[7]


def test_rows_layout_and_accepted_counts():
    rows = DraftRows.from_drafts([[5, 6, 7], [], [9, 9]], torch.device("cpu"))
    assert rows.draft_token_ids.tolist() == [5, 6, 7, NO_DRAFT, NO_DRAFT, 9, 9, NO_DRAFT]
    assert rows.seq_of_row.tolist() == [0, 0, 0, 0, 1, 2, 2, 2]
    assert rows.offsets.tolist() == [0, 1, 2, 3, 0, 0, 1, 2]
    sampled = torch.tensor([5, 1, 7, 3, 4, 9, 9, 2])        # a miss at row 1, the bonus row, all of the third
    assert num_accepted(rows, sampled == rows.draft_token_ids).tolist() == [1, 0, 2]


def test_probabilities_are_the_law_the_sampler_draws_from():
    """Sampler.probabilities: penalties, then the filters' thresholds, softmax(x / T) over what they keep
    (transformers' warpers), a greedy row one-hot at its argmax; the logits are left untouched."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 40, generator=generator) * 2
    before = logits.clone()
    sampler = Sampler(use_kernels=False)
    t = SamplingTensors(temperatures=torch.tensor([0.7, 1.0, 1.3, 0.0]), keys=torch.arange(4))
    t.top_k = torch.tensor([5, 0, 0, 0], dtype=torch.int32)
    t.top_p, t.min_p = torch.tensor([1.0, 0.8, 1.0, 1.0]), torch.tensor([0.0, 0.0, 0.1, 0.0])
    t.filter_rows = torch.arange(4, dtype=torch.int32)
    prompt, output = [1, 2, 3], [3, 3, 9]
    t.penalties = Penalties(rows=torch.tensor([1]), state_rows=torch.tensor([0]),
                            prompt_mask=torch.zeros(1, 40, dtype=torch.bool).index_fill_(1, torch.tensor(prompt), True),
                            output_counts=torch.bincount(torch.tensor(output), minlength=40).int()[None],
                            repetition=torch.tensor([1.3]), frequency=torch.tensor([0.2]), presence=torch.tensor([0.1]))
    probs = sampler.probabilities(logits, t)
    assert torch.equal(logits, before)
    torch.testing.assert_close(probs[0], hf_probabilities(logits[0], 0.7, top_k=5))
    penalized = penalize(logits[1], prompt, output, repetition=1.3, presence=0.1, frequency=0.2)
    torch.testing.assert_close(probs[1], hf_probabilities(penalized, 1.0, top_p=0.8))
    torch.testing.assert_close(probs[2], hf_probabilities(logits[2], 1.3, min_p=0.1))
    assert probs[3].tolist() == torch.nn.functional.one_hot(logits[3].argmax(), 40).float().tolist()


def test_uniforms_from_keys_are_uniform_and_repeatable():
    """Consecutive keys (a step's unseeded rows) give independent-looking uniforms in (0, 1)."""
    keys = torch.arange(2 ** 40, 2 ** 40 + 50000, dtype=torch.int64)
    u = uniforms_from_keys(keys)
    assert torch.equal(u, uniforms_from_keys(keys.clone()))
    assert 0 < float(u.min()) and float(u.max()) < 1
    counts = torch.bincount((u * 20).long(), minlength=20).double()
    assert chi_square_p_value(counts, torch.full((20,), len(u) / 20.0, dtype=torch.float64)) > 1e-3
    pairs = torch.bincount((u[:-1] * 5).long() * 5 + (u[1:] * 5).long(), minlength=25).double()
    assert chi_square_p_value(pairs, torch.full((25,), (len(u) - 1) / 25.0, dtype=torch.float64)) > 1e-3
