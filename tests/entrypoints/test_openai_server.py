"""`nanovllm serve` as its users reach it: a subprocess on the tiny checkpoint, driven by the official
openai client (sync and async) and raw HTTP. Greedy answers equal the offline LLM's; streamed chunks add
up to the non-streamed text; echo's prompt log-probs equal transformers'; logit_bias and allowed_token_ids as
offline; 32 concurrent streams; a client
that leaves frees its blocks; bad requests get 4xx and the server keeps serving."""
import asyncio
import json
import math
import socket
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import oracle  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.cpu_only]     # the servers run SERVER_ENGINE_ARGS (--device cpu); the LLM is device="cpu"

# the same engine settings as the server fixture's (conftest.SERVER_ENGINE_ARGS)
ENGINE = dict(device="cpu", enforce_eager=True, max_model_len=512, kvcache_block_size=16, num_kvcache_blocks=512)
HAS_PROMPT_LOGPROBS = "prompt_logprobs" in SamplingParams.__dataclass_fields__
GREEDY = dict(temperature=0.0, max_tokens=8)
CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(str(tiny_model), **ENGINE) as llm:
        yield llm


def offline(llm, prompt, **params) -> dict:
    [out] = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)
    return out


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(server) -> dict[str, float]:
    """The server's /metrics samples by name (labels dropped)."""
    samples = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name.split("{")[0] + ("{le=" + name.split("le=")[1] if "le=" in name else "")] = float(value)
    return samples


def test_completions_sync_client(server, llm):
    """Streamed chunks concatenate to the non-streamed text, which is the offline LLM's."""
    api = client(server)
    expected = offline(llm, "The capital of France is", **GREEDY)
    response = api.completions.create(model=server_model(server), prompt="The capital of France is", **GREEDY)
    [choice] = response.choices
    assert choice.text == expected["text"] and choice.finish_reason == expected["finish_reason"]
    assert response.usage.prompt_tokens == len(expected["prompt_token_ids"])
    assert response.usage.completion_tokens == len(expected["token_ids"])
    stream = api.completions.create(model=server_model(server), prompt="The capital of France is", stream=True,
                                    stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["text"]
    assert chunks[-1].usage.completion_tokens == len(expected["token_ids"])


def server_model(server) -> str:
    return client(server).models.list().data[0].id


def test_chat_sync_and_async_clients(server, llm):
    expected = llm.chat(CHAT, SamplingParams(**GREEDY), use_tqdm=False)[0]
    api = client(server)
    response = api.chat.completions.create(model=server_model(server), messages=CHAT, **GREEDY)
    assert response.choices[0].message.content == expected["text"]
    assert response.choices[0].message.role == "assistant"

    async def streamed() -> tuple[str, list]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as api:
            stream = await api.chat.completions.create(model=server_model(server), messages=CHAT, stream=True,
                                                       **GREEDY)
            chunks = [chunk async for chunk in stream]
            completion = await api.completions.create(model=server_model(server), prompt="Hi", **GREEDY)
        return chunks, completion

    chunks, completion = asyncio.run(streamed())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["text"]
    assert chunks[-1].choices[0].finish_reason == expected["finish_reason"]
    assert completion.choices[0].text == offline(llm, "Hi", **GREEDY)["text"]


def test_n_seed_stop(server, llm):
    api = client(server)
    model = server_model(server)
    sampled = dict(prompt=["Once upon", "a time"], n=3, temperature=1.0, seed=7, max_tokens=6)
    first, again = (api.completions.create(model=model, **sampled) for _ in range(2))
    assert [c.index for c in first.choices] == list(range(6))
    assert [c.text for c in first.choices] == [c.text for c in again.choices]      # seeded: repeatable
    for i, prompt in enumerate(sampled["prompt"]):     # choice i * n + j is prompt i's completion j
        out = offline(llm, prompt, n=3, temperature=1.0, seed=7, max_tokens=6)
        assert [c.text for c in first.choices[3 * i:3 * i + 3]] == [o["text"] for o in out["outputs"]]
    # a stop string (two characters from the middle of the greedy text, first found there): the text ends before it
    full = offline(llm, "The capital of France is", temperature=0.0, max_tokens=12)["text"]
    stop = next(full[i:i + 2] for i in range(2, len(full) - 1)
                if full[i:i + 2].strip() and full[i:i + 2] not in full[:i + 1])
    cut = api.completions.create(model=model, prompt="The capital of France is", temperature=0.0, max_tokens=12,
                                 stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert offline(llm, "The capital of France is", temperature=0.0, max_tokens=12, stop=[stop])["text"] \
        == cut.choices[0].text


def test_logprobs(server, llm):
    api = client(server)
    expected = offline(llm, "Hello", temperature=0.0, max_tokens=5, logprobs=2)
    response = api.completions.create(model=server_model(server), prompt="Hello", temperature=0.0, max_tokens=5,
                                      logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(expected["token_ids"])
    for token_id, entry, got, top in zip(expected["token_ids"], expected["logprobs"], logprobs.token_logprobs,
                                         logprobs.top_logprobs):
        assert got == pytest.approx(entry[token_id], abs=1e-5)
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(max(entry.values()), abs=1e-5)
    chat = api.chat.completions.create(model=server_model(server), messages=CHAT, temperature=0.0, max_tokens=4,
                                       logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob
               for t in content)


def test_logit_bias_and_allowed_token_ids(server, llm):
    """OpenAI's logit_bias (token ids as JSON keys, clamped to [-100, 100]) on completions and chat, and
    vLLM's allowed_token_ids, as the offline LLM takes them; the client sends them as the SDK does."""
    api = client(server)
    model = server_model(server)
    plain = offline(llm, "Hello", **GREEDY)["token_ids"]
    banned = {str(plain[0]): -100}                       # the greedy first token, banned in effect
    biased = api.completions.create(model=model, prompt="Hello", logit_bias=banned, **GREEDY)
    expected = offline(llm, "Hello", logit_bias={plain[0]: -100.0}, **GREEDY)
    assert biased.choices[0].text == expected["text"] and expected["token_ids"][0] != plain[0]
    forced = api.chat.completions.create(model=model, messages=CHAT, logit_bias={"42": 500}, max_tokens=4,
                                         temperature=1.0, seed=3)      # 500 clamped to 100: still all 42s
    assert forced.choices[0].message.content == llm.tokenizer.decode([42] * 4)
    allowed = [10, 20, 30, 40]
    out = api.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=1.0, seed=5,
                                 extra_body={"allowed_token_ids": allowed})
    assert out.choices[0].text == offline(llm, "Hello", max_tokens=6, temperature=1.0, seed=5,
                                          allowed_token_ids=allowed)["text"]


def test_truncate_prompt_tokens_and_an_unbounded_max_tokens(server, llm):
    """vLLM's truncate_prompt_tokens: a prompt longer than max_model_len (512) runs on its last k tokens
    (as the offline LLM's); with max_tokens absent it then runs up to max_model_len."""
    api = client(server)
    long_prompt = "word " * 600
    out = api.completions.create(model=server_model(server), prompt=long_prompt, temperature=0.0, max_tokens=4,
                                 extra_body={"truncate_prompt_tokens": 20})
    assert out.usage.prompt_tokens == 20
    expected = offline(llm, long_prompt, temperature=0.0, max_tokens=4, truncate_prompt_tokens=20)
    assert out.choices[0].text == expected["text"] and len(expected["prompt_token_ids"]) == 20
    unbounded = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": long_prompt, "temperature": 0.0, "ignore_eos": True, "truncate_prompt_tokens": 500})
    assert unbounded.status_code == 200, unbounded.text
    usage = unbounded.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (500, 12)
    assert unbounded.json()["choices"][0]["finish_reason"] == "length"


def test_streamed_n_without_max_tokens_ending_at_different_steps(server, llm):
    """The mix that once hung the server, now with max_tokens absent (the engine's None): n = 3 sampled
    completions streamed, a ninth of the vocabulary as stop tokens so that they end at different steps, the rest
    at max_model_len after a truncated prompt. Every choice ends, and the texts are the offline LLM's."""
    stops = list(range(0, 512, 9))
    params = dict(n=3, temperature=1.0, seed=11, stop_token_ids=stops, truncate_prompt_tokens=470)
    stream = client(server).completions.create(model=server_model(server), prompt="word " * 600, stream=True,
                                               extra_body={k: params[k] for k in ("stop_token_ids",
                                                                                  "truncate_prompt_tokens")},
                                               n=3, temperature=1.0, seed=11, timeout=120)
    texts, finishes = ["", "", ""], [None, None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    expected = offline(llm, "word " * 600, max_tokens=None, **params)["outputs"]
    assert texts == [c["text"] for c in expected] and finishes == [c["finish_reason"] for c in expected]
    assert len({len(c["token_ids"]) for c in expected}) > 1 and "stop" in finishes    # they did end apart


@pytest.mark.skipif(not HAS_PROMPT_LOGPROBS, reason="SamplingParams has no prompt_logprobs yet")
def test_echo_prompt_logprobs_match_transformers(server, tiny_model):
    """lm-eval's loglikelihood request: echo + logprobs + max_tokens=0 on token ids."""
    import torch
    prompt = oracle.random_prompts(1, 512, (12, 12), seed=3)[0]
    response = client(server).completions.create(model=server_model(server), prompt=prompt, echo=True, logprobs=1,
                                                 max_tokens=0, temperature=0.0)
    logprobs = response.choices[0].logprobs
    assert response.usage.completion_tokens == 0 and len(logprobs.tokens) == len(prompt)
    assert logprobs.token_logprobs[0] is None
    model = oracle.load_hf_model(str(tiny_model))
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for i in range(1, len(prompt)):
        assert logprobs.token_logprobs[i] == pytest.approx(reference[i - 1, prompt[i]].item(), abs=1e-4)
        best = max(logprobs.top_logprobs[i].values())
        assert best == pytest.approx(reference[i - 1].max().item(), abs=1e-4)


def test_concurrent_streams(server, llm):
    """32 streaming clients at once (raw HTTP: the openai client's own overhead would dominate), of
    different lengths: each gets its offline answer."""
    prompts = oracle.random_prompts(32, 256, (3, 12), seed=1)
    lengths = [2 + i % 7 for i in range(32)]
    expected = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths],
                            use_tqdm=False)

    async def one(http: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> str:
        body = {"prompt": prompt, "temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        texts = []
        async with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    texts.extend(choice["text"] for choice in json.loads(line[6:])["choices"])
        return "".join(texts)

    async def all_of_them() -> list[str]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=32)) as http:
            return await asyncio.gather(*(one(http, p, n) for p, n in zip(prompts, lengths)))

    assert asyncio.run(all_of_them()) == [out["text"] for out in expected]


def stream_then_leave(server, body: dict, chunks: int, before: float) -> float:
    """Read `chunks` events of a stream, then drop the connection; returns the KV blocks used meanwhile
    (more than `before` once the engine's figures, sent at most every 0.1 s, show the request: waited for
    up to 2 s, the stream still open)."""
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines, seen = response.iter_lines(), 0
        while seen < chunks:        # next(), not a for loop's break: that would close the stream at once
            seen += next(lines).startswith("data: ")
        deadline = time.monotonic() + 2.0
        while (used := metrics(server)["nanovllm:kv_cache_used_blocks"]) <= before and time.monotonic() < deadline:
            time.sleep(0.05)
        return used


def settle(server, timeout: float = 30.0) -> dict:
    """/metrics once nothing runs or waits (bounded): the engine reports its figures after each step and
    after each abort, so what a client's departure freed shows without another request."""
    deadline = time.monotonic() + timeout
    while True:
        samples = metrics(server)
        if samples["nanovllm:num_requests_running"] == 0 and samples["nanovllm:num_requests_waiting"] == 0:
            return samples
        assert time.monotonic() < deadline, f"still busy after {timeout} s: {samples}"
        time.sleep(0.1)


def test_client_disconnect_frees_blocks(slow_server):
    """A client that leaves mid-stream (or before a non-streamed answer) aborts its request: its blocks
    return to the pool and it generates no further."""
    server = slow_server
    before = settle(server)
    long = {"prompt": "Tell me everything", "max_tokens": 480, "ignore_eos": True, "temperature": 0.0}
    used = stream_then_leave(server, {**long, "stream": True}, chunks=3,
                             before=before["nanovllm:kv_cache_used_blocks"])
    assert used > before["nanovllm:kv_cache_used_blocks"]
    after = settle(server)
    assert after["nanovllm:kv_cache_used_blocks"] == before["nanovllm:kv_cache_used_blocks"]
    assert after["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] < 240
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        body = json.dumps(long).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while metrics(server)["nanovllm:generation_tokens_total"] == after["nanovllm:generation_tokens_total"]:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    final = settle(server)
    assert final["nanovllm:kv_cache_used_blocks"] == before["nanovllm:kv_cache_used_blocks"]
    assert final["nanovllm:generation_tokens_total"] - after["nanovllm:generation_tokens_total"] < 240


BAD = [
    ("{oops", 400),
    ({"prompt": "x"}, 400),                                           # chat without messages (below: completions)
    ({"prompt": "a", "temperature": -0.5}, 400),
    ({"prompt": "a", "model": "no-such-model"}, 404),
    ({"prompt": "word " * 600}, 400),                                 # longer than max_model_len
    ({"prompt": [1, 2, 10 ** 6]}, 400),                               # outside the vocabulary
    ({"prompt": "a", "logit_bias": {"1000000": 5}}, 400),             # a bias outside the vocabulary
    ({"prompt": "a", "logit_bias": {"the": 5}}, 400),                 # a key that is no token id
    ({"prompt": "a", "allowed_token_ids": []}, 400),
    ({"prompt": "a", "truncate_prompt_tokens": 0}, 400),
    ({"prompt": "word " * 600, "stream": True}, 400),                 # refused before the stream starts
]


@pytest.mark.parametrize("body, status", BAD)
def test_bad_requests_keep_serving(server, body, status):
    path = "/v1/chat/completions" if body == {"prompt": "x"} else "/v1/completions"
    if isinstance(body, str):
        response = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    good = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=30)
    assert good.status_code == 200 and len(good.json()["choices"]) == 1


def test_models_tokenize_metrics(server, llm):
    [card] = client(server).models.list().data
    assert card.id == server_model(server)
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello"}).json()
    assert tokens["tokens"] == llm.tokenizer.encode("Hello") and tokens["max_model_len"] == 512
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello"}
    samples = metrics(server)
    assert samples["nanovllm:kv_cache_total_blocks"] == 512
    assert samples["nanovllm:request_success_total"] >= 1
    assert samples["nanovllm:time_to_first_token_seconds_count"] >= 1
    assert math.isfinite(samples["nanovllm:e2e_request_latency_seconds_sum"])
