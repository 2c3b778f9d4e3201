"""The OpenAI app over a fake engine (conftest.FakeEngine), in process: response shapes, choice numbering,
streaming format, log-prob formats, defaults, and every bad request's 4xx in OpenAI's error shape."""
import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from nanovllm.entrypoints.openai_app import build_app  # noqa: E402
from nanovllm.sampling_params import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.cpu_only, pytest.mark.timeout(60)]     # a fake engine

HAS_PROMPT_LOGPROBS = "prompt_logprobs" in SamplingParams.__dataclass_fields__
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client(fake_engine):
    with TestClient(build_app(fake_engine, "fake")) as client:
        yield client


def events(response) -> list:
    """The data of each server-sent event; the last must be [DONE]."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    data = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def assert_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def test_models_health_metrics(client):
    [card] = client.get("/v1/models").json()["data"]
    assert card["id"] == "fake" and card["object"] == "model" and card["max_model_len"] == 64
    assert client.get("/health").status_code == 200
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in metrics.text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['nanovllm:num_requests_running{model_name="fake"}'] == 1
    assert samples['nanovllm:kv_cache_used_blocks{model_name="fake"}'] == 3
    assert samples['nanovllm:kv_cache_usage_perc{model_name="fake"}'] == 0.25
    assert samples['nanovllm:prompt_tokens_total{model_name="fake"}'] == 100
    assert samples['nanovllm:time_to_first_token_seconds_bucket{model_name="fake",le="0.1"}'] == 2
    assert samples['nanovllm:time_to_first_token_seconds_bucket{model_name="fake",le="+Inf"}'] == 4
    assert samples['nanovllm:e2e_request_latency_seconds_sum{model_name="fake"}'] == 1.5
    assert "# TYPE nanovllm:generation_tokens_total counter" in metrics.text


def test_speculation_counters_are_metrics_where_the_engine_speculates():
    """An engine with a speculative_config reports its draft counters (llm.stats' names): /metrics gives
    them as counters under vLLM's names; an engine without one has none."""
    from nanovllm.entrypoints.metrics import render_metrics
    text = render_metrics({"spec_decode_num_drafts": 3, "spec_decode_draft_tokens": 10,
                           "spec_decode_accepted_tokens": 7}, "m")
    assert 'nanovllm:spec_decode_num_drafts_total{model_name="m"} 3' in text
    assert 'nanovllm:spec_decode_num_draft_tokens_total{model_name="m"} 10' in text
    assert 'nanovllm:spec_decode_num_accepted_tokens_total{model_name="m"} 7' in text
    assert "# TYPE nanovllm:spec_decode_num_accepted_tokens_total counter" in text
    assert "spec_decode" not in render_metrics({"num_running": 1}, "m")


def test_completion_choices_and_usage(client, fake_engine):
    """Two prompts (text and token ids) x n=2: choice i*n+j is prompt i's completion j."""
    body = client.post("/v1/completions", json={"prompt": [[72, 105], [65, 66, 67]], "n": 2, "max_tokens": 3}).json()
    assert body["object"] == "text_completion" and body["model"] == "fake"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["0: ", "1: ", "0: ", "1: "]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    body = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 20, "stop": ["quick"]}).json()
    [choice] = body["choices"]
    assert choice["text"] == "0: the " and choice["finish_reason"] == "stop" and choice["stop_reason"] == "quick"


def test_sampling_defaults_and_overrides(client, fake_engine):
    """Fields the request leaves out take the engine's defaults (generation_config), the rest its own."""
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    client.post("/v1/completions", json={"prompt": "b", "temperature": 0.0, "top_k": 5, "seed": 3, "max_tokens": 2,
                                         "ignore_eos": True, "stop_token_ids": [7], "min_tokens": 1})
    client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 9, "max_completion_tokens": 4})
    client.post("/v1/chat/completions", json={"messages": CHAT})
    first, second, chat, unbounded = fake_engine.requests.values()
    assert (first.temperature, first.top_p, first.max_tokens) == (0.7, 0.9, 2)
    assert (second.temperature, second.top_p, second.top_k, second.seed) == (0.0, 0.9, 5, 3)
    assert second.ignore_eos and second.stop_token_ids == [7] and second.min_tokens == 1
    assert chat.max_tokens == 4                                 # max_completion_tokens wins
    assert first.logit_bias is None and first.allowed_token_ids is None
    client.post("/v1/completions", json={"prompt": "c", "max_tokens": 2, "logit_bias": {"5": 1.5, "9": -250},
                                         "allowed_token_ids": [9, 5, 11]})
    client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "logit_bias": {"7": 300}})
    biased, biased_chat = list(fake_engine.requests.values())[4:]
    assert biased.logit_bias == {5: 1.5, 9: -100.0} and biased.allowed_token_ids == [5, 9, 11]   # clamped
    assert biased_chat.logit_bias == {7: 100.0}
    assert unbounded.max_tokens is None                         # up to max_model_len (SamplingParams' None)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": None}),
    ("/v1/completions", {"prompt": [72, 105], "max_tokens": None}),
    ("/v1/completions", {"prompt": ["Hi", "there"], "max_tokens": 3, "n": 2}),
    ("/v1/completions", {"prompt": [[72, 105], [72]], "max_tokens": None, "stream": True}),
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "stream": True}),
])
def test_each_prompt_checked_once(client, fake_engine, path, body):
    """A request is checked at the edge it came in by, once a prompt: max_tokens absent (None: the room the
    prompt leaves, the engine's to take) included, and generate() runs the checked ids without checking them
    again."""
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    prompts = body.get("prompt", [None])
    prompts = prompts if isinstance(prompts, list) and not isinstance(prompts[0], int) else [prompts]
    assert len(fake_engine.checks) == len(prompts) == len(fake_engine.requests)
    for params in fake_engine.requests.values():
        assert params.max_tokens == body.get("max_tokens")


def test_completion_stream(client, fake_engine):
    response = client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 4, "stream": True,
                                                    "stream_options": {"include_usage": True}})
    chunks = events(response)
    *chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 16
    texts, finish = {}, {}
    for chunk in chunks:
        assert chunk["object"] == "text_completion" and chunk["usage"] is None
        [choice] = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "0: t", 1: "1: t", 2: "0: t", 3: "1: t"}
    assert finish == {i: "length" for i in range(4)}
    assert all(state == "finished" for state in fake_engine.ended.values())


def test_completion_logprobs(client):
    body = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3, "logprobs": 2}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["0", ":", " "]
    assert logprobs["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert logprobs["top_logprobs"][0] == {"0": -0.5, "1": -1.5, "2": -2.5}
    assert logprobs["text_offset"] == [0, 1, 2]


@pytest.mark.skipif(not HAS_PROMPT_LOGPROBS, reason="SamplingParams has no prompt_logprobs yet")
@pytest.mark.parametrize("stream", [False, True])
def test_echo_prompt_logprobs(client, stream):
    """echo + logprobs + max_tokens=0: the prompt alone, with its tokens' log-probs (the first has none)."""
    response = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 1,
                                                    "stream": stream})
    choices = [c["choices"][0] for c in events(response)] if stream else response.json()["choices"]
    assert "".join(c["text"] for c in choices) == "abc"
    assert choices[-1]["finish_reason"] == "length"
    logprobs = choices[0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "c"] and logprobs["text_offset"] == [0, 1, 2]
    assert logprobs["token_logprobs"] == [None, -0.5, -0.5]
    assert logprobs["top_logprobs"] == [None, {"b": -0.5, "c": -1.5}, {"c": -0.5, "d": -1.5}]
    if not stream:
        assert response.json()["usage"]["completion_tokens"] == 0
    # echo with tokens generated: the prompt, then the completion, offsets running on
    body = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "echo": True, "logprobs": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == "ab0:" and choice["logprobs"]["tokens"] == ["a", "b", "0", ":"]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3]


def test_chat(client):
    body = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "n": 2, "logprobs": True,
                                                     "top_logprobs": 1}).json()
    assert body["object"] == "chat.completion"
    assert [(c["index"], c["message"]) for c in body["choices"]] == [
        (0, {"role": "assistant", "content": "0: "}), (1, {"role": "assistant", "content": "1: "})]
    token = body["choices"][0]["logprobs"]["content"][0]
    assert token == {"token": "0", "logprob": -0.5, "bytes": [48],
                     "top_logprobs": [{"token": "0", "logprob": -0.5, "bytes": [48]}]}
    prompt_tokens = len(client.post("/tokenize", json={"messages": CHAT}).json()["tokens"])
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 6, "total_tokens": prompt_tokens + 6}


def test_chat_stream(client):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]       # text parts are joined
    response = client.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
    *chunks, usage = events(response)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "0: "
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["usage"]["completion_tokens"] == 3


def test_tokenize_detokenize(client):
    body = client.post("/tokenize", json={"prompt": "hey", "return_token_strs": True}).json()
    assert body["count"] == 3 and body["max_model_len"] == 64 and len(body["token_strs"]) == 3
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "hey"}
    assert_error(client.post("/detokenize", json={"tokens": [10 ** 6]}), 400, "tokens")
    assert_error(client.post("/tokenize", json={"prompt": "a", "messages": CHAT}), 400)
    assert_error(client.post("/tokenize", json={"prompt": "a", "model": "other"}), 404, "model")


def test_continue_final_message_leaves_the_last_message_open(client):
    """vLLM's continue_final_message (chat and /tokenize): the prompt ends inside the final assistant
    message, a prefix of the closed conversation's; with add_generation_prompt (the default) a 400."""
    started = CHAT + [{"role": "assistant", "content": "Once upon"}]
    def tokens(**fields):
        response = client.post("/tokenize", json={"messages": started, **fields})
        assert response.status_code == 200, response.text
        return response.json()["tokens"]
    closed = tokens(add_generation_prompt=False)
    open_ = tokens(add_generation_prompt=False, continue_final_message=True)
    assert len(open_) < len(closed) and closed[:len(open_)] == open_
    assert client.post("/detokenize", json={"tokens": open_}).json()["prompt"].endswith("Once upon")
    for path, body in (("/tokenize", {"messages": started}),
                       ("/v1/chat/completions", {"messages": started, "max_tokens": 2})):
        assert_error(client.post(path, json={**body, "continue_final_message": True}), 400)
    answer = client.post("/v1/chat/completions", json={"messages": started, "max_tokens": 2,
                                                       "add_generation_prompt": False,
                                                       "continue_final_message": True})
    assert answer.status_code == 200, answer.text


BAD_COMPLETIONS = [
    ("{not json", 400, None),
    ("[1, 2]", 400, None),
    ("", 400, None),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": 3}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": "a", "temperature": -1}, 400, "temperature"),
    ({"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"prompt": "a", "n": 0}, 400, "n"),
    ({"prompt": "a", "n": 1.5}, 400, "n"),
    ({"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0}, 400, None),
    ({"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "a", "stop": 5}, 400, "stop"),
    ({"prompt": "a", "stop": [""]}, 400, None),               # SamplingParams refuses it
    ({"prompt": "a", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, None),
    ({"prompt": "a", "min_tokens": 5, "max_tokens": 2}, 400, None),
    ({"prompt": "a", "best_of": 3}, 400, None),
    ({"prompt": "a", "logit_bias": {"x1": 2}}, 400, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"1": "up"}}, 400, "logit_bias.1"),
    ({"prompt": "a", "allowed_token_ids": []}, 400, None),        # SamplingParams refuses it
    ({"prompt": "a", "allowed_token_ids": [1, "b"]}, 400, "allowed_token_ids.1"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x" * 100}, 400, None),                       # longer than max_model_len
    ({"prompt": [[1, 2], [999]]}, 400, None),                 # a token id outside the vocabulary
    ({"prompt": "refuse-later", "stream": True}, 400, None),   # generate() refuses: before the stream
]
BAD_CHATS = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content"),
    ({"messages": CHAT, "top_logprobs": 2}, 400, None),
    ({"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, 400, None),
    ({"messages": [{"role": "user", "content": "x" * 100}], "stream": True}, 400, None),
]


@pytest.mark.parametrize("path, body, status, param",
                         [("/v1/completions", *case) for case in BAD_COMPLETIONS]
                         + [("/v1/chat/completions", *case) for case in BAD_CHATS])
def test_bad_request(client, path, body, status, param):
    """A 4xx in OpenAI's shape, and the next good request is answered."""
    if isinstance(body, str):
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = client.post(path, json=body)
    assert_error(response, status, param)
    good = {"prompt": "ok", "max_tokens": 2} if path == "/v1/completions" else {"messages": CHAT, "max_tokens": 2}
    assert client.post(path, json=good).status_code == 200


def test_unknown_fields_ignored(client):
    body = {"prompt": "ok", "max_tokens": 2, "something_new": {"x": 1}, "user": "me", "best_of": 1}
    assert client.post("/v1/completions", json=body).status_code == 200


def test_routes_not_found(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_api_key(fake_engine):
    with TestClient(build_app(fake_engine, "fake", api_key="sesame")) as client:
        error = assert_error(client.get("/v1/models"), 401)
        assert error["code"] == "invalid_api_key"
        assert_error(client.post("/v1/completions", json={"prompt": "a"},
                                 headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(client.post("/v1/completions", content="{bad json",
                                 headers={"Authorization": "Bearer wrong"}), 401)
        ok = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2},
                         headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


@pytest.mark.parametrize("body", [
    "{bad json",                        # not JSON
    '{"prompt": 5}',                    # JSON, but not a valid request
    '{"prompt": "a", "max_tokens": 2}',
])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "sesame"])
def test_api_key_is_checked_before_the_body(fake_engine, body, authorization):
    """Without the right key, any /v1 request is a 401, whatever its body: a stranger learns nothing of
    how the API reads a request (a malformed one is a 400 only for a client with the key)."""
    headers = {"content-type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    with TestClient(build_app(fake_engine, "fake", api_key="sesame")) as client:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/no-such-path"):
            error = assert_error(client.post(path, content=body, headers=headers), 401)
            assert error["code"] == "invalid_api_key"
        assert fake_engine.checks == [] and fake_engine.requests == {}
        keyed = {**headers, "Authorization": "Bearer sesame"}
        assert_error(client.post("/v1/completions", content="{bad json", headers=keyed), 400)
        assert_error(client.post("/v1/completions", content='{"prompt": 5}', headers=keyed), 400, "prompt")
        assert client.post("/tokenize", content="{bad json", headers=headers).status_code == 400   # not /v1: open


SEED_RANGE = (-2 ** 63, 2 ** 63 - 1)     # torch's int64, as vLLM bounds it


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("seed", [2 ** 63, 2 ** 64, 2 ** 70, -2 ** 63 - 1, -2 ** 70])
def test_seed_outside_int64_is_refused(client, fake_engine, path, seed):
    """A seed no int64 holds is a 400 naming `seed`, not wrapped around into another seed."""
    base = {"prompt": "a"} if path == "/v1/completions" else {"messages": CHAT}
    assert_error(client.post(path, json={**base, "max_tokens": 2, "seed": seed}), 400, "seed")
    assert fake_engine.requests == {}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_seed_at_the_int64_bounds_is_taken(client, fake_engine, path):
    base = {"prompt": "a"} if path == "/v1/completions" else {"messages": CHAT}
    for seed in SEED_RANGE:
        assert client.post(path, json={**base, "max_tokens": 2, "seed": seed}).status_code == 200
    assert [params.seed for params in fake_engine.requests.values()] == list(SEED_RANGE)


def too_large(max_tokens: int, prompt_tokens: int, max_model_len: int = 64) -> str:
    """vLLM's message, word for word."""
    return (f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_tokens}).")


@pytest.mark.parametrize("stream", [False, True])
def test_completion_max_tokens_past_the_context_is_refused(client, fake_engine, stream):
    """prompt + max_tokens > max_model_len is a 400 before anything runs (vLLM's server), not a completion
    silently cut at max_model_len; every prompt of the request is checked. max_tokens null: the room left."""
    post = lambda **body: client.post("/v1/completions", json={"stream": stream, **body})   # noqa: E731
    prompt = list(range(1, 41))                         # 40 tokens of the 64
    error = assert_error(post(prompt=prompt, max_tokens=25), 400, "max_tokens")
    assert error["message"] == too_large(25, 40)
    error = assert_error(post(prompt=[[1, 2], prompt], max_tokens=25), 400, "max_tokens")    # the second prompt's
    assert error["message"] == too_large(25, 40)
    assert_error(post(prompt="x" * 60, max_tokens=10 ** 6), 400, "max_tokens")
    assert fake_engine.requests == {}
    assert post(prompt=prompt, max_tokens=24).status_code == 200           # exactly fills the context
    assert post(prompt=prompt, max_tokens=None).status_code == 200
    assert post(prompt=prompt, max_tokens=0, echo=True).status_code == 200    # the prompt alone: no room needed
    # max_tokens left out: OpenAI's default of 16, which the engine caps to the room left (12 here), as
    # before; only a max_tokens the client sent must fit (vLLM checks the default too)
    assert post(prompt=list(range(1, 53))).status_code == 200
    assert [params.max_tokens for params in fake_engine.requests.values()] == [24, None, 1, 16]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_max_tokens_past_the_context_is_refused(client, fake_engine, stream):
    """As for completions, naming the field the request used; neither given: up to max_model_len."""
    prompt_tokens = len(fake_engine.chat_prompt(CHAT))
    room = fake_engine.max_model_len - prompt_tokens
    def post(**body):
        return client.post("/v1/chat/completions", json={"messages": CHAT, "stream": stream, **body})
    error = assert_error(post(max_completion_tokens=room + 1), 400, "max_completion_tokens")
    assert error["message"] == too_large(room + 1, prompt_tokens)
    assert_error(post(max_tokens=room + 1), 400, "max_tokens")
    assert_error(post(max_tokens=2, max_completion_tokens=room + 1), 400, "max_completion_tokens")   # it wins
    assert fake_engine.requests == {}
    assert post(max_completion_tokens=room).status_code == 200
    assert post().status_code == 200
    assert [params.max_tokens for params in fake_engine.requests.values()] == [room, None]


def test_health_when_engine_stopped(client, fake_engine):
    fake_engine.shutdown()
    assert_error(client.get("/health"), 503)


def test_engine_dead(fake_engine):
    """Requests in flight when the engine dies get a 503 in OpenAI's shape, or, streamed, an error event and
    then [DONE]; so do later ones, and /health says 503."""
    import threading
    fake_engine.delay = 0.05        # 24 steps of 50 ms: a request is still running when the engine dies
    with TestClient(build_app(fake_engine, "fake")) as client:
        results = {}

        def post(name: str, body: dict) -> None:
            results[name] = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 24, **body})

        threads = [threading.Thread(target=post, args=(name, body)) for name, body in
                   [("plain", {}), ("stream", {"stream": True}), ("n", {"n": 3, "stream": True})]]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while len(fake_engine.requests) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)     # a few steps: the streams have begun
        # the engine's traceback (engine_core's Fatal) goes to the server's log, not to the clients
        fake_engine.die("the engine process exited (exit code -9)\n--- in the engine process ---\n"
                        "Traceback (most recent call last):\n  File \"engine.py\", line 1")
        for thread in threads:
            thread.join(10)
        error = assert_error(results["plain"], 503)
        assert error["code"] == "engine_dead" and error["type"] == "server_error" and "exit code -9" in error["message"]
        assert error["message"] == "the engine has stopped: the engine process exited (exit code -9)"
        for name in ("stream", "n"):
            *_, last = chunks = events(results[name])
            assert last["error"]["code"] == "engine_dead" and "exit code -9" in last["error"]["message"]
            assert "Traceback" not in last["error"]["message"]
            assert all("choices" in chunk for chunk in chunks[:-1])
        assert assert_error(client.post("/v1/completions", json={"prompt": "a"}), 503)["code"] == "engine_dead"
        assert_error(client.get("/health"), 503)
