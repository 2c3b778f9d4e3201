"""The `nanovllm` command: its help, `serve` with an API key (the chat talks to it over HTTP), `chat` in
process, and SIGTERM with requests in flight (the last test here: it stops the module's server)."""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.cpu_only]     # the server and the chat run SERVER_ENGINE_ARGS (--device cpu)

KEY = "sesame"      # conftest's keyed_server
TURNS = ["Hello there", "And then?"]
SAMPLING = ["--temperature", "0", "--max-tokens", "6"]
ENV = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},     # as users run it
       "PYTHONIOENCODING": "utf-8", "PYTHONUNBUFFERED": "1"}


def nanovllm(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanovllm.entrypoints.cli", *args], input=stdin, text=True,
                          capture_output=True, timeout=timeout, env=ENV, encoding="utf-8", errors="replace")


def server_chat(server, messages: list[dict]) -> str:
    response = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"messages": messages, "temperature": 0.0, "max_tokens": 6}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def replies(keyed_server) -> list[str]:
    """The server's greedy answers to the two turns, the second with the first exchange before it."""
    first = server_chat(keyed_server, [{"role": "user", "content": TURNS[0]}])
    second = server_chat(keyed_server, [{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": first},
                                        {"role": "user", "content": TURNS[1]}])
    # the history must matter, or the chat test could not tell a kept conversation from a lost one
    assert second != server_chat(keyed_server, [{"role": "user", "content": TURNS[1]}])
    return [first, second]


def test_help_lists_commands():
    """The console script where the package was installed with it, else the module behind it."""
    command = ["nanovllm"] if shutil.which("nanovllm") else [sys.executable, "-m", "nanovllm.entrypoints.cli"]
    result = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60, env=ENV)
    assert result.returncode == 0
    for name in ("serve", "chat", "batch"):
        assert name in result.stdout


def test_api_key(keyed_server):
    assert httpx.get(f"{keyed_server.url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="wrong", max_retries=0).models.list()
    api = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY, max_retries=0)
    assert api.completions.create(model=api.models.list().data[0].id, prompt="Hi", max_tokens=2).choices
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200      # open, as in vLLM


def test_chat_over_http(keyed_server, replies):
    """Two turns through stdin: each reply streamed out, the second answered with the first in context."""
    result = nanovllm("chat", "--url", keyed_server.url, "--api-key", KEY, *SAMPLING, stdin="\n".join(TURNS) + "\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"> {replies[0]}\n> {replies[1]}\n> \n"


def test_chat_in_process(tiny_model, keyed_server, replies):
    script = f"{TURNS[0]}\n/reset\n{TURNS[0]}\n{TURNS[1]}\n/exit\n"
    result = nanovllm("chat", str(tiny_model), *keyed_server.ENGINE_ARGS, *SAMPLING, stdin=script)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"> {replies[0]}\n> (the conversation starts over)\n> {replies[0]}\n> {replies[1]}\n> "


def test_sigterm_with_requests_in_flight(keyed_server):
    """SIGTERM to the server's whole process group (systemd's default, timeout(1)): the streams in flight end
    (finish_reason "abort", then [DONE]), the server exits 0 within 10 s without reporting its engine dead,
    and no process of it is left."""
    server = keyed_server
    descendants = server.descendants()
    assert descendants, "the engine process should be the server's child"
    started = [threading.Event() for _ in range(3)]
    events: list[list[str]] = [[] for _ in range(3)]

    def stream(i: int) -> None:
        body = {"prompt": f"Story {i}:", "max_tokens": 480, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30,
                              headers={"Authorization": f"Bearer {KEY}"}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events[i].append(line.removeprefix("data: "))
                        started[i].set()
        except httpx.HTTPError as error:
            events[i].append(f"error: {error!r}")
        finally:
            started[i].set()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    assert all(event.wait(60) for event in started)
    begin = time.monotonic()
    for pid in (server.process.pid, *descendants):      # as a group kill reaches them: all at once
        os.kill(pid, signal.SIGTERM)
    try:
        returncode = server.process.wait(10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit within 10 s of SIGTERM:\n{server.output()[-3000:]}")
    assert time.monotonic() - begin < 10 and returncode == 0, server.output()[-3000:]
    assert "engine process died" not in server.output(), server.output()[-3000:]
    for thread in threads:
        thread.join(10)
    for lines in events:
        assert lines[-1] == "[DONE]" and '"finish_reason":"abort"' in lines[-2], lines[-3:]
    deadline = time.monotonic() + 5
    while any(server.alive(pid) for pid in descendants) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in descendants if server.alive(pid)], "processes of the server are left"
