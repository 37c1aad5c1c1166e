"""Benchmark: eyas's attention kernel for a decoding step's few query rows against torch's CPU attention.

    python benchmarks/attention.py [--heads 9] [--kv-heads 3] [--head-dim 64] [--keys 200 1000] [--rows 1 4 16]

Per dtype, number of cached keys and query rows: the median time of one call of torch's
`scaled_dot_product_attention` (its CPU flash kernel, GQA without repeating the keys) and of `eyas::attend`
(models/row_gemv.cpp), called from Python, alternating, over --layers layers' own caches as a step reads them (a
slice of a wider buffer). With the cache warm, every call finds its keys and values in the CPU's caches; cold (the
default), a buffer larger than the last-level cache is read before each round, as a step's weight reads evict the
cache between two layers' attention. The defaults are SmolLM2-135M's heads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from eyas.models import row_gemv


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=9, help="query heads")
    p.add_argument("--kv-heads", type=int, default=3, help="key/value heads (a divisor of --heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--keys", type=int, nargs="+", default=[200, 1000], help="tokens in the cache")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16], help="query rows (1: a plain step)")
    p.add_argument("--layers", type=int, default=30, help="caches the calls cycle through, one per layer")
    p.add_argument("--rounds", type=int, default=20, help="rounds of --layers calls per variant; medians kept")
    p.add_argument("--warm", action="store_true", help="leave the caches warm between rounds")
    args = p.parse_args(argv)
    if not row_gemv.available():
        p.error("eyas's CPU kernels do not run on this machine (x86 with AVX2 or better, and a C++ compiler)")
    if args.heads % args.kv_heads or not row_gemv.attend_takes(args.head_dim):
        p.error(f"--heads must be a multiple of --kv-heads and --head-dim whole vector registers here "
                f"(got {args.heads}, {args.kv_heads}, {args.head_dim})")
    flush = None if args.warm else torch.empty(256 << 20, dtype=torch.uint8)
    print(f"{args.heads} query heads over {args.kv_heads} key/value heads of {args.head_dim}, {args.layers} layers, "
          f"{torch.get_num_threads()} threads, cache {'warm' if args.warm else 'cold'}; us per call, medians")
    print("| keys | rows | dtype | torch us | eyas us | torch / eyas |")
    print("| --- | --- | --- | --- | --- | --- |")
    for keys in args.keys:
        for rows in args.rows:
            for dtype in row_gemv.DTYPES:
                torch_us, eyas_us = measure(args, keys, rows, dtype, flush)
                print(f"| {keys} | {rows} | {str(dtype).removeprefix('torch.')} | {torch_us:.1f} | {eyas_us:.1f} "
                      f"| {torch_us / eyas_us:.2f} |", flush=True)


def measure(args, keys: int, rows: int, dtype: torch.dtype, flush: torch.Tensor | None) -> tuple[float, float]:
    """Median us per call of torch's attention and of eyas::attend over the same queries, caches and mask."""
    gen = torch.Generator().manual_seed(keys + rows)
    q = torch.randn(1, args.heads, rows, args.head_dim, generator=gen).to(dtype)
    caches = [torch.randn(2, 1, args.kv_heads, keys + 64, args.head_dim, generator=gen).to(dtype)[:, :, :, :keys]
              for _ in range(args.layers)]  # [k|v, B, G, capacity, D], the first `keys` columns in use
    mask = torch.zeros(1, 1, rows, keys, dtype=dtype)  # additive, as a verify's tree mask (every key seen)
    scale = args.head_dim ** -0.5
    variants = {
        "torch": lambda kv: F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=scale,
                                                           enable_gqa=True),
        "eyas": lambda kv: row_gemv.attend(q, kv[0], kv[1], mask, scale),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds + 1):
        for name in variants if r % 2 else reversed(variants):
            if flush is not None:
                flush.add_(1)
            t0 = time.perf_counter()
            for kv in caches:
                variants[name](kv)
            if r:  # the first round warms up
                times[name].append((time.perf_counter() - t0) / len(caches) * 1e6)
    return statistics.median(times["torch"]), statistics.median(times["eyas"])


if __name__ == "__main__":
    main()
