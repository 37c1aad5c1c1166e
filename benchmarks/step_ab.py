"""Steps of two compiled Targets, timed alternately in one process (the A/B benchmarks' shared loop:
weight_layout_ab.py, compile_options_ab.py, kernel_rows_ab.py, logits_in_graph_ab.py)."""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from eyas.models import Target
from eyas.models.masks import after_history, causal


def parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of an A/B of two compiled Targets' forwards: --target, --dtype, --tokens, --rounds, --context."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--tokens", type=int, default=1, help="tokens a forward takes (1: a plain step, more: a verify)")
    p.add_argument("--rounds", type=int, default=400, help="alternating pairs of forwards timed")
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    return p


def forwards(targets: dict[str, Target], context: int, tokens: int = 1) -> dict[str, Callable[[], torch.Tensor]]:
    """Per Target, a forward of `tokens` new tokens over a cache of `context` random tokens (the same for each),
    rolled back after each call so every call is the same forward; returns its logits. One token: a plain step (the
    logits of its token); more: a verify of a chain as generation runs it (a tree mask, the logits of every token).
    Each has run three times (the first compiles)."""
    some = next(iter(targets.values()))
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, some.vocab_size, (1, context), generator=gen)
    ids = torch.randint(100, some.vocab_size, (1, tokens), generator=gen)
    pos = torch.arange(context, context + tokens)[None]
    allowed = None if tokens == 1 else after_history(torch.tensor([context]), causal(tokens)[None], context + tokens)
    first = torch.zeros(1, 1, dtype=torch.long)
    steps = {}
    for name, target in targets.items():
        cache = target.new_cache(1, context + tokens + 8)
        target(prefix, cache=cache, logits=False)
        cache.commit([context])

        def step(target=target, cache=cache) -> torch.Tensor:
            if allowed is None:
                logits = target(ids, cache=cache, logits=first).logits
            else:
                logits = target(ids, pos, cache, allowed).logits
            cache.rollback()
            return logits

        t0 = time.perf_counter()
        for _ in range(3):
            step()
        print(f"{name}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
        steps[name] = step
    return steps


def alternate(steps: dict[str, Callable], rounds: int, per_round: int = 1, switch: bool = False,
              after: Callable[[int], object] | None = None) -> dict[str, list[float]]:
    """Seconds a step, per round and variant: rounds of `per_round` steps of each variant in turn (the order reversed
    every other round where `switch`), so the machine's drift hits every variant alike; `after(round)` runs untimed
    after each round (a read of the machine's bandwidth, say)."""
    took: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in (list(steps)[::-1] if switch and r % 2 == 0 else steps):
            t0 = time.perf_counter()
            for _ in range(per_round):
                steps[name]()
            took[name].append((time.perf_counter() - t0) / per_round)
        if after is not None:
            after(r)
    return took


def ratio(took: dict[str, list[float]], slower: str, faster: str) -> float:
    """The median per-round ratio of `slower`'s step time to `faster`'s (above 1: `faster` is faster)."""
    return statistics.median(a / b for a, b in zip(took[slower], took[faster]))


def report(took: dict[str, list[float]], label: str, held: str, rounds: int) -> None:
    """Print each variant's median step and the median per-round ratio of the held-back variant `held` to eyas's
    (the variant named "eyas"), each line headed by `label`."""
    for name, times in took.items():
        print(f"{label}, {name}: median {1e3 * statistics.median(times):.2f} ms")
    print(f"{label}, held back / eyas, per round: median {ratio(took, held, 'eyas'):.3f} ({rounds} rounds)")
