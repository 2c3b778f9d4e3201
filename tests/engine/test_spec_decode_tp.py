"""Speculative decoding under tensor parallelism on CPU (two gloo ranks, rank 1 spawned): every rank runs
the verification's forward pass (ModelRunner.verify gets the drafts with the call), rank 0 samples and
accepts, and the tokens are the one-rank engine's without speculation, greedy and seeded with penalties, and
under a grammar (the masks go to rank 0 alone)."""
import re

import pytest

from nanovllm import LLM, SamplingParams

pytestmark = [pytest.mark.timeout(300),  # worker processes: a regression must fail, not hang CI
              pytest.mark.cpu_only]      # every engine is device="cpu" (gloo ranks)

SHAPE = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=64, intermediate_size=96)
PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 8 + [14], [300 + i % 7 for i in range(33)],
           [20 + i % 5 for i in range(32)]]      # the last: two whole pages (n = 2 copies a full one, EAGLE-3)
PARAMS = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
          SamplingParams(n=2, temperature=0.3, repetition_penalty=1.1, frequency_penalty=0.05, seed=5,
                         max_tokens=24, ignore_eos=True)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive": False}


def test_tp2_with_drafts_gives_the_tokens_of_one_rank_without(make_checkpoint):
    model = str(make_checkpoint(**SHAPE))
    settings = dict(device="cpu", kvcache_block_size=16, max_model_len=128)
    prompts = [p for p in PROMPTS for _ in PARAMS]
    params = PARAMS * len(PROMPTS)
    with LLM(model, **settings) as one:
        expected = one.generate(prompts, params, use_tqdm=False)
    with LLM(model, tensor_parallel_size=2, speculative_config=NGRAM, **settings) as two:
        outputs = two.generate(prompts, params, use_tqdm=False)
        assert two.stats["spec_decode_accepted_tokens"] > 0
    assert [o["outputs"] for o in outputs] == [o["outputs"] for o in expected]



def test_tp2_with_drafts_under_a_grammar_gives_the_tokens_of_one_rank_without(make_checkpoint):
    """Structured outputs' masks reach rank 0's verification alone (the workers run the forward pass): the
    constrained tokens, greedy and seeded, are the one-rank engine's without speculation."""
    pytest.importorskip("xgrammar")
    from nanovllm import StructuredOutputsParams
    model = str(make_checkpoint(**SHAPE))
    settings = dict(device="cpu", kvcache_block_size=16, max_model_len=128)
    constraint = StructuredOutputsParams(regex="(ab|cd)+ [0-9]{1,3}")
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=constraint),
              SamplingParams(n=2, temperature=0.8, seed=9, max_tokens=24, structured_outputs=constraint)]
    with LLM(model, **settings) as one:
        prompts = [one.tokenizer.encode("abcdabab 12 cdab 7 ") * 3] + PROMPTS[:2]
        expected = one.generate([p for p in prompts for _ in params], params * len(prompts), use_tqdm=False)
    with LLM(model, tensor_parallel_size=2, speculative_config=NGRAM, **settings) as two:
        outputs = two.generate([p for p in prompts for _ in params], params * len(prompts), use_tqdm=False)
        assert two.stats["spec_decode_accepted_tokens"] > 0
    assert [o["outputs"] for o in outputs] == [o["outputs"] for o in expected]
    ended = [c["text"] for o in outputs for c in o["outputs"] if c["finish_reason"] == "stop"]
    assert ended and all(re.fullmatch("(ab|cd)+ [0-9]{1,3}", text) for text in ended)

def assert_tp2_drafts_as_one_rank(model: str, spec: dict) -> None:
    """Two ranks with a drafter give the one-rank engine's outputs with the same drafter (greedy and seeded
    with penalties), and greedy ones are plain decoding's."""
    settings = dict(device="cpu", kvcache_block_size=16, max_model_len=128)
    prompts = [p for p in PROMPTS for _ in PARAMS]
    params = PARAMS * len(PROMPTS)
    with LLM(model, **settings) as plain:
        greedy = plain.generate(PROMPTS, PARAMS[0], use_tqdm=False)
    with LLM(model, speculative_config=spec, **settings) as one:
        expected = one.generate(prompts, params, use_tqdm=False)
    with LLM(model, tensor_parallel_size=2, speculative_config=spec, **settings) as two:
        outputs = two.generate(prompts, params, use_tqdm=False)
        assert two.stats["spec_decode_draft_tokens"] > 0
    assert [o["outputs"] for o in outputs] == [o["outputs"] for o in expected]
    assert [o["outputs"] for o in outputs[::len(PARAMS)]] == [o["outputs"] for o in greedy]


def test_tp2_with_a_draft_model_gives_what_one_rank_gives(make_checkpoint):
    """The draft model is split over the ranks as the target is: every rank drafts (rank 0 draws and hands
    the drafts on)."""
    draft = str(make_checkpoint(**{**SHAPE, "num_hidden_layers": 1, "seed": 9}))
    assert_tp2_drafts_as_one_rank(str(make_checkpoint(**SHAPE)),
                                  {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                                   "adaptive": False})


def test_tp2_with_an_eagle3_head_gives_what_one_rank_gives(make_checkpoint, tmp_path):
    """An EAGLE-3 head is split over the ranks as the target is and reads the target's hidden states on
    each rank (the emitted tokens of a verification broadcast to every rank)."""
    from benchmarks.random_checkpoint import write_random_eagle3_head
    model = str(make_checkpoint(**{**SHAPE, "num_hidden_layers": 4}))
    head = str(write_random_eagle3_head(tmp_path / "head", model, draft_vocab_size=200, aux_layer_ids=[0, 2, 3]))
    assert_tp2_drafts_as_one_rank(model, {"method": "eagle3", "model": head, "num_speculative_tokens": 3,
                                          "adaptive": False})
