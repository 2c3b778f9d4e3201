"""Decode attention over rows that share their first pages: each row reading all its keys, against the group
reading its pages once (engine/shared_prefixes.py's grouping, kernels/decode_attention.py's shared prefix), in
CUDA graphs, on one GPU. Layouts (256-token pages, bf16 cache unless --fp8):

    shared-prefix  bench.py's workload: 256 rows over 8 prefixes of 2,000 tokens, 64-320 own tokens each
                   (Qwen3-0.6B's 16 q / 8 kv heads)
    n=4            32 requests of ~1,000-token prompts, 4 completions each, 1-300 tokens generated (Qwen3-8B's 32 / 8)
    system-prompt  256 rows under one 256-token page, 200-800 own tokens (Qwen3-8B's): under half the reads shared
    long-document  16 rows over one 8,000-token document, 1-200 own tokens (Qwen3-8B's)

    PYTHONPATH=. python benchmarks/bench_shared_prefix.py [--rows-per-item 8 16 32] [--fp8]

Prints us a call for each (layout, rows per item), the fraction of key reads the grouping saves, and whether
the engine would group that step (MIN_SAVED_FRACTION). On a CPU: a dry run of one small layout in Triton's
interpreter (checks the outputs agree; the times mean nothing).
"""
import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():   # the dry run: kernels in Triton's interpreter (set before triton's import)
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))       # bench_kernels, beside it
from nanovllm.engine.shared_prefixes import MIN_SAVED_FRACTION, shared_prefixes  # noqa: E402
from nanovllm.kernels import decode_attention as decode_module  # noqa: E402

PAGE = 256


def layout(name: str, rng: np.random.Generator) -> tuple[list[int], list[tuple[int, int]], int, int]:
    """(each row's context length, the groups as (rows, shared prefix tokens) in row order, q heads, kv heads)."""
    if name == "shared-prefix":
        return [2000 + 64 + int(rng.integers(0, 257)) for _ in range(256)], [(32, 2000)] * 8, 16, 8
    if name == "n=4":
        prompts = [int(rng.integers(800, 1200)) for _ in range(32)]
        return [p + int(rng.integers(1, 301)) for p in prompts for _ in range(4)], [(4, p) for p in prompts], 32, 8
    if name == "system-prompt":
        return [256 + int(rng.integers(200, 801)) for _ in range(256)], [(256, 256)], 32, 8
    if name == "long-document":
        return [8000 + int(rng.integers(1, 201)) for _ in range(16)], [(16, 8000)], 32, 8
    if name == "dry":               # the CPU's: small enough for the interpreter
        return [300, 290, 280, 600, 610], [(3, 256), (2, 512)], 4, 2
    raise ValueError(name)


def paged(lens: list[int], groups: list[tuple[int, int]], kv_heads: int, cache_dtype, device):
    """A cache and block table where a group's rows hold the same pages for its prefix's whole pages, and every
    row its own pages after them."""
    tables, next_block, row = [], 0, 0
    for num_rows, prefix in groups:
        shared = list(range(next_block, next_block + prefix // PAGE))
        next_block += len(shared)
        for length in lens[row:row + num_rows]:
            own = -(-length // PAGE) - len(shared)
            tables.append(shared + list(range(next_block, next_block + own)))
            next_block += own
        row += num_rows
    width = max(map(len, tables))
    table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    k = torch.randn(next_block, PAGE, kv_heads, 128, device=device).to(cache_dtype)
    v = torch.randn(k.shape, device=device).to(cache_dtype)
    return k, v, table


def time_us(fn, device) -> float:
    """bench_kernels' median in a CUDA graph, in us; on a CPU one call and no time."""
    if device.type != "cuda":
        fn()
        return float("nan")
    from bench_kernels import ms
    return ms(fn, graph=True) * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows-per-item", type=int, nargs="+", default=[decode_module.SHARED_PREFIX_ROWS])
    parser.add_argument("--fp8", action="store_true", help="an fp8 cache")
    parser.add_argument("--layouts", nargs="+", default=["shared-prefix", "n=4", "system-prompt", "long-document"])
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cache_dtype = torch.float8_e4m3fn if args.fp8 else torch.bfloat16
    if device.type == "cpu":           # a dry run: one small layout in the interpreter
        args.layouts, args.rows_per_item = ["dry"], args.rows_per_item[:1]
    results = []
    default_rows = decode_module.SHARED_PREFIX_ROWS
    for name in args.layouts:
        lens, groups, heads, kv_heads = layout(name, np.random.default_rng(0))
        k, v, table = paged(lens, groups, kv_heads, cache_dtype, device)
        seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
        q = torch.randn(len(lens), 1, heads, 128, device=device, dtype=torch.bfloat16)
        order = torch.argsort(seqlens, descending=True, stable=True).to(torch.int32)
        plain = lambda: decode_module.decode_attention(q, k, v, seqlens, table, order=order)   # noqa: E731
        reference = plain()
        plain_us = time_us(plain, device)
        for rows_per_item in args.rows_per_item:
            decode_module.SHARED_PREFIX_ROWS = rows_per_item       # the kernel's operand rows follow it
            try:
                grouping = shared_prefixes(table.cpu().numpy(), seqlens.cpu().numpy(), PAGE, rows_per_item, 0.0)
                shared = tuple(torch.from_numpy(a).to(device) for a in grouping)
                # each item reads its pages once: the reads it saves are its other rows'
                saved = sum((count - 1) * int(grouping[0][leader]) for leader, _, count in grouping[1].tolist())
                saved /= float(sum(lens))
                grouped_order = torch.argsort(seqlens - shared[0], descending=True, stable=True).to(torch.int32)
                grouped = lambda: decode_module.decode_attention(q, k, v, seqlens, table, order=grouped_order,  # noqa: E731
                                                                 shared_prefix=shared)
                error = ((grouped().float() - reference.float()).norm() / reference.float().norm()).item()
                result = dict(layout=name, rows=len(lens), rows_per_item=rows_per_item, items=len(grouping[1]),
                              saved_fraction=round(float(saved), 3), engine_groups=bool(saved >= MIN_SAVED_FRACTION),
                              plain_us=round(plain_us, 1), grouped_us=round(time_us(grouped, device), 1),
                              relative_error=f"{error:.1e}")
            finally:
                decode_module.SHARED_PREFIX_ROWS = default_rows
            assert error < 2e-2, result
            results.append(result)
            print(result, flush=True)
    return results


if __name__ == "__main__":
    main()
