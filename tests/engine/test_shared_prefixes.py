"""Which decode rows read their shared first pages once for the group (engine/shared_prefixes.py): by the
pages themselves, never the page being written, the grouping that saves the most reads, items of bounded size,
and nothing where the saving is small."""
import os
import random

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.shared_prefixes import MIN_SAVED_FRACTION, shared_prefixes
from groupings import record_groupings
from oracle import hf_greedy, load_hf_model

PAGE = 16


def _tables(rows: list[list[int]]) -> np.ndarray:
    width = max(map(len, rows))
    return np.array([row + [-1] * (width - len(row)) for row in rows], dtype=np.int32)


def _groups(shared, tables: np.ndarray) -> list[tuple[list[int], int]]:
    """(sorted member rows, shared tokens) of each group (rows reading the same pages), whatever its items."""
    shared_lens, items, members = shared
    groups: dict[tuple, set] = {}
    for leader, first, count in items.tolist():
        rows = members[first:first + count].tolist()
        pages = int(shared_lens[leader]) // PAGE
        assert pages > 0 and set(shared_lens[rows].tolist()) == {pages * PAGE}
        assert (tables[rows, :pages] == tables[leader, :pages]).all()
        groups.setdefault(tuple(tables[leader, :pages].tolist()), set()).update(rows)
    return sorted((sorted(rows), len(pages) * PAGE) for pages, rows in groups.items())


def test_rows_sharing_their_first_pages_form_a_group_of_the_pages_they_all_share():
    tables = _tables([[1, 2, 3, 10], [1, 2, 3, 11], [1, 2, 4, 12], [7, 8, 13], [9, 14]])
    lens = np.array([4 * PAGE - 3, 4 * PAGE - 5, 4 * PAGE - 1, 3 * PAGE - 2, 2 * PAGE - 8])
    shared = shared_prefixes(tables, lens, PAGE, 16, min_saved_fraction=0.0)
    # rows 0-2 share pages 1, 2 (three rows at 2 pages save 4 page reads; 0 and 1 alone at 3 pages save 3)
    assert _groups(shared, tables) == [([0, 1, 2], 2 * PAGE)]
    assert shared[0].tolist() == [2 * PAGE] * 3 + [0, 0]


def test_a_longer_run_shared_by_subgroups_wins_when_it_saves_more():
    """A one-page system prompt under four 5-page documents, eight rows each: four groups of 6 pages save
    4 x 7 x 6 page reads, one group of 1 page 31."""
    rows = [[0] + [10 + 5 * doc + j for j in range(5)] + [100 + 8 * doc + i] for doc in range(4) for i in range(8)]
    lens = np.full(32, 6 * PAGE + 3)
    tables = _tables(rows)
    shared = shared_prefixes(tables, lens, PAGE, 16)
    assert _groups(shared, tables) == [(list(range(8 * doc, 8 * doc + 8)), 6 * PAGE) for doc in range(4)]


def test_rows_left_out_of_the_longer_subgroups_still_share_the_common_run():
    """Rows 0, 1 and 3 agree for four pages, 2 and 4 only on the first with them: 0, 1, 3 read four pages once
    and 2, 4 one page once (9 page reads saved), rather than 2 and 4 reading theirs alone (8)."""
    tables = _tables([[1, 2, 3, 4, 12, 13, 14], [1, 2, 3, 4, 12, 13, 14], [1, 2, 16, 17], [1, 2, 3, 4, 5, 6], [1, 18]])
    lens = np.array([209, 193, 123, 166, 61])
    shared = shared_prefixes(tables, lens, 32, 16, min_saved_fraction=0.0)
    assert shared[0].tolist() == [128, 128, 32, 128, 32]
    assert len(shared[1]) == 2 and sorted(shared[2].tolist()) == [0, 1, 2, 3, 4]


def test_the_page_holding_a_rows_newest_token_is_never_shared():
    """Two rows with the very same pages (one request's completions right after the fork, or verification rows
    of one sequence): the page their newest tokens lie in may still be written, so only the pages before it."""
    tables = _tables([[5, 6, 7], [5, 6, 7]])
    shared = shared_prefixes(tables, np.array([2 * PAGE + 1, 3 * PAGE]), PAGE, 16, min_saved_fraction=0.0)
    assert _groups(shared, tables) == [([0, 1], 2 * PAGE)]
    # a context inside its first page shares nothing
    assert shared_prefixes(tables, np.array([PAGE, PAGE]), PAGE, 16, min_saved_fraction=0.0) is None


@pytest.mark.parametrize("num_rows,rows_per_item", [(16, 16), (17, 16), (40, 16), (7, 3)])
def test_a_group_is_spread_evenly_over_items_of_at_most_rows_per_item(num_rows, rows_per_item):
    tables = _tables([[1, 2, 100 + i] for i in range(num_rows)])
    shared_lens, items, members = shared_prefixes(tables, np.full(num_rows, 2 * PAGE + 5), PAGE, rows_per_item)
    counts = items[:, 2]
    assert counts.sum() == num_rows and counts.max() <= rows_per_item and counts.max() - counts.min() <= 1
    assert counts.min() >= 2                     # a graph's item capacity is half its rows
    assert sorted(members.tolist()) == list(range(num_rows))
    for leader, first, count in items.tolist():
        assert leader == members[first]            # an item reads the pages through one of its own rows
    assert shared_lens.tolist() == [2 * PAGE] * num_rows


def test_nothing_shared_or_too_little_saved_gives_none():
    distinct = _tables([[3 * i, 3 * i + 1, 3 * i + 2] for i in range(8)])
    assert shared_prefixes(distinct, np.full(8, 3 * PAGE), PAGE, 16) is None
    assert shared_prefixes(distinct[:1], np.array([3 * PAGE]), PAGE, 16, min_saved_fraction=0.0) is None
    # two of eight rows share one page of their three: 1 page saved of 24 read, under MIN_SAVED_FRACTION
    few = distinct.copy()
    few[1, 0] = few[0, 0]
    lens = np.full(8, 3 * PAGE)
    assert PAGE / lens.sum() < MIN_SAVED_FRACTION
    assert shared_prefixes(few, lens, PAGE, 16) is None
    assert _groups(shared_prefixes(few, lens, PAGE, 16, min_saved_fraction=0.0), few) == [([0, 1], PAGE)]


def test_padding_of_the_tables_is_never_a_shared_page():
    """-1 pads a shorter row's table: rows whose contexts end before it share nothing there."""
    tables = _tables([[1, 2], [1, 2], [1, 2, 3, 4], [1, 2, 3, 4]])
    lens = np.array([2 * PAGE, 2 * PAGE, 4 * PAGE, 4 * PAGE])
    # rows 0-1 hold their newest tokens in their second page: they share the first; rows 2-3 share three
    # (one group of four at 1 page saves 3 page reads; 0-1 at 1 page and 2-3 at 3 pages save 4)
    assert _groups(shared_prefixes(tables, lens, PAGE, 16, min_saved_fraction=0.0), tables) == \
        [([0, 1], PAGE), ([2, 3], 3 * PAGE)]


# the engine tests below run generate loops to their end: a regression that never ends them fails, not hangs CI
@pytest.mark.timeout(300)
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU tests cover the Triton backend")
def test_the_engine_reads_shared_pages_once_and_decodes_as_transformers(make_checkpoint, monkeypatch):
    """Our Triton backend in the whole engine (the interpreter, float32): four prompts over a 40-token prefix
    cached by an earlier call decode with their two shared pages grouped, and give transformers' greedy
    tokens."""
    model_dir = make_checkpoint(num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=64)
    rng = random.Random(0)
    prefix = [rng.randrange(512) for _ in range(40)]
    prompts = [prefix + [rng.randrange(512) for _ in range(rng.randint(1, 10))] for _ in range(4)]
    hf = load_hf_model(model_dir)
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    grouped = record_groupings(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(model_dir), device="cpu", attention_backend="triton", kvcache_block_size=16,
             max_model_len=128) as llm:
        llm.generate([prefix + [1]], params, use_tqdm=False)       # caches the prefix's pages
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected
    assert any(g is not None and g[0].tolist() == [32] * 4 for g in grouped)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", [
    pytest.param("cpu", id="interpreter", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter runs the kernels on CPU tensors")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_grouped_rows_under_what_users_mix(make_checkpoint, monkeypatch, device):
    """Our Triton backend (the interpreter, or a GPU through the decode graphs that group rows), float32, one
    batch over a cached 100-token prefix in 16-token pages, in a cache that preempts: greedy requests ending on
    stop strings, seeded n = 3 requests whose completions end at different steps, and a request aborted mid-run.
    Decode steps group the rows over the prefix's six pages; the greedy requests end as with every row reading
    its own pages (text, tokens, finish reason), every request ends, and nothing stays held."""
    from mixed_batch import assert_mixed_outputs
    model_dir = make_checkpoint(num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=64)
    rng = random.Random(12)
    prefix = [rng.randrange(1, 512) for _ in range(100)]
    prompts = [prefix + [rng.randrange(1, 512) for _ in range(n)] for n in (10, 3, 9, 17, 25)]
    settings = dict(device=device, attention_backend="triton", kvcache_block_size=16, max_model_len=256,
                    num_kvcache_blocks=14, max_num_batched_tokens=128)
    grouped = record_groupings(monkeypatch)

    def run(share_prefixes: bool, requests: list, params: list) -> list[dict]:
        before = len(grouped)
        with LLM(str(model_dir), **settings) as llm:
            del grouped[before:]       # what a GPU's warm-up grouped
            if device == "cuda":       # the decode graphs for groups were captured, whatever this run reads
                assert llm.model_runner.graphs.shared_sizes
            llm.model_runner.share_prefixes = share_prefixes
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            aborted = llm.add_request(prompts[4], SamplingParams(temperature=0.8, max_tokens=60, ignore_eos=True))
            for _ in range(3):
                llm.step()
            llm.abort_request(aborted)
            outputs = llm.generate(requests, params, use_tqdm=False)
            assert llm.stats["num_preemptions"] > 0 or len(requests) == 3     # the mix overflows the cache
            assert llm.is_finished() and llm.scheduler.block_manager.used_block_ids == set()
        return outputs

    free = run(False, prompts[:3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    middles = [out["text"][len(out["text"]) // 2:][:2] for out in free]
    stopped = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[m] if m.strip() else None)
               for m in middles]
    expected = run(False, prompts[:3], stopped)
    assert any(out["finish_reason"] == "stop" for out in expected) and not grouped
    sampled = [SamplingParams(n=3, temperature=1.0, seed=70 + i, max_tokens=6 + 5 * i,
                              stop_token_ids=list(range(7, 512, 10))) for i in range(2)]
    outputs = run(True, prompts[:3] + prompts[3:5], stopped + sampled)
    assert any(g is not None and (g[0] == 96).sum() >= 4 for g in grouped)
    assert_mixed_outputs(outputs[:3], expected, outputs[3:], sampled)
