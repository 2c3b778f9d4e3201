"""No hangs: a tensor-parallel worker that dies, at start-up, between steps or in the middle of one, makes
the engine raise a clear error within seconds; exit() then leaves nothing behind (no process, no shared
memory) and a new engine works in the same process. A script that forgot the `__main__` guard, Ctrl-C
during generate, and a killed rank 0 end promptly too.

On CPU the workers talk gloo; with two GPUs the same tests run on NCCL with CUDA graphs."""
import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.multiprocessing as mp

from nanovllm import LLM, SamplingParams
from nanovllm.engine import llm_engine
from nanovllm.distributed.workers import Workers

pytestmark = pytest.mark.timeout(240)    # every test here guards against a hang: it must fail, not stall

RAISE_WITHIN = 10.0      # seconds from a worker's death to the engine's error
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SHAPE = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=64, intermediate_size=96)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]


# [cpu]: its engines and scripts are all device="cpu", so it may run beside the GPU tests (tests/conftest.py)
@pytest.fixture(scope="module", params=[pytest.param("cpu", marks=pytest.mark.cpu_only), pytest.param(
    "cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"))])
def device(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(make_checkpoint, device):
    return make_checkpoint(dtype=torch.bfloat16 if device == "cuda" else torch.float32, **SHAPE)


def engine_args(device):
    return dict(device=device, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128,
                num_kvcache_blocks=32)


@pytest.fixture(scope="module")
def expected(model_dir, device):
    """What a healthy TP=2 engine answers: every engine built after a failure must answer the same."""
    with LLM(str(model_dir), **engine_args(device)) as llm:
        return [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def shm_segments(pid=None):
    """The shared-memory segments that process `pid` (default: this one) created. A segment is named after
    the process that creates it, rank 0 (nanovllm/distributed/workers.py; the workers only attach to it), so
    these are all a test's engines can leave behind; others (another xdist worker's engines) are not ours."""
    return set(glob.glob(f"/dev/shm/nanovllm-{pid or os.getpid()}-*"))


def gone(pid):
    """The process has ended (a zombie waiting for its parent counts as ended)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" in f.read().lower()
    except FileNotFoundError:
        return True


def wait_until(condition, seconds):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def assert_clean_and_usable(model_dir, device, expected, shm_before, workers):
    """Nothing of the failed engine is left, and a new engine in this process answers as before."""
    assert all(not p.is_alive() for p in workers), "a worker process was left running"
    assert shm_segments() == shm_before, "a shared-memory segment was left behind"
    assert not [p for p in mp.active_children() if p.name.startswith("nanovllm-rank")]
    with LLM(str(model_dir), **engine_args(device)) as llm:
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def kill(process):
    os.kill(process.pid, signal.SIGKILL)
    return time.monotonic()


@pytest.mark.parametrize("when", ["before the group forms", "in a start-up collective"])
def test_worker_killed_at_startup(model_dir, device, expected, monkeypatch, when):
    shm_before, started = shm_segments(), {}
    join_group = Workers.join_group

    def join_group_after_killing(self):
        started["workers"], started["killed"] = list(self.processes), kill(self.processes[0])
        return join_group(self)

    def allocate_after_killing(runner):     # rank 0's runner only: the worker has its own process
        started["killed"] = kill(started["workers"][0])
        return allocate(runner)

    if when == "before the group forms":
        monkeypatch.setattr(Workers, "join_group", join_group_after_killing)
    else:
        monkeypatch.setattr(Workers, "join_group",
                            lambda self: started.update(workers=list(self.processes)) or join_group(self))
        allocate = llm_engine.ModelRunner.allocate_kv_cache
        monkeypatch.setattr(llm_engine.ModelRunner, "allocate_kv_cache", allocate_after_killing)
    with pytest.raises(RuntimeError, match=r"rank 1 died \(exit code -9, killed by SIGKILL\)"):
        LLM(str(model_dir), **engine_args(device))
    elapsed = time.monotonic() - started["killed"]
    print(f"\n[{device}] worker killed at start-up ({when}): LLM() raised after {elapsed:.2f} s")
    assert elapsed < RAISE_WITHIN
    monkeypatch.undo()
    assert_clean_and_usable(model_dir, device, expected, shm_before, started["workers"])


@pytest.mark.parametrize("when", ["between steps", "mid-step"])
def test_worker_killed_while_generating(model_dir, device, expected, when):
    shm_before = shm_segments()
    llm = LLM(str(model_dir), **engine_args(device))
    assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    workers, killed = list(llm.workers.processes), {}
    if when == "between steps":
        killed["at"] = kill(workers[0])
    else:   # rank 0's third step: the worker has the message and is running it; rank 0 then joins in
        run, calls = llm.model_runner.run, []

        def run_killing_the_worker(*args):
            calls.append(1)
            if len(calls) == 3:
                killed["at"] = kill(workers[0])
            return run(*args)
        llm.model_runner.run = run_killing_the_worker
    with pytest.raises(RuntimeError, match=r"rank 1 died \(exit code -9, killed by SIGKILL\)"):
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    elapsed = time.monotonic() - killed["at"]
    assert elapsed < RAISE_WITHIN
    assert llm.scheduler.is_finished() and not llm.scheduler.block_manager.used_block_ids   # requests dropped
    with pytest.raises(RuntimeError, match="rank 1 died"):      # for good, not just once
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    t = time.monotonic()
    llm.exit()
    print(f"\n[{device}] worker killed {when}: generate raised after {elapsed:.2f} s, "
          f"exit() took {time.monotonic() - t:.2f} s")
    assert_clean_and_usable(model_dir, device, expected, shm_before, workers)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(tmp_path, body, **popen):
    """A user's script file (spawned workers import it again by its path), run by its own interpreter."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **popen)


def test_a_script_without_the_main_guard_is_told_to_add_it(model_dir, device, tmp_path):
    shm_before = shm_segments()
    t = time.monotonic()
    child = run_script(tmp_path, f"""
        from nanovllm import LLM
        llm = LLM({str(model_dir)!r}, **{engine_args(device)!r})
        print("built an engine: the guard was not needed?")
    """)
    stdout, stderr = child.communicate(timeout=60)
    elapsed = time.monotonic() - t
    print(f"\n[{device}] unguarded script exited with {child.returncode} after {elapsed:.2f} s")
    assert child.returncode != 0 and "built an engine" not in stdout
    last_line = stderr.strip().splitlines()[-1]     # the parent's own error (the child's tail is quoted above it)
    assert "rank 1 died" in stderr and 'if __name__ == "__main__":' in stderr, stderr[-3000:]
    assert "rank 1's error output" in stderr and last_line.strip(), stderr[-3000:]
    # the script was rank 0 (its worker, importing it again, was refused before it built anything)
    assert shm_segments() == shm_before and not shm_segments(child.pid)


GENERATE_FOREVER = """
    import signal
    import sys
    from nanovllm import LLM, SamplingParams
    # Ctrl-C as in a terminal: a runner started in the background (bash without job control) passes
    # SIGINT on ignored, and Python then never raises KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if __name__ == "__main__":
        llm = LLM({model!r}, **{args!r})
        print("worker", llm.workers.processes[0].pid, flush=True)
        while True:
            llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
"""


def start_generating_forever(tmp_path, model_dir, device):
    child = run_script(tmp_path, GENERATE_FOREVER.format(model=str(model_dir), args=engine_args(device)),
                       start_new_session=True)      # its own process group, as a terminal would have
    for line in child.stdout:                       # (NCCL may print its version first)
        if line.startswith("worker "):
            worker_pid = int(line.split()[1])
            break
    else:
        pytest.fail(f"the script ended before it started generating:\n{child.stderr.read()[-3000:]}")
    time.sleep(1.0)                                 # well inside generate
    return child, worker_pid


@pytest.fixture
def generating_script(model_dir, device, tmp_path):
    """A TP=2 script in the middle of an endless generate; killed with its group if a test fails."""
    child, worker_pid = start_generating_forever(tmp_path, model_dir, device)
    yield child, worker_pid
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGKILL)
    if not gone(worker_pid):
        os.kill(worker_pid, signal.SIGKILL)


def test_ctrl_c_during_generate_stops_every_process(generating_script, device):
    child, worker_pid = generating_script
    assert glob.glob(f"/dev/shm/nanovllm-{child.pid}-*"), "the script's buffer should exist while it runs"
    t = time.monotonic()
    os.killpg(child.pid, signal.SIGINT)             # Ctrl-C: the whole foreground group gets it
    _, stderr = child.communicate(timeout=30)
    elapsed = time.monotonic() - t
    print(f"\n[{device}] Ctrl-C during TP=2 generate: the script ended after {elapsed:.2f} s")
    assert "KeyboardInterrupt" in stderr, stderr[-3000:]
    assert elapsed < RAISE_WITHIN
    assert wait_until(lambda: gone(worker_pid), 5), "the worker outlived its script"
    assert not glob.glob(f"/dev/shm/nanovllm-{child.pid}-*")


def test_a_killed_rank0_takes_its_workers_along(generating_script, device):
    child, worker_pid = generating_script
    t = time.monotonic()
    child.kill()
    child.communicate(timeout=30)
    assert wait_until(lambda: gone(worker_pid), RAISE_WITHIN), "an orphaned worker kept running"
    elapsed = time.monotonic() - t
    # the resource tracker unlinks the buffer once rank 0 and the worker are both gone
    assert wait_until(lambda: not glob.glob(f"/dev/shm/nanovllm-{child.pid}-*"), 5)
    print(f"\n[{device}] rank 0 killed: its worker was gone after {elapsed:.2f} s")


def test_exit_does_not_wait_forever_for_a_worker_that_stopped_responding(model_dir, device):
    """A worker that neither reads nor dies (SIGSTOP stands in for a hung one) is killed after
    STOP_SECONDS: exit() returns, and nothing is left."""
    from nanovllm.distributed.workers import STOP_SECONDS
    shm_before = shm_segments()
    llm = LLM(str(model_dir), **engine_args(device))
    workers = list(llm.workers.processes)
    os.kill(workers[0].pid, signal.SIGSTOP)
    t = time.monotonic()
    llm.exit()
    elapsed = time.monotonic() - t
    print(f"\n[{device}] exit() with a stopped worker took {elapsed:.2f} s")
    assert elapsed < STOP_SECONDS + 5
    assert all(not p.is_alive() for p in workers) and shm_segments() == shm_before
