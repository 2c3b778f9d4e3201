"""Requests whose n completions do not all fit at once (issue 23): n in the thousands and n above
max_num_seqs run, their completions starting in waves as slots and blocks free up, sharing the prompt's
full blocks; what each completion draws depends on its request's seed and its index alone; the cache
stays consistent and is all free at the end; a request can be aborted wherever its completions are."""
import pickle

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence
from block_invariants import check_invariants
from oracle import load_hf_model, random_prompts
from sampling_reference import hf_probabilities

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.cpu_only]     # every engine is device="cpu"

BLOCK = 16
VOCAB = 512                                              # the tiny checkpoint's
PROMPT = random_prompts(1, VOCAB, (20, 20), seed=2301)[0]   # a full block and a tail of 4 tokens
TAIL = len(PROMPT) % BLOCK
ALIGNED = random_prompts(1, VOCAB, (2 * BLOCK, 2 * BLOCK), seed=2302)[0]   # ends on a block boundary
N = 3000
FILTERS = [dict(top_k=20), dict(top_p=0.3), dict(min_p=0.4)]     # each keeps 10 to 25 tokens here


def first_tokens(params: SamplingParams) -> SamplingParams:
    return SamplingParams(n=N, max_tokens=1, temperature=0.8, ignore_eos=True, **params)


def engine(model, **kwargs) -> LLM:
    return LLM(str(model), device="cpu", kvcache_block_size=BLOCK, max_model_len=128, **kwargs)


@pytest.fixture(scope="module")
def roomy(tiny_model):
    """64 running sequences at most, and blocks for two waves of 64."""
    with engine(tiny_model, num_kvcache_blocks=160, max_num_seqs=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def drawn(roomy):
    """N first tokens under each filter, one seeded request each, all three in one call."""
    params = [first_tokens(dict(seed=11 + i, **f)) for i, f in enumerate(FILTERS)]
    return params, roomy.generate([PROMPT] * len(params), params, use_tqdm=False)


def assert_idle(llm: LLM) -> None:
    assert llm.is_finished() and not llm.scheduler.block_manager.used_block_ids


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's goodness of fit over the kept tokens: P(chi2(k - 1) >= statistic)."""
    statistic = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(len(counts) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic.double() / 2))


@pytest.fixture(scope="module")
def next_token_logits(tiny_model) -> torch.Tensor:
    """transformers' logits for the token after PROMPT."""
    with torch.inference_mode():
        return load_hf_model(tiny_model)(input_ids=torch.tensor([PROMPT])).logits[0, -1]


@pytest.mark.parametrize("which", range(len(FILTERS)))
def test_n_3000_first_tokens_follow_the_filtered_distribution(roomy, drawn, next_token_logits, which):
    params, outputs = drawn
    tokens = [c["token_ids"] for c in outputs[which]["outputs"]]
    assert len(tokens) == N and all(len(t) == 1 for t in tokens)
    probabilities = hf_probabilities(next_token_logits, 0.8, **FILTERS[which])
    kept = probabilities > 0
    assert 10 <= int(kept.sum()) <= 25
    counts = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=VOCAB).double()
    assert counts[~kept].sum() == 0, "a drawn token outside the kept set"
    expected = probabilities[kept].double() * N
    assert expected.min() >= 5                          # chi-square's approximation holds
    assert chi_square_p_value(counts[kept], expected) > 1e-3
    assert_idle(roomy)


def test_a_seeded_request_of_n_3000_draws_the_same_completions_again(roomy, drawn):
    """Alone this time: other waves, other batches, the same draws (keys: seed, index, position)."""
    params, outputs = drawn
    again = roomy.generate([PROMPT], params[0], use_tqdm=False)[0]
    assert again["outputs"] == outputs[0]["outputs"]
    assert len({tuple(c["token_ids"]) for c in again["outputs"]}) > 1
    assert_idle(roomy)


@pytest.fixture(scope="module")
def cramped(tiny_model):
    """8 blocks and 4 running sequences: waves of a few, and decode preempts."""
    with engine(tiny_model, num_kvcache_blocks=8, max_num_seqs=4) as llm:
        yield llm


@pytest.mark.parametrize("prompt", [PROMPT, ALIGNED], ids=["partial-last-block", "block-aligned"])
def test_n_above_max_num_seqs_gives_every_completion_in_order_whatever_its_wave(roomy, cramped, monkeypatch,
                                                                                 prompt):
    """n=60 with decode: all at once on the roomy engine, a few at a time through preemption on the
    cramped one (each completion grows into a third block: 4 of them need 9 blocks); seeded, the two
    give the same completions in the same order, whether the prompt ends inside a block or on its
    boundary (later waves then copy the prompt's last block and recompute its last token alone). The
    cache's invariants hold after every step, and it is all free at the end."""
    params = SamplingParams(n=60, max_tokens=14, temperature=1.0, top_k=50, seed=7, ignore_eos=True)
    at_once = roomy.generate([prompt], params, use_tqdm=False)[0]
    scheduler, real_step = cramped.scheduler, cramped._step
    preemptions = scheduler.num_preemptions

    def checked_step():
        result = real_step()
        assert len(scheduler.running) <= 4
        live = [*scheduler.waiting, *scheduler.running, *scheduler.finishing]
        check_invariants(scheduler.block_manager, live)
        return result
    monkeypatch.setattr(cramped, "_step", checked_step)
    in_waves = cramped.generate([prompt], params, use_tqdm=False)[0]
    if prompt is PROMPT:     # the aligned prompt's completions share its two blocks whole: they fit without
        assert scheduler.num_preemptions > preemptions
    assert len(in_waves["outputs"]) == 60 and len({tuple(c["token_ids"]) for c in in_waves["outputs"]}) > 50
    assert in_waves == at_once
    assert_idle(cramped)


@pytest.mark.parametrize("prompt, tail", [(PROMPT, TAIL), (ALIGNED, 1)], ids=["partial-last-block", "block-aligned"])
def test_later_waves_compute_only_the_prompts_tail_without_the_prefix_cache(tiny_model, prompt, tail):
    """The prompt's full blocks are shared by reference, not found in a cache: every wave after the first
    prefills the prompt's last partial block alone (once, for all of the wave); a prompt that ends on a
    block boundary, its last token alone (into a copy of the last block, not a whole block again)."""
    with engine(tiny_model, num_kvcache_blocks=12, max_num_seqs=64, enable_prefix_caching=False) as llm:
        llm.add_request(prompt, first_tokens(dict(seed=3)))
        prefills = []
        num_done = 0
        while not llm.is_finished():
            finished, num_tokens = llm.step()
            num_done += len(finished)
            if num_tokens > 0:
                prefills.append(num_tokens)
        assert num_done == N and llm.stats["num_preemptions"] == 0
        assert prefills[0] == len(prompt) and set(prefills[1:]) == {tail}
        if tail > 1:       # 12 blocks: waves of 11 at most, not 64 (each completion copies the partial block)
            assert len(prefills) > N // 12
        assert_idle(llm)


def test_abort_a_request_between_steps_while_its_completions_start_in_waves(roomy):
    """An aborted request's completions stop wherever they are (the step in flight reports none of
    them), those not yet split off never start, and the other request goes on to its end."""
    scheduler = roomy.scheduler
    doomed = roomy.add_request(PROMPT, SamplingParams(n=500, max_tokens=3, seed=1, ignore_eos=True))
    other = roomy.add_request(PROMPT[:9], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        roomy.step()
    assert any(seq.parent_id == doomed and seq.num_forks for seq in scheduler.waiting)
    dropped = scheduler.abort([doomed])
    assert dropped and all(seq.parent_id == doomed and seq.is_finished for seq in dropped)
    assert all(seq.parent_id == other for seq in [*scheduler.waiting, *scheduler.running, *scheduler.finishing])
    finished = []
    while not roomy.is_finished():
        finished += roomy.step()[0]
    assert [seq_id for seq_id, _ in finished] == [other]
    assert_idle(roomy)


def test_a_wave_whose_tail_is_one_token_reaches_the_tensor_parallel_workers():
    """A prompt one token past a block boundary: a later wave computes just that token. Workers get a
    sequence without its token list when one token is computed (a decode's may still be PENDING), and
    must still read that token as a prefill input (their copy is pickled, as the shm channel sends it)."""
    manager = BlockManager(4, BLOCK)
    first = Sequence(list(range(1, BLOCK + 2)), SamplingParams(n=2), BLOCK)
    manager.allocate(first)
    rest = first.fork(1)
    manager.share_prompt(first, rest)
    manager.deallocate(first)
    manager.allocate(rest)
    rest.num_scheduled_tokens = rest.num_tokens - rest.num_cached_tokens
    assert rest.num_scheduled_tokens == 1
    worker_copy = pickle.loads(pickle.dumps(rest))
    start = worker_copy.num_cached_tokens
    assert worker_copy[start:start + 1] == [BLOCK + 1] and worker_copy.block_table == rest.block_table
