"""The server under load: bench.py's standard workload (the same token ids) replayed against
`nanovllm serve` over HTTP, streamed, all at once and with Poisson arrivals at given rates.

    python benchmarks/bench_serving.py                      # starts a server on the default model itself
    python benchmarks/bench_serving.py --rates inf,8,16,32 --offline --single-stream --json
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --model-name NAME

Per rate: time to first token (TTFT), the gaps between streamed chunks (inter-token latency, ITL: one
token a chunk while the client keeps up), time per output token after the first (TPOT) and end-to-end
latency, p50/p90/p99, and output tokens per second over the whole run. --offline first runs the same
requests through LLM.generate in this process (the figure the server is held against: serving may cost
at most 5%), --single-stream one 512-token prompt with 1,024 tokens streamed, against the same offline.
The client is aiohttp (`pip install aiohttp`), in this process; the server is a subprocess.
"""
import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]     # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": sum(values) / len(values)}


class Server:
    """`nanovllm serve MODEL` on 127.0.0.1 and a free port, until the context ends."""

    def __init__(self, model: Path, llm_args: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, "-m", "nanovllm.entrypoints.cli", "serve", str(model),
                                         "--host", "127.0.0.1", "--port", str(self.port), *llm_args],
                                        start_new_session=True)

    async def wait_ready(self, session, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.process.returncode}")
            try:
                async with session.get(f"{self.url}/health") as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


async def one_request(session, url: str, model: str, prompt: list[int], max_tokens: int, temperature: float) -> dict:
    """One streamed completion: its start, first-chunk and end times, chunk gaps and tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    gaps, tokens = [], 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if not chunk.get("choices"):
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
    end = time.perf_counter()
    return {"start": start, "ttft": (first or end) - start, "gaps": gaps, "e2e": end - start, "tokens": tokens,
            "tpot": ((end - first) / (tokens - 1)) if first is not None and tokens > 1 else None}


async def run_load(url: str, model: str, workload, rate: float, temperature: float, seed: int) -> dict:
    """Every request of the workload, arriving at `rate` per second (Poisson; inf: all at once)."""
    import aiohttp

    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks, begin = [], time.perf_counter()
        for prompt, max_tokens in zip(workload.prompts, workload.max_tokens):
            tasks.append(asyncio.create_task(one_request(session, url, model, prompt, max_tokens, temperature)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - begin
    tokens = sum(r["tokens"] for r in results)
    assert tokens == sum(workload.max_tokens), (tokens, sum(workload.max_tokens))
    ms = lambda values: {k: (v * 1e3 if v is not None else None) for k, v in percentiles(values).items()}  # noqa: E731
    return {"rate": rate, "requests": len(results), "output_tokens": tokens, "time_s": elapsed,
            "output_throughput": tokens / elapsed,
            "ttft_ms": ms([r["ttft"] for r in results]), "itl_ms": ms([g for r in results for g in r["gaps"]]),
            "tpot_ms": ms([r["tpot"] for r in results if r["tpot"] is not None]),
            "e2e_ms": ms([r["e2e"] for r in results])}


def offline(args, model: Path, workload, single) -> dict:
    """The same requests through LLM.generate (one engine, as bench.py builds it), then the lone stream."""
    from time import perf_counter

    from nanovllm import SamplingParams
    llm = bench.make_engine(args, model)
    try:
        result = bench.run_workload(llm, workload, {"temperature": args.temperature}, desc="offline")
        figures = {"output_throughput": result["generated"] / result["time_s"], "time_s": result["time_s"]}
        if single is not None:
            prompt, max_tokens = single.prompts[0], single.max_tokens[0]
            start = perf_counter()
            llm.generate([prompt[::-1]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
            figures["single_ttft_ms"] = (perf_counter() - start) * 1e3
            start = perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                         use_tqdm=False)
            figures["single_ms_per_token"] = (perf_counter() - start) * 1e3 / max_tokens
    finally:
        llm.exit()
    return figures


async def serve_and_measure(args, model: Path, workload, single, llm_args: list[str]) -> list[dict]:
    import aiohttp

    server = None if args.url else Server(model, llm_args)
    url = args.url or server.url
    try:
        async with aiohttp.ClientSession() as session:
            if server is not None:
                await server.wait_ready(session)
            async with session.get(f"{url}/v1/models") as response:
                name = args.model_name or (await response.json())["data"][0]["id"]
            # one short request first: the server's own warm-up, as bench.py's engine gets one
            await one_request(session, url, name, [1, 2, 3], 4, 0.0)
        rows = []
        for i, rate in enumerate(args.rates):
            row = await run_load(url, name, fresh(workload, i) if i else workload, rate, args.temperature, args.seed)
            rows.append(row)
            print(json.dumps(row) if args.json else f"rate {rate}: {row['output_throughput']:.0f} output tok/s")
        if single is not None:
            async with aiohttp.ClientSession() as session:
                lone = await one_request(session, url, name, single.prompts[0][::-1], 1, 0.0)
                stream = await one_request(session, url, name, single.prompts[0], single.max_tokens[0], 0.0)
            row = {"rate": "single-stream", "output_tokens": stream["tokens"], "ttft_ms": lone["ttft"] * 1e3,
                   "itl_ms": {k: (v * 1e3 if v is not None else None) for k, v in percentiles(stream["gaps"]).items()},
                   "e2e_ms": stream["e2e"] * 1e3}
            rows.append(row)
            print(json.dumps(row) if args.json else f"single stream: ITL p50 {row['itl_ms']['p50']:.3f} ms")
        return rows
    finally:
        if server is not None:
            server.stop()


def fresh(workload, seed: int):
    """The same lengths, other token ids: a later rate finds nothing of an earlier one in the prefix cache."""
    import dataclasses
    rng = random.Random(f"serving/{seed}")
    return dataclasses.replace(workload, prompts=[[rng.randrange(10000) for _ in p] for p in workload.prompts])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start one on --model)")
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: bench.py's random Qwen3-0.6B)")
    parser.add_argument("--model-name", help="the served model name (default: the server's first)")
    parser.add_argument("--rates", default="inf", help="comma-separated request rates per second; inf: all at once")
    parser.add_argument("--offline", action="store_true", help="also LLM.generate on the same requests, first")
    parser.add_argument("--single-stream", action="store_true", help="also one 512-token prompt, 1,024 tokens")
    parser.add_argument("--num-seqs", type=int, default=None)
    parser.add_argument("--max-input-len", type=int, default=None)
    parser.add_argument("--max-output-len", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args, llm_args = parser.parse_known_args()      # the rest goes to `nanovllm serve` (LLM arguments)
    args.rates = [float(r) for r in args.rates.split(",")]
    bench_args = bench.parse_args([a for a, v in (("--num-seqs", args.num_seqs), ("--max-input-len",
                                   args.max_input_len), ("--max-output-len", args.max_output_len)) if v is not None
                                   for a in (a, str(v))])
    bench_args.temperature = args.temperature
    model = args.model or bench.default_model(bench_args.device, bench_args.shape)
    workload = bench.make_workload(bench_args.num_seqs, bench_args.max_input_len, bench_args.max_output_len, args.seed)
    single = bench.draw_workload("single-stream", bench_args.device, args.seed) if args.single_stream else None
    llm_args = ["--max-model-len", str(bench.MAX_MODEL_LEN), *llm_args]
    reference = offline(bench_args, model, workload, single) if args.offline else None
    if reference is not None:
        print(json.dumps({"offline": reference}) if args.json else f"offline: {reference}")
    rows = asyncio.run(serve_and_measure(args, model, workload, single, llm_args))
    print(f"\n{'rate':>14s} {'tok/s':>8s} {'TTFT p50/p90/p99 ms':>24s} {'ITL p50/p90/p99 ms':>22s} "
          f"{'e2e p50/p99 s':>14s}")
    for row in rows:
        fmt = lambda d: "/".join(f"{d[k]:.1f}" for k in ("p50", "p90", "p99"))   # noqa: E731
        if row["rate"] == "single-stream":
            print(f"{'single-stream':>14s} {'':>8s} {row['ttft_ms']:24.1f} {fmt(row['itl_ms']):>22s} "
                  f"{row['e2e_ms'] / 1e3:14.2f}")
            continue
        print(f"{row['rate']:>14} {row['output_throughput']:8.0f} {fmt(row['ttft_ms']):>24s} {fmt(row['itl_ms']):>22s} "
              f"{row['e2e_ms']['p50'] / 1e3:6.2f}/{row['e2e_ms']['p99'] / 1e3:.2f}")
    if reference is not None:
        at_once = next((r for r in rows if r["rate"] == float("inf")), None)
        if at_once is not None:
            print(f"all at once: server {at_once['output_throughput']:.0f} tok/s = "
                  f"{at_once['output_throughput'] / reference['output_throughput']:.3f} of offline "
                  f"{reference['output_throughput']:.0f} (goal >= 0.95)")
        lone = next((r for r in rows if r["rate"] == "single-stream"), None)
        if lone is not None and "single_ms_per_token" in reference:
            print(f"single stream: ITL p50 {lone['itl_ms']['p50']:.3f} ms = "
                  f"{lone['itl_ms']['p50'] / reference['single_ms_per_token']:.3f} x offline "
                  f"{reference['single_ms_per_token']:.3f} ms/token (goal <= 1.1); TTFT {lone['ttft_ms']:.1f} ms "
                  f"(offline {reference['single_ttft_ms']:.1f}; goal <= 10 + network)")


if __name__ == "__main__":
    main()
