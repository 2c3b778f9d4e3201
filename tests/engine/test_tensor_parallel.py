"""Tensor parallelism on CPU: two gloo ranks, rank 0 in this process and rank 1 spawned."""
import glob
import os
import random

import pytest
import torch.multiprocessing as mp

from nanovllm import LLM, SamplingParams
from oracle import hf_greedy, load_hf_model

pytestmark = [pytest.mark.timeout(300),  # worker processes: a regression must fail, not hang CI
              pytest.mark.cpu_only]      # every engine is device="cpu" (gloo ranks)

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SHAPE = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=64, intermediate_size=96)


def prompts_with_shared_prefix(n=6, seed=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(512) for _ in range(20)]
    return [prefix + [rng.randrange(512) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def shm_segments(pid=None):
    """The shared-memory segments that process `pid` (default: this one) created. A segment is named after
    the process that creates it, rank 0 (nanovllm/distributed/workers.py; the workers only attach to it), so
    these are all a test's engines can leave behind; others (another xdist worker's engines) are not ours."""
    return set(glob.glob(f"/dev/shm/nanovllm-{pid or os.getpid()}-*"))


def live_children():
    return [p for p in mp.active_children() if p.is_alive()]


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint(**SHAPE)


def test_tp2_matches_tp1_and_transformers_with_cache_hits_and_preemption(model_dir):
    prompts = prompts_with_shared_prefix()
    hf = load_hf_model(model_dir)
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    outputs = {}
    for tp in (1, 2):
        with LLM(str(model_dir), device="cpu", tensor_parallel_size=tp, kvcache_block_size=16, max_model_len=128,
                 num_kvcache_blocks=8) as llm:
            first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
            rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
            outputs[tp] = [o["token_ids"] for o in first + rest]
            assert llm.stats["num_prefix_cache_hit_tokens"] > 0
            assert llm.stats["num_preemptions"] > 0
    assert outputs[2] == outputs[1] == expected


def test_tp2_partial_prefix_hits_match_transformers(model_dir):
    """In 64-token pages a 100-token prefix ends inside the second page: the later prompts copy its 36
    shared tokens from the first prompt's page, on both ranks, before their step."""
    rng = random.Random(3)
    prefix = [rng.randrange(1, 512) for _ in range(100)]
    prompts = [prefix + [rng.randrange(1, 512) for _ in range(n)] for n in (40, 5, 9, 14)]    # the first fills two pages
    hf = load_hf_model(model_dir)
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    with LLM(str(model_dir), device="cpu", tensor_parallel_size=2, kvcache_block_size=64, max_model_len=256) as llm:
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in first + rest] == expected
        shared = [next(i for i, (a, b) in enumerate(zip(p, prompts[0])) if a != b) for p in prompts[1:]]
        assert min(shared) >= 100 and llm.stats["num_prefix_cache_hit_tokens"] == sum(shared)

def test_two_engines_at_once_and_nothing_left_behind(model_dir):
    before_shm, before_children = shm_segments(), len(live_children())
    prompts = prompts_with_shared_prefix(3, seed=1)
    a = LLM(str(model_dir), device="cpu", tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
    b = LLM(str(model_dir), device="cpu", tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
    try:
        assert len(live_children()) == before_children + 2
        assert len(shm_segments() - before_shm) == 2        # each engine has its own buffer
        out_a = a.generate(prompts, GREEDY, use_tqdm=False)
        out_b = b.generate(prompts, GREEDY, use_tqdm=False)
        assert out_a == out_b
    finally:
        a.exit()
        b.exit()
    assert shm_segments() == before_shm
    assert len(live_children()) == before_children


def test_oversized_messages_are_refused_not_truncated(model_dir):
    with LLM(str(model_dir), device="cpu", tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128) as llm:
        with pytest.raises(RuntimeError, match="outgrows"):
            llm.workers.send("run", (b"x" * (1 << 25),))
        assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["token_ids"]) == 10


def test_atexit_cleans_up_an_engine_left_running(model_dir):
    """A script that never calls exit(): the interpreter's exit still stops the worker and unlinks
    the shared memory."""
    import subprocess
    import sys
    import textwrap

    before_shm = shm_segments()
    script = textwrap.dedent(f"""
        import os
        from nanovllm import LLM, SamplingParams
        llm = LLM({str(model_dir)!r}, device="cpu", tensor_parallel_size=2, kvcache_block_size=16, max_model_len=64)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        print("worker", llm.workers.processes[0].pid, "rank0", os.getpid(), flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "leaked" not in result.stderr          # the resource tracker found nothing left to clean
    [line] = [line for line in result.stdout.splitlines() if line.startswith("worker ")]
    worker_pid, script_pid = map(int, line.split()[1::2])
    assert shm_segments() == before_shm and not shm_segments(script_pid)
    assert not os.path.exists(f"/proc/{worker_pid}") or "zombie" in open(f"/proc/{worker_pid}/status").read().lower()


def test_tp2_samples_what_tp1_samples_with_every_option(model_dir):
    """Rank 0 samples; the other rank must still compute the n completions split off a prompt (their
    copied KV block included) and read the pending tokens that rank 0 broadcast."""
    prompts = prompts_with_shared_prefix(4, seed=2)
    params = [SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, top_k=20, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True,
                             logprobs=2),
              SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.3, seed=4, max_tokens=8,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, presence_penalty=1.0, max_tokens=8, ignore_eos=True)]
    outputs = {}
    for tp in (1, 2):
        with LLM(str(model_dir), device="cpu", tensor_parallel_size=tp, kvcache_block_size=16,
                 max_model_len=128) as llm:
            outputs[tp] = [[c["token_ids"] for c in o["outputs"]] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs[2] == outputs[1]
    assert len(set(map(tuple, outputs[1][0]))) == 1 and len(outputs[1][0]) == 3    # greedy twins


def test_structured_outputs_under_tp2_equal_one_rank(model_dir):
    """Rank 0 alone holds the grammars and masks its sampling; rank 1 joins the deferred sampling's
    broadcast. Seeded regex-constrained completions (random weights, temperature 1) equal one rank's."""
    import re
    pytest.importorskip("xgrammar")
    from nanovllm import StructuredOutputsParams
    pattern = r"[a-c]{2,6}(-[a-c]{2,6}){1,3}"
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, n=2,
                             structured_outputs=StructuredOutputsParams(regex=pattern)) for s in range(4)]
    prompts = prompts_with_shared_prefix(4)
    outputs = {}
    for tp in (1, 2):
        with LLM(str(model_dir), device="cpu", tensor_parallel_size=tp, kvcache_block_size=16) as llm:
            outputs[tp] = llm.generate(prompts, params, use_tqdm=False)
    assert [o["outputs"] for o in outputs[2]] == [o["outputs"] for o in outputs[1]]
    completions = [c for o in outputs[1] for c in o["outputs"]]
    assert any(c["finish_reason"] == "stop" for c in completions)
    for c in completions:
        assert c["finish_reason"] == "length" or re.fullmatch(pattern, c["text"]), c["text"]
