"""Soak `nanovllm serve` as its users load it, and check that nothing is lost or wrong.

    python benchmarks/soak_server.py                                  # the default model, 64 clients, 2,000 requests
    python benchmarks/soak_server.py --clients 128 --duration 600     # ten minutes of it
    python benchmarks/soak_server.py --model CKPT --engine-args="--num-kvcache-blocks 256 --kvcache-block-size 16"
    python benchmarks/soak_server.py --url http://127.0.0.1:8000      # a running server (left running)

Dozens of concurrent clients (asyncio + httpx) send a seeded mix of requests: greedy completions and chats,
plain and streamed (some with stop token ids or a stop string, so they end at different steps); sampled
ones with n > 1, a seed, temperature > 0 and stop_token_ids covering ~10% of the vocabulary (n completions
ending at different steps); streams whose client hangs up after a few chunks; and bad requests.

Checked: every greedy answer equals the one the idle server gave the same request before the load (text
and finish_reason; a stream's deltas add up to it and end with [DONE]); every n > 1 response has n choices,
each with a finish_reason; every bad request gets its 4xx in OpenAI's error shape; no 5xx, no request that
hangs (each has --request-timeout seconds); afterwards /metrics settles to 0 running, 0 waiting and 0 KV
blocks in use. A server this script started is then stopped with SIGTERM and must exit with code 0.
Give the server a KV cache small enough to preempt (the default engine args here do) to soak preemption.

Greedy answers under load equal the idle ones only where the engine's numerics do not depend on the batch
(float32 on CPU, as tests/entrypoints/test_soak.py runs it); on a GPU in bf16 a different batch can flip a
near-tie, so there they are reported as drift, not failures, unless --strict-greedy.

tests/entrypoints/test_soak.py runs this soak with small numbers on the tiny random checkpoint.
"""
import argparse
import asyncio
import itertools
import json
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WORDS = ("the river ran past an old mill where seven cats slept in the sun while a baker counted loaves "
         "and the wind carried songs over hills of green barley toward a quiet harbour town").split()
CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"
# (share of the requests, kind)
MIX = [(0.40, "greedy"), (0.30, "sampled"), (0.15, "hangup"), (0.15, "bad")]


@dataclass
class Spec:
    """One request of the soak."""
    kind: str                   # greedy, sampled, hangup, bad
    path: str
    body: dict | str            # a str: a raw body (malformed JSON)
    stream: bool = False
    expect_status: int = 200
    reference: str | None = None    # greedy: the key of the idle server's answer
    hangup_after: int = 0           # hangup: events read before leaving


@dataclass
class Report:
    sent: Counter = field(default_factory=Counter)          # kind (and stream) -> requests
    statuses: Counter = field(default_factory=Counter)      # HTTP status -> requests
    problems: list[str] = field(default_factory=list)       # anything lost, wrong, 5xx or hanging
    greedy_drift: list[str] = field(default_factory=list)   # greedy answers unlike the idle server's
    latencies: list[float] = field(default_factory=list)     # seconds, of every answered request
    elapsed: float = 0.0
    metrics_before: dict = field(default_factory=dict)
    metrics_after: dict = field(default_factory=dict)

    def summary(self) -> str:
        preempted = self.metrics_after.get("num_preemptions_total", 0) - self.metrics_before.get(
            "num_preemptions_total", 0)
        lines = [f"{sum(self.sent.values())} requests in {self.elapsed:.1f} s "
                 f"({sum(self.sent.values()) / max(self.elapsed, 1e-9):.1f}/s), {preempted:.0f} preemptions",
                 "sent: " + ", ".join(f"{kind} {count}" for kind, count in sorted(self.sent.items())),
                 "statuses: " + ", ".join(f"{status} x{count}" for status, count in sorted(self.statuses.items())),
                 "latency: " + (", ".join(f"{name} {value:.2f} s" for name, value in self.latency().items()) or "-"),
                 "after: " + ", ".join(f"{name} {self.metrics_after.get(name)}" for name in
                                       ("num_requests_running", "num_requests_waiting", "kv_cache_used_blocks")),
                 f"greedy drift: {len(self.greedy_drift)}", f"problems: {len(self.problems)}"]
        lines += [f"  drift: {d}" for d in self.greedy_drift[:10]] + [f"  problem: {p}" for p in self.problems[:30]]
        return "\n".join(lines)


    def latency(self) -> dict[str, float]:
        ordered = sorted(self.latencies)
        if not ordered:
            return {}
        return {"p50": ordered[len(ordered) // 2], "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
                "max": ordered[-1]}


# ---- the workload ----------------------------------------------------------------------------------------------
def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))


def _stop_ids(rng: random.Random, vocab_size: int) -> list[int]:
    return sorted(rng.sample(range(vocab_size), max(1, vocab_size // 10)))


def _key(path: str, body: dict) -> str:
    return json.dumps([path, {k: v for k, v in body.items() if k not in ("stream", "stream_options")}],
                      sort_keys=True)


def greedy_pool(rng: random.Random, size: int, vocab_size: int, max_tokens: int) -> list[tuple[str, dict]]:
    """Distinct greedy requests (path, body), half of them chats, some ending early on stop token ids."""
    pool = []
    for i in range(size):
        body = {"temperature": 0.0, "max_tokens": rng.randint(max(2, max_tokens // 6), max_tokens)}
        if i % 3 == 1:
            body["stop_token_ids"] = _stop_ids(rng, vocab_size)
        if i % 2:
            pool.append((CHAT_PATH, {"messages": [{"role": "user", "content": _prompt(rng)}], **body}))
        else:
            pool.append((COMPLETION_PATH, {"prompt": _prompt(rng), **body}))
    return pool


def bad_requests(vocab_size: int, max_model_len: int) -> list[tuple[str, dict | str, int]]:
    """(path, body, the status it must get)."""
    return [
        (COMPLETION_PATH, "{not json", 400),
        (COMPLETION_PATH, {"prompt": "a", "temperature": -1}, 400),
        (COMPLETION_PATH, {"prompt": "a", "n": 0}, 400),
        (COMPLETION_PATH, {"prompt": [vocab_size + 5]}, 400),
        (COMPLETION_PATH, {"prompt": list(range(1, 11)) * (max_model_len // 10 + 1)}, 400),    # too long
        (COMPLETION_PATH, {"prompt": "a", "model": "no-such-model"}, 404),
        (COMPLETION_PATH, {"prompt": "a", "stop_token_ids": [vocab_size + 1], "stream": True}, 400),
        (CHAT_PATH, {"messages": []}, 400),
        (CHAT_PATH, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400),
    ]


def workload(seed: int, vocab_size: int, max_model_len: int, pool: list[tuple[str, dict]],
             max_tokens: int, max_n: int):
    """An endless seeded stream of Specs in MIX's proportions."""
    rng = random.Random(f"soak/{seed}")
    bad = bad_requests(vocab_size, max_model_len)
    kinds, weights = zip(*[(kind, share) for share, kind in MIX])
    while True:
        kind = rng.choices(kinds, weights)[0]
        stream = rng.random() < 0.5
        if kind == "greedy":
            path, body = rng.choice(pool)
            body = dict(body, stream=stream)
            if stream and rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
            yield Spec(kind, path, body, stream, reference=_key(path, body))
        elif kind == "sampled":
            body = {"n": rng.randint(2, max_n), "seed": rng.randrange(1 << 30), "temperature": rng.uniform(0.7, 1.3),
                    "max_tokens": rng.randint(max(2, max_tokens // 4), max_tokens),
                    "stop_token_ids": _stop_ids(rng, vocab_size), "stream": stream}
            if rng.random() < 0.5:
                yield Spec(kind, CHAT_PATH, {"messages": [{"role": "user", "content": _prompt(rng)}], **body}, stream)
            else:
                yield Spec(kind, COMPLETION_PATH, {"prompt": _prompt(rng), **body}, stream)
        elif kind == "hangup":
            body = {"prompt": _prompt(rng), "max_tokens": min(4 * max_tokens, max_model_len // 2), "ignore_eos": True,
                    "stream": True, "n": rng.choice([1, 1, 2])}
            yield Spec(kind, COMPLETION_PATH, body, True, hangup_after=rng.randint(1, 4))
        else:
            path, body, status = rng.choice(bad)
            stream = isinstance(body, dict) and body.get("stream", False)
            yield Spec(kind, path, body, stream, expect_status=status)


# ---- one request --------------------------------------------------------------------------------------------
async def _events(response: httpx.Response, leave_after: int = 0) -> list:
    """The stream's events, parsed ("[DONE]" as is); leave_after > 0: stop reading after that many."""
    events = []
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
        if leave_after and len(events) >= leave_after:
            break
    return events


def _choices_of_stream(events: list, chat: bool) -> tuple[dict[int, str], dict[int, str], list[str]]:
    """A stream's text and finish_reason per choice index, and what is wrong with its shape."""
    wrong = []
    if not events or events[-1] != "[DONE]":
        wrong.append(f"the stream does not end with [DONE] (last: {str(events[-1:])[:200]})")
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for event in events[:-1]:
        if not isinstance(event, dict) or "error" in event:
            wrong.append(f"an error event: {str(event)[:300]}")
            continue
        for choice in event.get("choices", []):
            index = choice["index"]
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            texts[index] = texts.get(index, "") + (piece or "")
            if choice.get("finish_reason"):
                if index in finish:
                    wrong.append(f"choice {index} finished twice")
                finish[index] = choice["finish_reason"]
    return texts, finish, wrong


def _choices_of_body(body: dict, chat: bool) -> tuple[dict[int, str], dict[int, str]]:
    texts = {c["index"]: (c["message"]["content"] if chat else c["text"]) for c in body["choices"]}
    return texts, {c["index"]: c["finish_reason"] for c in body["choices"]}


def _is_openai_error(data) -> bool:
    error = data.get("error") if isinstance(data, dict) else None
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error) and bool(error["message"])


async def send(client: httpx.AsyncClient, spec: Spec) -> tuple[int | None, dict[int, str], dict[int, str], list[str]]:
    """Send one request; (HTTP status, text per choice, finish_reason per choice, what is wrong)."""
    kwargs = {"content": spec.body, "headers": {"content-type": "application/json"}} if isinstance(spec.body, str) \
        else {"json": spec.body}
    chat = spec.path == CHAT_PATH
    if not spec.stream:
        response = await client.post(spec.path, **kwargs)
        if response.status_code != 200:
            shaped = _is_openai_error(response.json()) if response.headers.get(
                "content-type", "").startswith("application/json") else False
            return response.status_code, {}, {}, [] if shaped else [f"not OpenAI's error shape: {response.text[:300]}"]
        texts, finish = _choices_of_body(response.json(), chat)
        return 200, texts, finish, []
    async with client.stream("POST", spec.path, **kwargs) as response:
        if response.status_code != 200:
            body = json.loads(await response.aread())
            return response.status_code, {}, {}, [] if _is_openai_error(body) else [f"not OpenAI's error shape: {body}"]
        events = await _events(response, spec.hangup_after)
    if spec.hangup_after:       # left on purpose, the connection dropped mid-stream
        return 200, {}, {}, []
    texts, finish, wrong = _choices_of_stream(events, chat)
    usage = spec.body.get("stream_options", {}).get("include_usage")
    if usage and not (len(events) >= 2 and isinstance(events[-2], dict) and events[-2].get("usage")):
        wrong.append("include_usage, but no usage chunk before [DONE]")
    return 200, texts, finish, wrong


def check(spec: Spec, status: int | None, texts: dict, finish: dict, wrong: list[str],
          references: dict[str, tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(problems, greedy drift) of one answered request."""
    what = f"{spec.kind}{' stream' if spec.stream else ''} {spec.path} {str(spec.body)[:160]}"
    problems = [f"{what}: {w}" for w in wrong]
    if status != spec.expect_status:
        return problems + [f"{what}: HTTP {status}, expected {spec.expect_status}"], []
    if spec.kind in ("bad", "hangup"):
        return problems, []
    n = spec.body.get("n", 1)
    if sorted(texts) != list(range(n)) or sorted(finish) != list(range(n)):
        problems.append(f"{what}: choices {sorted(texts)} with finish_reasons {finish}, expected {n} of each")
    elif any(reason not in ("stop", "length") for reason in finish.values()):
        problems.append(f"{what}: finish_reasons {finish}")
    if spec.kind == "greedy" and not problems:
        text, reason = references[spec.reference]
        if (texts[0], finish[0]) != (text, reason):
            return problems, [f"{what}: got {(texts[0], finish[0])!r}, idle {(text, reason)!r}"]
    return problems, []


# ---- the soak ---------------------------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """The unlabelled value of each nanovllm: sample ({name: value}, histograms left out)."""
    values = {}
    for line in text.splitlines():
        if line.startswith("nanovllm:") and "_bucket" not in line:
            name, value = line.rsplit(" ", 1)
            values[name.removeprefix("nanovllm:").split("{")[0]] = float(value)
    return values


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    return parse_metrics((await client.get("/metrics")).text)


async def settled_metrics(client: httpx.AsyncClient, timeout: float = 10.0) -> dict[str, float]:
    """/metrics once nothing runs, waits or holds a KV block (or as it is when `timeout` runs out)."""
    deadline = time.monotonic() + timeout
    while True:
        values = await metrics(client)
        idle = all(values.get(name) == 0 for name in ("num_requests_running", "num_requests_waiting",
                                                       "kv_cache_used_blocks"))
        if idle or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.1)


async def vocab_size_of(client: httpx.AsyncClient) -> int:
    """The tokenizer's vocabulary size, by bisection on /detokenize (which refuses ids outside it)."""
    low, high = 1, 1 << 22      # low is inside, high outside
    while high - low > 1:
        middle = (low + high) // 2
        inside = (await client.post("/detokenize", json={"tokens": [middle]})).status_code == 200
        low, high = (middle, high) if inside else (low, middle)
    return high


async def soak(url: str, clients: int = 32, requests: int | None = 240, duration: float | None = None,
               seed: int = 0, max_tokens: int = 48, max_n: int = 4, pool_size: int = 16,
               request_timeout: float = 60.0, vocab_size: int | None = None, log=print) -> Report:
    """Soak the server at `url`: the idle answers to the greedy pool first, then `requests` requests (or
    as many as `duration` seconds take) from `clients` concurrent clients, then /metrics settled."""
    report = Report()
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=request_timeout, limits=limits) as client:
        [card] = (await client.get("/v1/models")).json()["data"]
        max_model_len = card["max_model_len"]
        vocab_size = vocab_size or await vocab_size_of(client)
        rng = random.Random(f"pool/{seed}")
        pool = greedy_pool(rng, pool_size, vocab_size, max_tokens)

        # the idle server's greedy answers, one at a time; then a variant of some with a stop string from
        # the middle of their answer (a stop string that is sure to end them early)
        references: dict[str, tuple[str, str]] = {}
        for round_ in range(2):
            for path, body in list(pool):
                key = _key(path, body)
                if key in references or (round_ == 0 and "stop" in body):
                    continue
                status, texts, finish, wrong = await send(client, Spec("greedy", path, body))
                if status != 200 or wrong:
                    raise RuntimeError(f"the idle server failed {path} {body}: HTTP {status} {wrong}")
                references[key] = (texts[0], finish[0])
                if round_ == 0 and len(pool) < 2 * pool_size and rng.random() < 0.5:
                    text = texts[0]
                    if len(text) >= 8 and "\ufffd" not in text[len(text) // 2:len(text) // 2 + 2]:
                        pool.append((path, {**body, "stop": [text[len(text) // 2:len(text) // 2 + 2]]}))
        log(f"{len(references)} greedy references from the idle server; vocabulary {vocab_size}, "
            f"max_model_len {max_model_len}")

        report.metrics_before = await metrics(client)
        specs = workload(seed, vocab_size, max_model_len, pool, max_tokens, max_n)
        counter = itertools.count()
        begin = time.monotonic()
        deadline = begin + duration if duration else None

        async def one_client() -> None:
            while True:
                if deadline is not None and time.monotonic() > deadline:
                    return
                if requests is not None and next(counter) >= requests:
                    return
                spec = next(specs)
                report.sent[f"{spec.kind}{' stream' if spec.stream else ''}"] += 1
                sent = time.monotonic()
                try:
                    status, texts, finish, wrong = await asyncio.wait_for(send(client, spec), request_timeout)
                    report.latencies.append(time.monotonic() - sent)
                except asyncio.TimeoutError:
                    report.problems.append(f"{spec.kind} {spec.path} {str(spec.body)[:160]}: no answer within "
                                           f"{request_timeout:.0f} s")
                    continue
                except (httpx.HTTPError, ValueError) as error:
                    report.problems.append(f"{spec.kind} {spec.path} {str(spec.body)[:160]}: {error!r}")
                    continue
                report.statuses[status] += 1
                problems, drift = check(spec, status, texts, finish, wrong, references)
                report.problems += problems
                report.greedy_drift += drift

        await asyncio.gather(*(one_client() for _ in range(clients)))
        report.elapsed = time.monotonic() - begin
        report.metrics_after = await settled_metrics(client)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_used_blocks"):
        if report.metrics_after.get(name) != 0:
            report.problems.append(f"/metrics after the soak: {name} = {report.metrics_after.get(name)}")
    if any(status >= 500 for status in report.statuses):
        report.problems.append(f"5xx answers: {dict(report.statuses)}")
    return report


# ---- the script -------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start one on --model)")
    parser.add_argument("--model", help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--engine-args", default="--kvcache-block-size 16 --num-kvcache-blocks 256",
                        help="the started server's engine options (default: %(default)s, small enough to preempt)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, help="requests in all (default: 2,000, or with --duration as "
                        "many as it takes)")
    parser.add_argument("--duration", type=float, help="seconds to keep sending (default: until --requests)")
    parser.add_argument("--max-tokens", type=int, default=128, help="the largest max_tokens of a greedy or n > 1 request")
    parser.add_argument("--max-n", type=int, default=4)
    parser.add_argument("--pool", type=int, default=32, help="distinct greedy requests (their idle answers first)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request counts as hung")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strict-greedy", action="store_true", help="greedy drift fails the soak")
    args = parser.parse_args()
    requests = args.requests if args.requests is not None or args.duration is not None else 2000

    process = None
    url = args.url
    if url is None:
        model = args.model
        if model is None:
            from nanovllm.utils.gguf_checkpoint import default_model
            model = str(default_model())
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        process = subprocess.Popen([sys.executable, "-m", "nanovllm.entrypoints.cli", "serve", model, "--port",
                                    str(port), "--log-level", "warning", *shlex.split(args.engine_args)])
        deadline = time.monotonic() + 1800
        while True:
            if process.poll() is not None:
                sys.exit(f"the server exited with code {process.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                process.kill()
                sys.exit("the server did not start")
            time.sleep(0.5)
    failed = False
    try:
        report = asyncio.run(soak(url, args.clients, requests, args.duration, args.seed, args.max_tokens, args.max_n,
                                  args.pool, args.request_timeout))
        print(report.summary())
        failed = bool(report.problems) or (args.strict_greedy and bool(report.greedy_drift))
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                code = "none (killed after 60 s)"
            print(f"SIGTERM: the server exited with code {code}")
            failed = failed or code != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
