"""The engine process dies under a serving `nanovllm serve` (SIGKILL, as the OOM killer would): the requests
in flight get errors at once (a 503 in OpenAI's shape; a stream, an error event and then [DONE]), the log
names the cause, and the server exits non-zero within seconds, leaving no process behind."""
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.cpu_only]     # the servers run SERVER_ENGINE_ARGS (--device cpu)

EXIT_WITHIN = 15.0      # seconds; the server means to take < 5 (slack for a slow CI machine)


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the process's children."""
    try:
        import psutil
        return [(child.pid, " ".join(child.cmdline())) for child in psutil.Process(pid).children()]
    except ImportError:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
            except OSError:
                continue
        return found


def engine_pid(server) -> int:
    """The engine process ("nanovllm-engine" to multiprocessing): the server's child that multiprocessing
    spawned (its other child, if any, is multiprocessing's resource tracker)."""
    [pid] = [pid for pid, cmdline in children(server.process.pid) if "spawn_main" in cmdline]
    return pid


def kill_engine(server) -> tuple[int, float]:
    """SIGKILL the server's engine process; the server's exit code and the seconds it took to exit (a test
    failure, with its output, past EXIT_WITHIN)."""
    begin = time.monotonic()
    os.kill(engine_pid(server), signal.SIGKILL)
    try:
        returncode = server.process.wait(EXIT_WITHIN)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit within {EXIT_WITHIN} s of its engine's death:\n{server.output()[-3000:]}")
    return returncode, time.monotonic() - begin


def running_requests(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("nanovllm:num_requests_running"))


def test_engine_killed_mid_requests(start_server):
    server = start_server(slow=True)    # a request of 480 tokens takes seconds: still running when killed
    long = {"max_tokens": 480, "ignore_eos": True}
    requests = {
        "plain": ("/v1/completions", {"prompt": "Once", **long}),
        "plain n=2": ("/v1/completions", {"prompt": "Upon", "n": 2, "seed": 1, "temperature": 1.0, **long}),
        "stream": ("/v1/completions", {"prompt": "A time", "stream": True, **long}),
        "chat stream": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True,
                                                 **long}),
    }
    results: dict[str, object] = {}
    streaming = {name: threading.Event() for name, (_, body) in requests.items() if body.get("stream")}

    def send(name: str, path: str, body: dict) -> None:
        try:
            if not body.get("stream"):
                results[name] = httpx.post(server.url + path, json=body, timeout=60)
                return
            with httpx.stream("POST", server.url + path, json=body, timeout=60) as response:
                events = []
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        streaming[name].set()
                results[name] = (response.status_code, events)
        except httpx.HTTPError as error:        # a timeout here is a hang
            results[name] = error
        finally:
            if name in streaming:
                streaming[name].set()

    threads = [threading.Thread(target=send, args=(name, *request), daemon=True) for name, request in requests.items()]
    for thread in threads:
        thread.start()
    assert all(event.wait(60) for event in streaming.values())
    deadline = time.monotonic() + 60
    while running_requests(server) < len(requests) and time.monotonic() < deadline:
        time.sleep(0.1)     # the engine's figures come at most every 0.1 s
    assert running_requests(server) == len(requests), "the requests should all be running"
    descendants = server.descendants()

    returncode, took = kill_engine(server)
    print(f"\nthe server exited {took:.2f} s after its engine was killed, with code {returncode}")
    log = server.output()
    assert returncode == 1, log[-3000:]
    # the cause, as AsyncLLM words it ("EngineDeadError: the engine process exited", with the exit code
    # when it is known by then)
    assert "ERROR nanovllm.serve: the engine process died (EngineDeadError: the engine process exited" in log, \
        log[-3000:]

    for thread in threads:
        thread.join(10)
    assert not [thread for thread in threads if thread.is_alive()], "a request hangs"
    for name, (_, body) in requests.items():
        result = results[name]
        assert not isinstance(result, Exception), f"{name}: {result!r}"
        if body.get("stream"):
            status, events = result
            assert status == 200 and events[-1] == "[DONE]", (name, events[-3:])
            error = httpx.Response(200, content=events[-2]).json()["error"]
        else:
            assert result.status_code == 503, (name, result.text)
            error = result.json()["error"]
        assert error["code"] == "engine_dead" and error["type"] == "server_error", (name, error)
        assert "the engine process exited" in error["message"], (name, error)

    deadline = time.monotonic() + 5
    while any(server.alive(pid) for pid in descendants) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in descendants if server.alive(pid)], "processes of the server are left"


def test_idle_engine_killed(start_server):
    """With no request ever sent (nothing awaits the engine yet), the death is noticed all the same."""
    server = start_server()
    returncode, took = kill_engine(server)
    print(f"\nthe idle server exited {took:.2f} s after its engine was killed, code {returncode}")
    assert returncode == 1 and "the engine process died" in server.output(), server.output()[-3000:]
