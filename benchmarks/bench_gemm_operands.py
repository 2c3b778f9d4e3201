"""Does what a GEMM multiplies change how fast it runs? Prefill-sized bf16 GEMMs on an H100 run at the board's
power limit, where the SM clock, and so the time, depends on how many bits the tensor cores toggle.

Issue #38's side-by-side runs at 8B and 30B-A3B give both engines `load_format="dummy"`, and each draws its own
random weights: nanovllm matrices ~ N(0, 0.02) with norm weights one (nanovllm.utils.loader.load_dummy_weights),
vLLM every parameter ~ U(-1e-3, 1e-3), norm weights included, so the activations its GEMMs read are a thousand
times smaller as well. If that changes the clock, the prefill-heavy rows compare the operands as much as the
engines, and a like-for-like run loads one checkpoint into both (the peer kit's MODEL=DIR; bench.py writes
random-qwen3-8b with weights). Measured (docs/benchmarks.md, thirty-seventh session): vLLM's operands 0.2-1.6% faster
at 16,384 rows, zeros 17-19%; from one checkpoint in both engines the Qwen3-8B ratios are those of the dummy runs.

This times cuBLAS (F.linear) on Qwen3-8B's four projections at prefill rows with each engine's operands and
with zeros (the floor of toggling), each over about a second of back-to-back calls so the power limit's clock
settles, in the order ours, vLLM's, zeros, vLLM's, ours (the drift shows as the two halves' difference), the SM
clock and board power sampled by nvidia-smi meanwhile.

    PYTHONPATH=. python benchmarks/bench_gemm_operands.py [--rows 16384] [--seconds 1.0]
    PYTHONPATH=. python benchmarks/bench_gemm_operands.py --dry      # CPU: the operands' statistics only
"""
import argparse
import shutil
import subprocess
import threading
import time
from datetime import datetime

import torch
import torch.nn.functional as F

from benchmarks.random_checkpoint import QWEN3_8B, projection_shapes

SHAPES = projection_shapes(QWEN3_8B)        # (N, K)
ORDER = ("ours", "vllm", "zeros", "vllm", "ours")


def operands(kind: str, rows: int, n: int, k: int, device: str, generator: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [rows, k], w [n, k]) in bf16 as each engine's dummy weights make them: x is an RMSNorm's output,
    unit-variance rows times the norm weight (one for ours, U(-1e-3, 1e-3) per column for vLLM's)."""
    x = torch.randn(rows, k, device=device, generator=generator)
    if kind == "ours":
        w = torch.randn(n, k, device=device, generator=generator) * 0.02
    elif kind == "vllm":
        w = torch.rand(n, k, device=device, generator=generator) * 2e-3 - 1e-3
        x = x * (torch.rand(k, device=device, generator=generator) * 2e-3 - 1e-3)
    else:
        x, w = torch.zeros_like(x), torch.zeros(n, k, device=device)
    return x.to(torch.bfloat16), w.to(torch.bfloat16)


class PowerSampler:
    """nvidia-smi's SM clock (MHz) and board power (W) every 50 ms, each sample stamped by nvidia-smi itself (its
    output may reach the pipe in bursts), line-buffered where stdbuf exists."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        command = ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                   "-lms", "50"]
        if shutil.which("stdbuf"):
            command = ["stdbuf", "-oL"] + command
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                stamp, clock, power = (v.strip() for v in line.split(","))
                when = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.samples.append((when, float(clock), float(power)))
            except ValueError:
                continue

    def mean(self, start: float, end: float) -> tuple[float, float]:
        window = [(c, p) for t, c, p in self.samples if start <= t <= end]
        if not window:
            return float("nan"), float("nan")
        return sum(c for c, _ in window) / len(window), sum(p for _, p in window) / len(window)

    def close(self) -> None:
        time.sleep(0.5)                 # the last window's samples through the pipe
        self.process.terminate()
        self.thread.join(timeout=2)


def time_window(x: torch.Tensor, weights: list[torch.Tensor], seconds: float) -> tuple[float, float, float]:
    """us a call over ~`seconds` of back-to-back F.linear calls, and the window's start and end (wall clock, as
    nvidia-smi stamps its samples)."""
    F.linear(x, weights[0])
    torch.cuda.synchronize()
    probe_start = time.perf_counter()
    for w in weights:
        F.linear(x, w)
    torch.cuda.synchronize()
    per_round = (time.perf_counter() - probe_start) / len(weights)
    calls = max(len(weights), int(seconds / max(per_round, 1e-6)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host_start = time.time()
    start.record()
    for i in range(calls):
        F.linear(x, weights[i % len(weights)])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls, host_start, time.time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--seconds", type=float, default=1.0, help="each window's length")
    parser.add_argument("--dry", action="store_true", help="CPU: the operands' scales, no timing")
    args = parser.parse_args()
    generator = torch.Generator("cpu" if args.dry else "cuda").manual_seed(0)
    if args.dry:
        for kind in ("ours", "vllm", "zeros"):
            x, w = operands(kind, 64, 128, 256, "cpu", generator)
            y = F.linear(x.float(), w.float())
            print(f"{kind:6s} |x| {x.float().abs().mean():.3e} |w| {w.float().abs().mean():.3e} "
                  f"|y| {y.abs().mean():.3e}")
        return
    assert torch.cuda.is_available(), "a GPU benchmark (--dry on the CPU)"
    sampler = PowerSampler()
    time.sleep(0.5)
    windows = []            # (shape, kind, us, start, end); the clock and power read after the last window
    try:
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            made = {kind: operands(kind, args.rows, n, k, "cuda", generator) for kind in set(ORDER)}
            for kind in ORDER:
                x, w = made[kind]
                windows.append((name, kind) + time_window(x, [w, w.clone()], args.seconds))
            del made
            torch.cuda.empty_cache()
    finally:
        sampler.close()
    print(f"{'shape':8s} {'rows':>6s} " + " ".join(f"{kind + ' us':>10s} {'MHz':>5s} {'W':>4s}" for kind in ORDER))
    for name in args.shapes.split(","):
        cells = []
        for _, _, us, start, end in (w for w in windows if w[0] == name):
            clock, power = sampler.mean(start, end)
            cells.append(f"{us:10.1f} {clock:5.0f} {power:4.0f}")
        print(f"{name:8s} {args.rows:6d} " + " ".join(cells))


if __name__ == "__main__":
    main()
