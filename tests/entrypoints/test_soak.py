"""A soak of `nanovllm serve` as its users load it (benchmarks/soak_server.py, with small numbers): a few
hundred mixed requests from dozens of concurrent clients against a KV cache small enough to preempt:
greedy completions and chats, plain and streamed, n > 1 sampled completions ending at different steps
(stop_token_ids over ~10% of the vocabulary), clients hanging up mid-stream, bad requests. Nothing may be
lost or wrong (see soak_server.py's checks); afterwards /metrics shows nothing running, waiting or holding
a KV block, and SIGTERM exits cleanly. The same again with speculative decoding, drafts verified every
step, by each method: n-gram lookup, a draft model (the target as its own draft: every draft accepted, so
its unwritten last position is held back from the prefix cache, BlockManager.hold_back) and a random EAGLE-3
head (whose pages' last positions read the token after them: BlockManager.reads_next_token): the same checks
hold, and drafts were accepted."""
import asyncio
import importlib.util
import json
import signal
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.cpu_only]     # the server runs ENGINE_ARGS (--device cpu)

# 40 blocks of 16 tokens: ~6 requests of 100 tokens at once, where 32 clients (n up to 4) want more
ENGINE_ARGS = ["--device", "cpu", "--enforce-eager", "--max-model-len", "512", "--kvcache-block-size", "16",
               "--num-kvcache-blocks", "40"]
CLIENTS, REQUESTS = 32, 300


def load_soak():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "soak_server.py"
    spec = importlib.util.spec_from_file_location("soak_server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("method", [None, "ngram", "draft_model", "eagle3"])
def test_soak(start_server, make_checkpoint, tiny_model, tmp_path, method):
    soak = load_soak()
    model, speculation = tiny_model, None
    if method is not None:
        speculation = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        speculation["model"] = str(tiny_model)
    elif method == "eagle3":        # a head reads three distinct layers: a four-layer target
        from benchmarks.random_checkpoint import write_random_eagle3_head
        model = make_checkpoint(num_hidden_layers=4)
        speculation["model"] = str(write_random_eagle3_head(tmp_path / "head", model, draft_vocab_size=200,
                                                            aux_layer_ids=[0, 2, 3]))
    server = start_server(ENGINE_ARGS + (["--speculative-config", json.dumps(speculation)] if speculation else []),
                          model=str(model))
    # a request unanswered in 60 s is a hang (the slowest here, EAGLE-3's, answer within ~9 s on two idle cores)
    report = asyncio.run(soak.soak(server.url, clients=CLIENTS, requests=REQUESTS, seed=0, max_tokens=64, max_n=4,
                                   pool_size=16, request_timeout=60.0, vocab_size=512, log=lambda *_: None))
    print("\n" + report.summary())
    assert not report.problems, report.summary() + "\n" + server.output()[-3000:]
    assert not report.greedy_drift, report.summary()
    sent = {kind.split()[0] for kind in report.sent}
    assert sent == {"greedy", "sampled", "hangup", "bad"} and sum(report.sent.values()) == REQUESTS
    preemptions = report.metrics_after["num_preemptions_total"] - report.metrics_before.get("num_preemptions_total", 0)
    assert preemptions > 0, "the KV cache should be small enough to preempt"
    if speculation:     # the drafts were verified and some accepted, under preemption, hang-ups and n > 1
        print({name: value for name, value in report.metrics_after.items() if name.startswith("spec_decode")})
        assert report.metrics_after["spec_decode_num_accepted_tokens_total"] > 0, report.metrics_after

    server.process.send_signal(signal.SIGTERM)
    try:
        assert server.process.wait(15) == 0, server.output()[-3000:]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit within 15 s of SIGTERM:\n{server.output()[-3000:]}")
