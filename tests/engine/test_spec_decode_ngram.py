"""Speculative decoding's n-gram proposer (prompt lookup) and its configuration: what a sequence's tokens
propose (the longest, then earliest, earlier match of its last tokens; the tokens that followed it), the
caps the engine gives, and speculative_config as vLLM spells it, bad ones refused by name."""
import argparse

import numpy as np
import pytest

from nanovllm.config import Config
from nanovllm.engine.ngram_proposer import NgramProposer, ngram_draft
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.cli_args import add_dataclass_options, dataclass_kwargs

pytestmark = pytest.mark.cpu_only     # numpy drafts and host bookkeeping only


def ngram(k: int, lookup_min: int, lookup_max: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": lookup_max,
            "prompt_lookup_min": lookup_min, "adaptive": True}


@pytest.mark.parametrize("context, k, lookup, draft", [
    ([1, 2, 3, 4, 2, 3], 4, (2, 3), [4, 2, 3]),          # [2, 3] matches at 1: three tokens follow it
    ([1, 2, 3, 9, 2, 3, 7, 2, 3], 2, (2, 3), [9, 2]),     # two matches of [2, 3]: the earliest
    ([5, 1, 2, 3, 8, 0, 2, 3, 6, 1, 2, 3], 3, (2, 3), [8, 0, 2]),   # [1, 2, 3] beats the earlier [2, 3]
    ([7, 7, 7], 3, (2, 2), [7]),                         # a match may overlap the suffix
    ([1, 2, 3, 4], 3, (1, 2), []),                       # nothing matches
    ([1, 2, 1, 2], 3, (3, 4), []),                       # [1, 2] matches, but 3 tokens are the least
    ([4, 4], 2, (1, 1), [4]),
    ([3], 2, (1, 1), []),
])
def test_ngram_draft_proposes_what_followed_the_longest_earliest_match(context, k, lookup, draft):
    assert ngram_draft(np.array(context), k, *lookup).tolist() == draft


def brute_force_draft(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule spelled out: for n from the longest down, the earliest end e < len - 1 whose n tokens up to
    e equal the last n tokens; the k tokens after it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for end in range(n - 1, len(tokens) - 1):
            if tokens[end - n + 1:end + 1] == tokens[len(tokens) - n:]:
                return tokens[end + 1:end + 1 + k]
    return []


def test_ngram_draft_follows_the_rule_on_random_sequences():
    """Small vocabularies (many candidates: the numpy path) and larger ones (few: the Python path), short
    and long sequences, every lookup range."""
    rng = np.random.default_rng(0)
    for _ in range(3000):
        length, vocab = int(rng.integers(1, 80)), int(rng.choice([2, 3, 5, 40]))
        tokens = rng.integers(0, vocab, length).tolist()
        k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        assert ngram_draft(np.array(tokens, dtype=np.int64), k, min_n, max_n).tolist() == \
            brute_force_draft(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)


def test_the_proposer_caps_each_sequence_and_follows_it_as_it_grows():
    """At most min(k, max_drafts) tokens each (none for a cap of 0 or less); the tokens a sequence gains
    later are seen the next time (each one's array grows, only by what is new)."""
    proposer = NgramProposer(3, 1, 2)
    a = Sequence([1, 2, 3, 4, 1, 2, 3], SamplingParams(), 16)
    b = Sequence([9, 8, 9], SamplingParams(), 16)
    assert proposer.propose([a, b], [5, 5]) == [[4, 1, 2], [8, 9]]
    assert proposer.propose([a, b], [2, 0]) == [[4, 1], []]
    a.append_token(7)               # [.., 3, 7]: no 7 before it, nor any pair ending in 7
    b.append_token(8)               # [9, 8, 9, 8]: [9, 8] matches at 0
    assert proposer.propose([a, b], [5, 5]) == [[], [9, 8]]


@pytest.mark.parametrize("config, words", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "draft_model needs model"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "eagle3 needs model"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an int"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "'ngram' takes no model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft": "x"}, r"unknown key\(s\) \['draft'\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive must be true or false"),
])
def test_a_bad_speculative_config_is_refused_by_name(tiny_model, config, words):
    with pytest.raises(ValueError, match=words):
        Config(str(tiny_model), speculative_config=config)


def test_lookup_bounds_default_as_vllm_and_the_option_parses_from_json(tiny_model):
    """Neither bound: both 5; one: the other takes it. `nanovllm serve --speculative-config JSON` (any
    command built on Config's fields) hands the dict through."""
    config = Config(str(tiny_model), speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculative_config == ngram(3, 5, 5)
    config = Config(str(tiny_model), speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_max": 4})
    assert config.speculative_config == ngram(3, 4, 4)
    parser = argparse.ArgumentParser()
    add_dataclass_options(parser, Config, "engine", skip=("model",))
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert dataclass_kwargs(args, Config, skip=("model",)) == {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
