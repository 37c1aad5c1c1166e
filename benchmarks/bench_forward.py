"""Benchmark: what one target forward over k new tokens costs, eyas's Target vs the HF model.

    python benchmarks/bench_forward.py [--target smollm2-135m] [--context 200] [--repeats 5]

The cost curve a speculative cycle pays for verifying k tokens (the tree root + k - 1 drafts)
over a cache of --context tokens. Per k, interleaved in one process so machine drift hits all alike:
- hf: `model(input_ids, cache=...)` with causal attention and logits for all k positions (what a
  plain transformers verify, e.g. assisted generation, computes).
- eyas: `Target(...)` with a boolean tree mask (a chain) and logits for all k nodes, as a verify runs.
- eyas decoder: the same without logits: what is left when the projection is free.
Each timing is the best of --repeats; the caches are trimmed back to --context after every forward.
Columns "x k=1" are each variant's cost relative to its own one-token forward.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

KS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    p.add_argument("--ks", type=int, nargs="+", default=list(KS), help="new tokens per forward")
    p.add_argument("--repeats", type=int, default=5, help="timings per (variant, k); the best is kept")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import DynamicCache

    from eyas.models import Target
    from eyas.models.masks import after_history, causal

    target = Target.load(args.target, dtype="fp32")
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, target.vocab_size, (1, args.context), generator=gen)
    cache = target.new_cache(1, args.context + max(args.ks))
    target(prefix, cache=cache, logits=False)
    cache.commit([args.context])
    hf_cache = DynamicCache(config=target.model.config)
    target.model(input_ids=prefix, cache=hf_cache, use_cache=True)

    def eyas(ids, pos, allowed, logits=True) -> Callable[[], object]:
        def run():
            target(ids, pos, cache, allowed, logits=logits)
            cache.rollback()
        return run

    def hf(ids, pos) -> Callable[[], object]:
        def run():
            target.model(input_ids=ids, position_ids=pos, cache=hf_cache, use_cache=True)
            hf_cache.crop(-ids.shape[1])  # transformers 5 crops by tokens removed, not by the length kept
        return run

    rows = []
    for k in args.ks:
        ids = torch.randint(100, target.vocab_size, (1, k), generator=gen)
        pos = torch.arange(args.context, args.context + k)[None]
        allowed = after_history(cache.lengths, causal(k)[None], args.context + k)
        variants = {"hf": hf(ids, pos), "eyas": eyas(ids, pos, allowed), "eyas decoder": eyas(ids, pos, allowed, False)}
        best = {name: float("inf") for name in variants}
        for _ in range(args.repeats):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        rows.append((k, best))
        print(f"k={k:3d}  " + "  ".join(f"{n} {1e3 * s:7.1f} ms" for n, s in best.items()), flush=True)

    base = rows[0][1]
    print(f"\ncontext {args.context} tokens, {torch.get_num_threads()} threads, best of {args.repeats}")
    print(f"{'k':>3}  {'hf ms':>7}  {'x k=1':>6}  {'eyas ms':>7}  {'x k=1':>6}  {'decoder ms':>10}  {'eyas/hf':>7}")
    for k, b in rows:
        print(f"{k:3d}  {1e3 * b['hf']:7.1f}  {b['hf'] / base['hf']:6.2f}  {1e3 * b['eyas']:7.1f}  "
              f"{b['eyas'] / base['eyas']:6.2f}  {1e3 * b['eyas decoder']:10.1f}  {b['eyas'] / b['hf']:7.2f}")


if __name__ == "__main__":
    main()
