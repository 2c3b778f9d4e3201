"""IncrementalDetokenizer, with the real SmolLM2-135M-Instruct tokenizer (byte-level BPE): the text is what
the completion adds to the prompt's text (tests/engine/test_output_text.py checks that definition on three
kinds of tokenizer), held back while a character is unfinished, with stop strings found as it grows."""
import random

import pytest

from nanovllm.engine.detokenizer import MAX_HELD, PROMPT_CONTEXT, IncrementalDetokenizer
from token_groups import groups

pytestmark = pytest.mark.cpu_only     # tokenizers only

SENTENCE = " The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from nanovllm.utils.gguf_checkpoint import default_model
    return AutoTokenizer.from_pretrained(default_model())


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode("Complete the sentence:")


def feed_and_check(tok, prompt, ids, cuts, skip_special_tokens=True):
    """Feed ids in the given groups; after each, the text is what they add to the prompt's text (minus a
    held U+FFFD tail). The prompt ends in whole characters, so that is decode(ids) here."""
    detok = IncrementalDetokenizer(tok, prompt, [], skip_special_tokens=skip_special_tokens)
    prompt_text = tok.decode(prompt, skip_special_tokens=skip_special_tokens)
    seen = []
    for group in cuts:
        assert detok.append(group) is None
        seen += group
        full = tok.decode(prompt + seen, skip_special_tokens=skip_special_tokens)
        assert full.startswith(prompt_text)
        full = full[len(prompt_text):]
        assert full == tok.decode(seen, skip_special_tokens=skip_special_tokens)
        assert full.startswith(detok.text)
        if not full.endswith("\ufffd"):
            assert detok.text == full
    assert seen == ids and detok.stop_reason is None
    return detok


def test_text_equals_decode_for_a_sentence_one_token_at_a_time_and_in_uneven_groups(tok, prompt):
    ids = tok.encode(SENTENCE * 3)
    assert feed_and_check(tok, prompt, ids, [[t] for t in ids]).text == SENTENCE * 3
    for seed in range(5):
        assert feed_and_check(tok, prompt, ids, groups(ids, random.Random(seed))).text == SENTENCE * 3
    assert feed_and_check(tok, [], ids, [[t] for t in ids]).text == SENTENCE * 3   # no prompt to seed from


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_equals_decode_for_random_token_ids(tok, prompt, skip_special_tokens):
    rng = random.Random(1234)
    for _ in range(60):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        cuts = [[t] for t in ids] if rng.random() < 0.5 else list(groups(ids, rng))
        feed_and_check(tok, prompt, ids, cuts, skip_special_tokens)


@pytest.fixture(scope="module")
def byte_ids(tok):
    """Tokens that decode alone to U+FFFD: pieces of multi-byte characters."""
    return [i for i in range(len(tok)) if tok.decode([i]) == "\ufffd"]


def test_random_byte_tokens_that_rarely_form_characters(tok, prompt, byte_ids):
    # mostly byte pieces in random order: invalid UTF-8, with the odd character completed
    rng = random.Random(7)
    for _ in range(100):
        ids = [rng.choice(byte_ids) if rng.random() < 0.8 else rng.randrange(len(tok)) for _ in range(30)]
        feed_and_check(tok, prompt, ids, groups(ids, rng, most=3))


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_inside_the_completion(tok, prompt, skip_special_tokens):
    im_start, im_end, repo_name = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<repo_name>"])
    words = tok.encode(SENTENCE)
    ids = [im_start] + words[:3] + [repo_name, im_end] + words[3:] + [im_end, im_end]
    detok = feed_and_check(tok, prompt, ids, [[t] for t in ids], skip_special_tokens)
    assert ("<repo_name>" in detok.text) is not skip_special_tokens
    assert detok.text == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_character_split_across_tokens_is_held_back_until_complete(tok, prompt):
    text = "😀 日本語 ok"
    ids = tok.encode(text)
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))   # the case really arises
    detok = IncrementalDetokenizer(tok, prompt, [])
    for t in ids:
        detok.append([t])
        assert "\ufffd" not in detok.text and text.startswith(detok.text)
    assert detok.text == text


def test_stop_string_spanning_two_tokens(tok, prompt):
    ids = tok.encode(SENTENCE)
    assert [tok.decode([t]) for t in ids[2:4]] == [" brown", " fox"]
    for include, expected in [(False, " The quick br"), (True, " The quick brown fo")]:
        detok = IncrementalDetokenizer(tok, prompt, ["own fo"], include_stop_str_in_output=include)
        assert [detok.append([t]) for t in ids[:3]] == [None] * 3
        assert detok.stop_reason is None
        assert detok.append([ids[3]]) == "own fo"
        assert (detok.text, detok.stop_reason) == (expected, "own fo")
        assert detok.append(ids[4:]) is None and detok.text == expected   # tokens past the stop are ignored


def test_several_stop_strings_the_earliest_wins_and_ties_go_to_the_first_listed(tok, prompt):
    ids = tok.encode(SENTENCE)
    detok = IncrementalDetokenizer(tok, prompt, ["dog", "lazy", "quick"])
    assert detok.append(ids) == "quick" and detok.text == " The "
    detok = IncrementalDetokenizer(tok, prompt, ["dog", "quick brown", "quick"], include_stop_str_in_output=True)
    assert detok.append(ids) == "quick brown" and detok.text == " The quick brown"


def test_stop_string_at_the_very_start(tok, prompt):
    ids = tok.encode(SENTENCE)
    for include, expected in [(False, ""), (True, " The")]:
        detok = IncrementalDetokenizer(tok, prompt, [" The"], include_stop_str_in_output=include)
        assert detok.append([ids[0]]) == " The"
        assert (detok.text, detok.stop_reason) == (expected, " The")


def test_min_tokens_delays_stop_strings(tok, prompt):
    ids = tok.encode(" the fox ran and the fox sat")
    assert len(ids) == 7 and tok.decode(ids[1:2]) == " fox"

    def run(stop, min_tokens):
        detok = IncrementalDetokenizer(tok, prompt, [stop], min_tokens=min_tokens)
        for n, t in enumerate(ids, 1):
            if detok.append([t]) is not None:
                return n, detok.text
        return None, detok.text

    # as vLLM: a stop string counts once it ends in a token past the first min_tokens
    assert run("fox", 0) == (2, " the ")
    assert run("fox", 1) == (2, " the ")
    assert run("fox", 2) == (6, " the fox ran and the ")     # completed by the 2nd token: too early
    assert run("fox ran", 2) == (3, " the ")                 # the lookback still sees text from before min_tokens
    assert run("fox ran", 3) == (None, " the fox ran and the fox sat")
    assert run("fox", 8) == (None, " the fox ran and the fox sat")


def test_no_stop_strings_only_detokenizes(tok, prompt):
    ids = tok.encode(SENTENCE)
    detok = IncrementalDetokenizer(tok, prompt, [], min_tokens=3)
    assert [detok.append([t]) for t in ids] == [None] * len(ids)
    assert (detok.text, detok.stop_reason) == (SENTENCE, None)


class CountingTokenizer:
    """Passes decode through, recording how many ids each call decodes (and nothing else is allowed)."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kwargs)


@pytest.mark.parametrize("kind", ["text", "specials", "held then specials", "bytes", "random"])
@pytest.mark.parametrize("group", [1, 4])
def test_each_append_decodes_a_bounded_window(tok, prompt, byte_ids, kind, group):
    rng = random.Random(3)
    ids = {"text": (tok.encode(SENTENCE + " 😀 日本語.") * 100)[:500],
           "specials": [tok.eos_token_id] * 500,                              # skipped: they print nothing
           "held then specials": tok.encode("日")[:1] + [tok.eos_token_id] * 499,   # a character never completed
           "bytes": [rng.choice(byte_ids) for _ in range(500)],                 # mostly invalid UTF-8
           "random": [rng.randrange(len(tok)) for _ in range(500)]}[kind]
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, prompt * 50, ["never appears"])
    per_call = []
    for i in range(0, len(ids), group):
        before = counting.decoded
        assert detok.append(ids[i:i + group]) is None
        per_call.append(counting.decoded - before)
    # a few decodes (context, window, at most 3 shorter windows where a character is unfinished) of a
    # window of a few groups plus the tokens held back, however long the completion grows
    assert max(per_call) <= 6 * (2 * PROMPT_CONTEXT + MAX_HELD + 3 * group), per_call
    detok.append(tok.encode(" end"))     # completes or settles whatever was held back
    assert detok.text == tok.decode(ids + tok.encode(" end"), skip_special_tokens=True)
