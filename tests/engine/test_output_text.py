"""A completion's `text` has one definition, whatever the stop settings (issue 23, item 2).

It is detokenized in the prompt's context (vLLM's definition):

    decode(prompt_ids) + text == decode(prompt_ids + output_ids)     (the same skip_special_tokens)

except that a character still unfinished at the end (a trailing U+FFFD run) is left out, and a completion
that finishes the prompt's unfinished last character starts with it (`reference` below spells it out).
Checked on three kinds of tokenizer: byte-level BPE (the real SmolLM2 one), a WordLevel vocabulary whose
decode joins tokens with spaces, and SentencePiece-style "▁" pieces with byte fallback; through
OutputProcessor (text at the end for requests without stop strings, token by token for requests with),
IncrementalDetokenizer in any grouping, and LLM.generate / LLM.chat end to end.
"""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.messages import CompletionUpdate
from nanovllm.engine.output_processor import OutputProcessor
from token_groups import groups

pytestmark = pytest.mark.cpu_only     # tokenizers, and engines on device="cpu"

FFFD = "\ufffd"
NEVER = "a stop string that never shows up"


# ---- the definition, from whole decodes ------------------------------------------------------------------
def reference(tok, prompt: list[int], output: list[int], skip_special_tokens: bool = True) -> str:
    """What output adds to the prompt's text (detokenizer.py): up to its last complete character when it
    ends in an unfinished one (the decode without its last 1-3 tokens, the nearest that ends in a complete
    character, else before the trailing U+FFFD); from the character it finishes when the prompt ends in
    an unfinished one. Not for byte-fallback runs of invalid UTF-8 (not prefix-stable)."""
    def decode(ids):
        return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    full = decode(prompt + output)
    end = len(full.rstrip(FFFD))
    if end < len(full):
        for back in range(1, min(len(output), 4)):
            ended = decode(prompt + output[:-back])
            if not ended.endswith(FFFD):
                if len(ended) > end:            # a byte-fallback run shows as U+FFFD once unfinished
                    full, end = ended, len(ended)
                break
    before = decode(prompt)
    if not full.startswith(before):
        before = before.rstrip(FFFD)            # the output finishes the prompt's last character
    if not full.startswith(before):             # a byte-fallback run the output leaves unfinished hides
        assert end < len(before)                # the prompt's last characters: nothing complete yet
        return ""
    return full[len(before):end]


def assert_identity(tok, prompt, output, text, skip_special_tokens=True):
    """text is the reference, and where nothing is unfinished, exactly prompt text + text == decode(all)."""
    assert text == reference(tok, prompt, output, skip_special_tokens)
    full = tok.decode(prompt + output, skip_special_tokens=skip_special_tokens)
    before = tok.decode(prompt, skip_special_tokens=skip_special_tokens)
    if not full.endswith(FFFD) and not before.endswith(FFFD):
        assert before + text == full


# ---- three tokenizers ------------------------------------------------------------------------------------
def wordlevel_tokenizer():
    """Whole-word tokens, decoded joined by spaces (the tokenizers library's default with no decoder)."""
    words = [f"<b{i}>" for i in range(300)] + ["the", "cat", "sat", "on", "mat", ".", ",", "'s", "!"]
    vocab = {"[UNK]": 0, "<eos>": 1, "<bos>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<eos>", "<bos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", bos_token="<bos>",
                                   unk_token="[UNK]")


SP_PIECES = ["▁the", "▁cat", "▁sat", "▁on", "▁mat", "▁", "s", "ing", "▁hello", "▁world", "!", ".", "▁a",
             "b", "c", "▁é", "日本"]


def sentencepiece_tokenizer():
    """SentencePiece-style: "▁" pieces (Metaspace, whose decode drops the first piece's space) and
    byte-fallback tokens <0x00>..<0xFF> for characters outside the vocabulary."""
    vocab = ([("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
             + [(piece, -1.0) for piece in SP_PIECES])
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(),
                                           decoders.Metaspace(replacement="▁", prepend_scheme="always")])
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizers():
    from transformers import AutoTokenizer

    from nanovllm.utils.gguf_checkpoint import default_model
    return {"byte-level": AutoTokenizer.from_pretrained(default_model()), "wordlevel": wordlevel_tokenizer(),
            "sentencepiece": sentencepiece_tokenizer()}


def random_ids(name, tok, rng, lo, hi):
    """Random token ids, special ones included. Not byte-fallback tokens at random: a run of them that
    is not valid UTF-8 decodes to U+FFFD as a whole, the characters before the bad byte too, so decode
    is not prefix-stable there (detokenizer.py); valid byte-fallback text is tested below."""
    pool = range(len(tok)) if name != "sentencepiece" else [i for i in range(len(tok)) if not 3 <= i < 259]
    return [rng.choice(pool) for _ in range(rng.randint(lo, hi))]


def run_request(processor: OutputProcessor, prompt, output, params: SamplingParams, eos: bool = False,
                stream: bool = False) -> dict:
    """What LLM.generate (stream=False) or AsyncLLM (stream=True) makes of a request whose sampled tokens
    are `output`, arriving one a step: stop strings found as each token arrives (eos ends the request
    unchecked), the output dict once it has finished."""
    processor.add_request("r", list(prompt), params, stream=stream)
    for i, token_id in enumerate(output):
        last = i == len(output) - 1
        finish = ("stop" if eos else "length") if last else None
        _, stopped = processor.process([CompletionUpdate("r", 0, [token_id], finish_reason=finish)])
        if stopped or last:
            break
    return processor.take("r").output["outputs"][0]


# ---- the identity ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("name", ["byte-level", "wordlevel", "sentencepiece"])
def test_text_is_what_the_completion_adds_to_the_prompt(tokenizers, name, skip_special_tokens):
    tok, rng = tokenizers[name], random.Random(f"{name} {skip_special_tokens}")
    processor = OutputProcessor(tok)
    for _ in range(60):
        prompt, output = random_ids(name, tok, rng, 1, 12), random_ids(name, tok, rng, 1, 24)
        texts = []
        for stop in (None, [NEVER]):             # at the end in one call; token by token
            params = SamplingParams(max_tokens=64, stop=stop, skip_special_tokens=skip_special_tokens)
            out = run_request(processor, prompt, output, params)
            assert (out["finish_reason"], out["token_ids"]) == ("length", output)
            texts.append(out["text"])
            # ended by eos: the last token is not shown (as vLLM), the text is the rest's
            out = run_request(processor, prompt, output, params, eos=True)
            assert_identity(tok, prompt, output[:-1], out["text"], skip_special_tokens)
        assert texts[0] == texts[1]
        assert_identity(tok, prompt, output, texts[0], skip_special_tokens)
        # any grouping of the tokens into calls gives the same text
        detokenizer = IncrementalDetokenizer(tok, prompt, [], skip_special_tokens=skip_special_tokens)
        for group in groups(output, rng):
            detokenizer.append(group)
        assert detokenizer.text == texts[0]


def test_a_space_joined_vocabulary_gets_the_separator_in_front_with_or_without_stop(tokenizers):
    """The issue's case: the text was '<b146> <b246> ...' without stop and ' <b146> <b246> ...' with."""
    tok = tokenizers["wordlevel"]
    prompt = tok.encode("the cat sat on the mat")
    output = tok.convert_tokens_to_ids(["<b146>", "<b246>", "<b7>", "!"])
    processor = OutputProcessor(tok)
    plain = run_request(processor, prompt, output, SamplingParams(max_tokens=64))["text"]
    stopped = run_request(processor, prompt, output, SamplingParams(max_tokens=64, stop=["<b7>"]))["text"]
    assert plain == " <b146> <b246> <b7> !"
    assert tok.decode(prompt) + plain == tok.decode(prompt + output)
    assert stopped == plain[:plain.find("<b7>")] == " <b146> <b246> "


@pytest.mark.parametrize("name", ["byte-level", "sentencepiece"])
def test_characters_split_over_tokens(tokenizers, name):
    """Multi-byte characters in byte tokens: whole in the text once complete, never half; a prompt that
    ends inside a character the completion finishes; a completion that ends inside one."""
    tok = tokenizers[name]
    sentence = "the cat 😀 sat 日本 on é the€€ mat 😀😀"
    ids = tok.encode(sentence, add_special_tokens=False)
    split = [i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(FFFD)]
    assert len(split) >= 6                                           # the cases really arise
    processor = OutputProcessor(tok)
    for cut in range(1, len(ids)):                                  # wherever the prompt ends, ...
        for end in (len(ids), *[i for i in split if i > cut][:2]):   # ... and the completion
            prompt, output = ids[:cut], ids[cut:end]
            texts = [run_request(processor, prompt, output, SamplingParams(max_tokens=64, stop=stop))["text"]
                     for stop in (None, [NEVER])]
            assert texts[0] == texts[1]
            assert_identity(tok, prompt, output, texts[0])
            # whole characters only: the prompt's complete ones, then the completion's
            assert sentence.startswith(tok.decode(prompt).rstrip(FFFD) + texts[0])
            assert FFFD not in texts[0]


# ---- stop strings cut the one text ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["byte-level", "wordlevel", "sentencepiece"])
def test_a_stop_string_cuts_the_text_the_request_has_without_it(tokenizers, name):
    tok, rng = tokenizers[name], random.Random(5)
    processor = OutputProcessor(tok)
    checked = 0
    for _ in range(60):
        prompt, output = random_ids(name, tok, rng, 1, 12), random_ids(name, tok, rng, 4, 24)
        plain = run_request(processor, prompt, output, SamplingParams(max_tokens=64))
        text = plain["text"]
        if len(text) < 4:
            continue
        i = rng.randrange(len(text) - 2)
        stop = text[i:i + rng.randint(1, 3)]
        for include in (False, True):
            out = run_request(processor, prompt, output,
                              SamplingParams(max_tokens=64, stop=[NEVER, stop], include_stop_str_in_output=include))
            cut = text.find(stop)
            assert out["text"] == text[:cut + (len(stop) if include else 0)]
            assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop)
            assert output[:len(out["token_ids"])] == out["token_ids"]
        checked += 1
    assert checked >= 40


# ---- streaming: what IncrementalDetokenizer promises an async server --------------------------------------
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("name", ["byte-level", "wordlevel", "sentencepiece"])
def test_streamed_pieces_add_up_to_the_text(tokenizers, name, include):
    """Sending text_from(sent) up to stable_length after each call, and the rest at the end, sends the
    final text; the stable part never changes, and a stop string cuts only after it."""
    tok, rng = tokenizers[name], random.Random(9)
    for _ in range(40):
        prompt, output = random_ids(name, tok, rng, 1, 12), random_ids(name, tok, rng, 4, 24)
        text = reference(tok, prompt, output)
        stop = ["zz", text[len(text) // 2:len(text) // 2 + 3]] if text and rng.random() < 0.7 else ["zz"]
        detokenizer = IncrementalDetokenizer(tok, prompt, stop, include_stop_str_in_output=include)
        sent = ""
        for group in groups(output, rng):
            detokenizer.append(group)
            stable = detokenizer.stable_length
            assert len(sent) <= stable <= len(detokenizer.text)
            assert detokenizer.text.startswith(sent)
            sent += detokenizer.text_from(len(sent))[:stable - len(sent)]
            assert sent == detokenizer.text[:stable]
        sent += detokenizer.text_from(len(sent))     # the request ended
        assert sent == detokenizer.text
        if detokenizer.stop_reason is None:
            assert sent == text
        else:
            cut = text.find(detokenizer.stop_reason)
            assert sent == text[:cut + (len(detokenizer.stop_reason) if include else 0)]


# ---- end to end -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model):
    """The tiny random Qwen3; its tokenizer is byte-level (random ids decode to any bytes)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16, max_model_len=128,
             num_kvcache_blocks=40) as llm:
        yield llm
    torch.set_num_threads(threads)


def test_generate_and_chat_text_is_detokenized_in_the_prompts_context(tiny):
    tok = tiny.tokenizer
    rng = random.Random(23)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(5, 20))] for _ in range(3)] + ["The sea is"]
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=20, ignore_eos=True, logprobs=1)
    outputs = tiny.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        prompt_ids = out["prompt_token_ids"]
        assert prompt_ids == (prompt if isinstance(prompt, list) else tok.encode(prompt))
        assert len(out["outputs"]) == 2 and out["outputs"][0]["token_ids"] != out["outputs"][1]["token_ids"]
        for completion in out["outputs"]:
            assert_identity(tok, prompt_ids, completion["token_ids"], completion["text"])
        # with a stop string from each completion's text: the same text, cut there
        completion = out["outputs"][1]
        text = completion["text"]
        stop = text[len(text) // 2:len(text) // 2 + 2]
        [stopped] = tiny.generate([prompt], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=20,
                                                           ignore_eos=True, stop=[stop]), use_tqdm=False)
        assert stopped["outputs"][1]["text"] == text[:text.find(stop)]
        assert stopped["outputs"][1]["stop_reason"] == stop
        for cut, full in zip(stopped["outputs"], out["outputs"]):
            assert cut["token_ids"] == full["token_ids"][:len(cut["token_ids"])]
            if cut["stop_reason"] is not None:
                assert cut["text"] == full["text"][:full["text"].find(cut["stop_reason"])]
    # chat goes through generate: the rendered template is the prompt
    conversation = [{"role": "user", "content": "Hi"}]
    [chat] = tiny.chat(conversation, params, use_tqdm=False)
    for completion in chat["outputs"]:
        assert_identity(tok, chat["prompt_token_ids"], completion["token_ids"], completion["text"])
