"""AsyncLLM: the engine in a process of its own, driven from asyncio. Streamed outputs add up to what
LLM.generate returns for the same requests (text, tokens, log-probs, n, stop strings, prompt log-probs);
requests come and go while others run; abort (or leaving the `async for`) frees a request's blocks at
once; refusals raise before anything is yielded; tensor parallelism works behind it; shutdown leaves no
process behind."""
import asyncio
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanovllm import LLM, AsyncLLM, EngineDeadError, SamplingParams, StructuredOutputsParams
from oracle import random_prompts

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.cpu_only]     # every engine is device="cpu"

REQUESTS = [(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=2))
            for p, m in zip(random_prompts(6, 512, (3, 40), seed=4), (5, 17, 30, 1, 12, 24))]
REQUESTS += [("The capital of", SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=20, ignore_eos=True)),
             ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=40, stop=["a", "e"], ignore_eos=True)),
             ([9, 8, 7, 6, 5], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2))]
FIELDS = ("text", "token_ids", "finish_reason", "stop_reason")


def close(a, b, tolerance=1e-4) -> bool:
    """Log-probs (dicts, lists of them, floats, None) equal up to float32 noise: the two runs batch the
    requests differently."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b if a is None or b is None else abs(a - b) < tolerance


@pytest.fixture(scope="module")
def engine(tiny_model):
    with AsyncLLM(str(tiny_model), device="cpu", max_model_len=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def slow_engine(slow_model):
    """Steps slow enough that a request is still running when a test acts on it (the tiny model generates
    hundreds of tokens in ~0.1 s): a wider model (SLOW_MODEL_SHAPE), on every machine."""
    with AsyncLLM(str(slow_model), device="cpu", kvcache_block_size=16, max_model_len=256) as engine:
        yield engine


async def collect(engine, prompt, params, request_id):
    """Every output of one request: the completions' streamed text and tokens, and the last output."""
    texts, tokens, outputs = {}, {}, []
    async for out in engine.generate(prompt, params, request_id):
        outputs.append(out)
        for delta in out.deltas:
            texts[delta.index] = texts.get(delta.index, "") + delta.text
            tokens.setdefault(delta.index, []).extend(delta.token_ids)
    return texts, tokens, outputs


def test_streams_add_up_to_what_generate_returns(tiny_model, engine):
    async def run_all():
        return await asyncio.gather(*(collect(engine, p, sp, f"req-{i}") for i, (p, sp) in enumerate(REQUESTS)))
    streamed = asyncio.run(run_all())
    with LLM(str(tiny_model), device="cpu", max_model_len=256) as llm:
        offline = llm.generate([p for p, _ in REQUESTS], [sp for _, sp in REQUESTS], use_tqdm=False)
    for (texts, tokens, outputs), expected in zip(streamed, offline):
        last = outputs[-1]
        assert last.finished and all(not out.finished for out in outputs[:-1])
        assert last.output["prompt_token_ids"] == expected["prompt_token_ids"] == outputs[0].prompt_token_ids
        assert last.output.outputs[0].text == expected.outputs[0].text     # attribute reads survive the pipe
        assert close(last.output["prompt_logprobs"], expected["prompt_logprobs"])
        for index, completion in enumerate(expected["outputs"]):
            assert texts[index] == completion["text"] and tokens[index] == completion["token_ids"]
            for field in FIELDS:
                assert last.output["outputs"][index][field] == completion[field], field
            for field in ("logprobs", "cumulative_logprob"):
                assert close(last.output["outputs"][index][field], completion[field]), field
    stats = engine.stats()
    assert stats["requests_finished_total"] >= len(REQUESTS) and stats["num_used_blocks"] == 0
    assert stats["histograms"]["time_to_first_token_seconds"]["count"] >= len(REQUESTS)


# n completions that end at different steps, for different reasons: stop tokens (a tenth of the vocabulary,
# so most completions meet one early), stop strings, eos, the length limit; sampled and seeded, so
# LLM.generate draws the same tokens
STOP_TOKENS = list(range(0, 512, 10))
MIXED = [([1, 2, 3, 4 + i], SamplingParams(n=n, temperature=1.0, seed=80 + i, max_tokens=30,
                                           stop_token_ids=STOP_TOKENS if i % 3 != 2 else [],
                                           stop=["a"] if i % 2 else None, ignore_eos=i % 4 == 3))
         for i, n in enumerate((2, 3, 5, 2, 4, 8))]


def test_a_request_ends_exactly_when_its_last_completion_does(tiny_model, engine):
    """Whatever mix of finish reasons and steps its n completions end with, a request's stream ends, with
    every completion as LLM.generate gives it (a completion that ended a step before the others once made
    the request vanish in the engine process, and its stream never ended)."""
    async def run_all():
        jobs = (collect(engine, p, sp, f"mixed-{i}") for i, (p, sp) in enumerate(MIXED))
        return await asyncio.wait_for(asyncio.gather(*jobs), 120)
    streamed = asyncio.run(run_all())
    with LLM(str(tiny_model), device="cpu", max_model_len=256) as llm:
        offline = llm.generate([p for p, _ in MIXED], [sp for _, sp in MIXED], use_tqdm=False)
    reasons, lengths = set(), set()
    for (texts, tokens, outputs), expected in zip(streamed, offline):
        assert outputs[-1].finished and all(not out.finished for out in outputs[:-1])
        for index, completion in enumerate(expected["outputs"]):
            assert tokens[index] == completion["token_ids"] and texts[index] == completion["text"]
            got = outputs[-1].output["outputs"][index]
            assert (got["finish_reason"], got["stop_reason"]) == (completion["finish_reason"], completion["stop_reason"])
            reasons.add((completion["finish_reason"], type(completion["stop_reason"]).__name__))
            lengths.add(len(completion["token_ids"]))
    # the mix this test is about: stop tokens, stop strings and the length limit, at many steps
    assert {("stop", "int"), ("stop", "str"), ("length", "NoneType")} <= reasons and len(lengths) > 5
    assert engine.stats()["num_used_blocks"] == 0


def test_a_speculating_engine_streams_the_same_mix_and_counts_its_drafts(tiny_model):
    """Behind AsyncLLM, n-gram speculation on every step: the mixed requests above (n completions ending at
    different steps on stop tokens, stop strings and the length limit) and greedy ones on repeating prompts
    (several tokens a step, max_tokens inside an accepted run) stream exactly what LLM.generate without
    speculation returns (seeded draws are plain decoding's), while another request is aborted mid-stream;
    every stream ends, the blocks come back, and the draft counters reach the engine's figures (/metrics'
    source)."""
    from speculation import REPEATING
    requests = MIXED + [(prompt, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, n=1 + i % 2))
                        for i, (prompt, m) in enumerate(zip(REPEATING, (13, 29, 40, 7)))]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "adaptive": False}

    async def scenario(engine):
        async def aborted():
            params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            outputs = []
            async for out in engine.generate([7, 8, 7, 8, 7, 8], params, "aborted"):
                if not outputs:                 # at its first output: the rest of its 200 tokens never come
                    await engine.abort("aborted")
                outputs.append(out)
            return outputs[-1]
        jobs = [collect(engine, p, sp, f"spec-{i}") for i, (p, sp) in enumerate(requests)]
        return await asyncio.wait_for(asyncio.gather(aborted(), *jobs), 120)

    with AsyncLLM(str(tiny_model), device="cpu", max_model_len=256, speculative_config=spec) as engine:
        last_aborted, *streamed = asyncio.run(scenario(engine))
        stats = engine.stats()
    with LLM(str(tiny_model), device="cpu", max_model_len=256) as llm:
        offline = llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
    assert last_aborted.finished and last_aborted.output["outputs"][0]["finish_reason"] == "abort"
    for (texts, tokens, outputs), expected in zip(streamed, offline):
        assert outputs[-1].finished and all(not out.finished for out in outputs[:-1])
        for index, completion in enumerate(expected["outputs"]):
            assert tokens[index] == completion["token_ids"] and texts[index] == completion["text"]
            got = outputs[-1].output["outputs"][index]
            assert (got["finish_reason"], got["stop_reason"]) == \
                (completion["finish_reason"], completion["stop_reason"])
    assert stats["num_used_blocks"] == 0
    assert 0 < stats["spec_decode_accepted_tokens"] <= stats["spec_decode_draft_tokens"]


def test_structured_outputs_stream_and_a_bad_one_is_refused_in_the_callers_process(tiny_model, engine):
    """A regex-constrained request with n = 3 (random weights, temperature 1: only the mask keeps it in
    shape): every streamed completion matches in full and equals LLM.generate's for the same seed; a
    malformed regex raises ValueError before anything is yielded, and the engine goes on."""
    import re
    pattern = r"(ab|ba)+c"
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=24,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    texts, tokens, outputs = asyncio.run(collect(engine, "x", params, "regex"))
    assert outputs[-1].finished and len(texts) == 3
    with LLM(str(tiny_model), device="cpu", max_model_len=256) as llm:
        [expected] = llm.generate(["x"], params, use_tqdm=False)
    for index, completion in enumerate(expected["outputs"]):
        assert texts[index] == completion["text"] and tokens[index] == completion["token_ids"]
        if completion["finish_reason"] == "stop":
            assert re.fullmatch(pattern, completion["text"])
        else:
            assert re.fullmatch(r"((ab|ba)+c?|(ab|ba)*[ab])", completion["text"])    # a prefix, cut off
    assert any(c["finish_reason"] == "stop" for c in expected["outputs"])

    async def refused():
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab"))
        async for _ in engine.generate("x", bad, "bad regex"):
            raise AssertionError("yielded")
    with pytest.raises(ValueError, match="structured_outputs.regex is not valid"):
        asyncio.run(refused())


@pytest.mark.parametrize("speculative_config", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                                        "adaptive": False}], ids=["plain", "ngram"])
def test_the_figures_settle_to_idle_when_a_stop_string_ends_the_last_completion(tiny_model, engine,
                                                                                 speculative_config):
    """A stop string found in the frontend ends the last running completion (FinishCompletion); the step
    in flight, if any, then collects nothing new, and a speculating engine (which collects each step before
    the next) has no step left at all. The engine's figures must still come back idle: no request running,
    no KV block in use (the soak saw /metrics stuck at 4 running, 15 blocks; a speculating server at 1
    running, 19 blocks)."""
    import time

    def run(engine):
        params = SamplingParams(temperature=0.0, max_tokens=200, stop=["a", "e", "o", "i", "u", " "],
                                ignore_eos=True)
        # greedy on these prompts meets a stop string (a fifth never does)
        requests = [([5, 6, 7, i], params) for i in range(4)]
        if speculative_config is not None and importlib.util.find_spec("xgrammar") is not None:
            # a choice that repeats the prompt: n-gram drafts are accepted, steps are verified one at a time,
            # so no step is in flight when the stop string ends the completion
            passage = "the fox jumps again, and then the fox sleeps under a tree"
            forced = SamplingParams(temperature=0.0, max_tokens=150, stop=["jumps again"],
                                    structured_outputs=StructuredOutputsParams(choice=[passage]))
            requests.append((f"Repeat: {passage}\nAgain: {passage}\nAgain: ", forced))
        for i, (prompt, params) in enumerate(requests):
            texts, _, outputs = asyncio.run(collect(engine, prompt, params, f"stop-{i}"))
            assert outputs[-1].finished and outputs[-1].output["finish_reason"] == "stop"
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and (engine.stats().get("num_used_blocks")
                                                   or engine.stats().get("num_running")):
                time.sleep(0.01)
            stats = engine.stats()
            assert stats["num_used_blocks"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    if speculative_config is None:
        run(engine)
    else:
        with AsyncLLM(str(tiny_model), device="cpu", max_model_len=256,
                      speculative_config=speculative_config) as speculating:
            run(speculating)


def test_refusals_raise_before_anything_runs_and_the_engine_goes_on(engine):
    async def scenario():
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine, [1] * 300, SamplingParams(), "too-long")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(engine, [100000], SamplingParams(), "bad-token")
        with pytest.raises(TypeError, match="SamplingParams"):
            await collect(engine, [1, 2], {"max_tokens": 3}, "bad-params")
        eos = min(engine.limits.eos_token_ids)      # the engine's eos ids reach the caller's process
        with pytest.raises(ValueError, match="allowed_token_ids allows"):
            await collect(engine, [1, 2], SamplingParams(min_tokens=2, allowed_token_ids=[eos]), "nothing-left")
        first = engine.generate([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), "twin")
        await first.__anext__()
        with pytest.raises(ValueError, match="already running"):
            await collect(engine, [1, 2], SamplingParams(), "twin")
        await first.aclose()
        _, tokens, _ = await collect(engine, [4, 5], SamplingParams(max_tokens=3, ignore_eos=True), "after")
        assert len(tokens[0]) == 3
    asyncio.run(scenario())


def test_abort_and_leaving_early_free_the_blocks_at_once(slow_engine):
    async def used_blocks_settle():
        for _ in range(100):        # bounded: the engine reports after each abort
            if slow_engine.stats()["num_used_blocks"] == 0:
                return True
            await asyncio.sleep(0.05)
        return False

    async def scenario():
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, n=2)
        outputs = []
        async for out in slow_engine.generate(list(range(1, 40)), params, "aborted"):
            outputs.append(out)
            if len(outputs) == 1:
                assert slow_engine.stats()["num_used_blocks"] > 0
                await slow_engine.abort("aborted")
        last = outputs[-1]
        assert last.finished and {c["finish_reason"] for c in last.output["outputs"]} == {"abort"}
        assert sum(len(c["token_ids"]) for c in last.output["outputs"]) < 100
        assert await used_blocks_settle()

        async for out in slow_engine.generate(list(range(1, 40)), params, "left"):
            break                   # the caller leaves: the request is aborted
        assert await used_blocks_settle()
        _, tokens, _ = await collect(slow_engine, [3, 4], SamplingParams(max_tokens=2, ignore_eos=True), "next")
        assert len(tokens[0]) == 2
    asyncio.run(scenario())


def test_tensor_parallel_behind_the_async_engine(tiny_model):
    prompts = random_prompts(3, 512, (3, 30), seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def run(engine):
        return await asyncio.gather(*(collect(engine, p, params, f"tp-{i}") for i, p in enumerate(prompts)))
    with AsyncLLM(str(tiny_model), device="cpu", tensor_parallel_size=2, max_model_len=256) as engine:
        streamed = asyncio.run(run(engine))
        process = engine._process
    assert not process.is_alive()
    with LLM(str(tiny_model), device="cpu", max_model_len=256) as llm:
        offline = llm.generate(prompts, params, use_tqdm=False)
    assert [tokens[0] for _, tokens, _ in streamed] == [o["token_ids"] for o in offline]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["shutdown", "async_with"])
def test_shutdown_ends_the_streams_in_flight_and_refuses_later_requests(slow_model, how):
    """Shutting the engine down while requests stream (shutdown() in the loop's thread, or leaving
    `async with`, which shuts down from another thread): every stream ends promptly with EngineDeadError
    saying the engine was shut down (they once waited forever), a generate() after it raises the same
    error before doing anything (it once raised a bare OSError), and no on_dead callback runs (shutting
    down is not dying)."""
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)     # seconds on the slow model
    died = []

    async def stream(engine, request_id: str, outputs: list, started: asyncio.Event) -> None:
        async for out in engine.generate(list(range(1, 20)), params, request_id):
            outputs.append(out)
            started.set()

    async def scenario() -> list:
        engine = AsyncLLM(str(slow_model), device="cpu", kvcache_block_size=16, max_model_len=256)
        engine.on_dead(died.append)
        outputs, started = [[], []], [asyncio.Event(), asyncio.Event()]
        async with engine:
            tasks = [asyncio.create_task(stream(engine, f"in-flight-{i}", outputs[i], started[i])) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            if how == "shutdown":
                engine.shutdown()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        for result, streamed in zip(results, outputs):
            assert isinstance(result, EngineDeadError) and "the engine has stopped: shut down" in str(result), result
            assert streamed and not any(out.finished for out in streamed)      # it was in flight
        assert not engine.is_running and not engine._process.is_alive()
        with pytest.raises(EngineDeadError, match="the engine has stopped: shut down"):
            await asyncio.wait_for(stream(engine, "after", [], asyncio.Event()), 10)
        return died
    assert asyncio.run(scenario()) == []


@pytest.mark.timeout(180)
def test_an_engine_built_while_its_script_is_imported_says_to_guard_the_script(tiny_model, tmp_path):
    """A script that builds an AsyncLLM at its top level, without `if __name__ == "__main__":`: the spawned
    engine process imports the script again and fails before the engine can report anything; the caller's
    own error says the engine exited while starting and points at the guard (it was a bare EOFError)."""
    script = tmp_path / "unguarded.py"
    script.write_text("from nanovllm import AsyncLLM\n"
                      f"AsyncLLM({str(tiny_model)!r}, device='cpu', max_model_len=64)\n")
    root = str(Path(__file__).resolve().parents[1])     # this checkout's nanovllm, in both processes
    env = {**os.environ, "PYTHONIOENCODING": "utf-8",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150, env=env)
    # the last line is the caller's exception (the engine process's traceback, also on stderr, comes first)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and last.startswith("RuntimeError: the engine process exited while starting"), \
        result.stderr[-3000:]
    assert 'if __name__ == "__main__":' in last
