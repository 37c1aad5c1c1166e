"""Benchmark: what one target forward over k new tokens costs, against the machine's memory limit.

    python benchmarks/bench_forward.py [--target smollm2-135m] [--dtype fp32 bf16] [--ks 1 4 16] [--profile] [--pieces]

A one-token decoding step reads every weight once (and the cache), so its floor is those bytes over the memory
bandwidth; a verify of k tokens reads the same bytes. Per dtype, interleaved in one process so machine drift
hits every variant alike, over a cache of --context tokens:
- transformers: the HF model with its own DynamicCache, causal attention, logits at all k positions;
- eyas: eyas's Target as generation runs it (k = 1 a plain step, k > 1 a verify with a tree mask, logits at every
  node), eager, with eyas's CPU kernels (models/cpu_kernels.py);
- eyas compiled: the same Target with `compile=True` (torch.compile of the model's own decoder with frozen
  weights: inductor's GEMM templates, fused small ops), after its warm-up, whose seconds are printed;
- eyas fixed (`--fixed`): compiled with fixed shapes (`fixed_shapes=True`, a GPU's default: attention over the
  cache's whole capacity, the tokens padded to a power of two), what fixed shapes cost on this CPU.
The memory limit: the bytes one step reads (every parameter except an untied embedding table, of which a step
reads one row, plus the cache's keys and values at --context) over the read bandwidth measured here with the
same threads (`eyas.inference.memory_limit.ReadRate`: the fastest of a few streaming reads of a buffer far larger
than the caches). The rate moves on a shared host, and the steps with it: it is read before and after every block of
5 rounds, each block's share of its limit is taken at the higher of the two reads beside it, and the table gives the
median share over the blocks (the limit line: the upper median of all the reads, and their range); where the reads
fell at more than one level, the last variant's median share at each level is printed as well. A round runs each
variant --burst times back to back (1 by default: the variants alternate every forward, so each one starts on the
caches the others left, colder than a decoding loop's next step finds them). `--profile` adds
the top ops of each variant's one-token step (torch.profiler, self CPU time). `--pieces` splits the compiled
variant's forward, per k, into the compiled call (the decoder, and the logits where the lm_head alone gives them),
and within it the entry before the inductor graph (torch.compile's frame entry, guard check, AOT's wrapper), the
graph and the exit after it; the logits computed after the call (none where the graph computes them), and the
Target's own code around them (wall clock, medians, no profiler).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from eyas.inference.memory_limit import ReadRate, weight_bytes

KS = (1, 2, 4, 8, 16, 32)
BLOCK = 5  # rounds between two reads of the machine's read rate


def step_bytes(target, cache) -> int:
    """Bytes one forward reads: the weights (memory_limit.weight_bytes) and the cache's keys and values."""
    kv = sum(layer.keys[:, :, :cache.width].nbytes + layer.values[:, :, :cache.width].nbytes
             for layer in cache.layers if layer.is_initialized)
    return weight_bytes(target.model) + kv


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], help="target dtypes, one table each")
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    p.add_argument("--ks", type=int, nargs="+", default=list(KS), help="new tokens per forward (1: a plain step)")
    p.add_argument("--repeats", type=int, default=20, help="rounds per k; the median of a variant's timings is kept")
    p.add_argument("--burst", type=int, default=1,
                   help="forwards of a variant back to back in a round, each timed (1: the variants alternate every "
                        "forward, which leaves each one the caches the others' code and weights left; more: each runs "
                        "after itself, as a decoding loop runs its steps)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-compile", action="store_true", help="leave out the compiled variant")
    p.add_argument("--fixed", action="store_true", help="add the compiled variant with fixed shapes")
    p.add_argument("--profile", action="store_true", help="print each variant's top ops for a one-token step")
    p.add_argument("--pieces", action="store_true",
                   help="split the compiled variant's forward into the compiled call (its entry, graph and exit), "
                        "logits and the rest")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for dtype in args.dtype:
        measure(args, dtype)


def measure(args, dtype: str) -> None:
    from transformers import DynamicCache

    from eyas.models import Target
    from eyas.models.masks import after_history, causal

    eager = Target.load(args.target, dtype=dtype, device="cpu")
    reads = ReadRate()
    targets = {"eyas": eager}
    if not args.no_compile:
        targets["eyas compiled"] = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)
    if args.fixed:
        targets["eyas fixed"] = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True,
                                       fixed_shapes=True)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, eager.vocab_size, (1, args.context), generator=gen)
    caches = {}
    for name, target in targets.items():
        caches[name] = target.new_cache(1, args.context + max(args.ks))
        target(prefix, cache=caches[name], logits=False)
        caches[name].commit([args.context])
    hf_cache = DynamicCache(config=eager.model.config)
    eager.model(input_ids=prefix, cache=hf_cache, use_cache=True)

    def eyas(name: str, ids, pos, allowed) -> Callable[[], object]:
        target, cache = targets[name], caches[name]

        def run():
            if allowed is None:  # a plain step: no mask, the logits of its one token
                target(ids, cache=cache, logits=torch.zeros(1, 1, dtype=torch.long))
            else:
                target(ids, pos, cache, allowed)
            cache.rollback()
        return run

    def hf(ids, pos) -> Callable[[], object]:
        def run():
            eager.model(input_ids=ids, position_ids=pos, cache=hf_cache, use_cache=True)
            hf_cache.crop(-ids.shape[1])  # transformers 5 crops by tokens removed, not by the length kept
        return run

    rows, split = [], []
    for k in args.ks:
        ids = torch.randint(100, eager.vocab_size, (1, k), generator=gen)
        pos = torch.arange(args.context, args.context + k)[None]
        allowed = None if k == 1 else after_history(caches["eyas"].lengths, causal(k)[None], args.context + k)
        variants = {"transformers": hf(ids, pos), **{n: eyas(n, ids, pos, allowed) for n in targets}}
        for name, fn in variants.items():  # warm-up (the compiled variant compiles here)
            t0 = time.perf_counter()
            fn()
            fn()
            if name in targets and targets[name].compiled:
                print(f"{dtype} k={k}: {name} warm-up {time.perf_counter() - t0:.1f} s", flush=True)
        # Blocks of rounds, the machine's read rate read before and after each: on a shared host it moves between
        # levels within seconds (seen: 33-35 and 47-60 GB/s on a 2-core EPYC), and the steps with it, so a block's
        # share of its limit is taken against the rate read beside it (the higher of the two reads: the stricter).
        nbytes, shown = step_bytes(eager, caches["eyas"]), list(variants)[-1]
        took = {name: [] for name in variants}
        shares: dict[str, list[float]] = {name: [] for name in variants}
        rates, last = [], []  # per block: the rate it is judged at, the median of the variant shown
        before = reads.sample()
        for start in range(0, args.repeats, BLOCK):
            block = {name: [] for name in variants}
            for _ in range(min(BLOCK, args.repeats - start)):
                for name, fn in variants.items():
                    for _ in range(args.burst):
                        t0 = time.perf_counter()
                        fn()
                        block[name].append(time.perf_counter() - t0)
            after = reads.sample()
            rates.append(max(before, after))
            last.append(statistics.median(block[shown]))
            for name, times in block.items():
                took[name] += times
                shares[name].append(nbytes / rates[-1] / statistics.median(times))
            before = after
        print(f"{dtype} k={k}: per block, read rate GB/s / {shown} ms: "
              + " ".join(f"{r / 1e9:.0f}/{1e3 * t:.1f}" for r, t in zip(rates, last)), flush=True)
        if len(levels := read_levels(rates)) > 1:
            print(f"{dtype} k={k}: {shown} % limit per read level: " + "; ".join(
                f"{min(rates[i] for i in level) / 1e9:.0f}-{max(rates[i] for i in level) / 1e9:.0f} GB/s "
                f"({len(level)} blocks) {100 * statistics.median(shares[shown][i] for i in level):.0f} %"
                for level in levels), flush=True)
        rows.append((k, {n: statistics.median(v) for n, v in took.items()},
                     {n: statistics.median(v) for n, v in shares.items()}))
        if args.pieces and "eyas compiled" in targets:
            split.append((k, pieces(targets["eyas compiled"], variants["eyas compiled"], args.repeats)))

    memory = reads.limit(step_bytes(eager, caches["eyas"]))
    limit = 1 / memory.tokens_per_s
    names = list(rows[0][1])
    print(f"\n{dtype}: {args.target}, context {args.context}, {torch.get_num_threads()} threads, median of "
          f"{args.repeats} rounds of {args.burst}; memory limit {1e3 * limit:.1f} ms per forward "
          f"({1 / limit:.1f} tok/s at one token): "
          f"{memory.bytes / 1e6:.0f} MB at {memory.bandwidth / 1e9:.1f} GB/s, the upper median of {memory.samples} "
          f"reads ({memory.low / 1e9:.1f}-{memory.high / 1e9:.1f}, {memory.kernel})")
    print(f"% limit: per block of {BLOCK} rounds, the limit at the rate read beside it over the block's median time; "
          "the median of the blocks")
    print(f"{'k':>3}  " + "  ".join(f"{n + ' ms':>17}" for n in names) + "  " +
          "  ".join(f"{n + ' % limit':>22}" for n in names[1:]))
    for k, m, share in rows:
        print(f"{k:3d}  " + "  ".join(f"{1e3 * m[n]:17.1f}" for n in names) + "  " +
              "  ".join(f"{100 * share[n]:22.0f}" for n in names[1:]))
    if split:
        print(f"\n{dtype} eyas compiled, where a forward goes (ms, medians of {args.repeats})")
        print(f"{'k':>3}  " + "  ".join(f"{n:>14}" for n in split[0][1]))
        for k, m in split:
            print(f"{k:3d}  " + "  ".join(f"{1e3 * v:14.2f}" for v in m.values()))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        tok = torch.randint(100, eager.vocab_size, (1, 1), generator=gen)
        for name in ["transformers", *targets]:
            fn = hf(tok, torch.tensor([[args.context]])) if name == "transformers" else eyas(name, tok, None, None)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    fn()
            print(f"\n{dtype} {name}: one-token step, 10 steps")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def read_levels(rates: list[float], gap: float = 1.2) -> list[list[int]]:
    """The blocks (indices into rates) at each level of the host's read rate, slowest first: the rates split where
    one sorted rate exceeds the one below it by more than `gap` (a shared host's rate sits at one of a few levels, so
    a median over blocks would depend on which level most of them fell at)."""
    order = sorted(range(len(rates)), key=rates.__getitem__)
    levels = [[order[0]]]
    for below, i in zip(order, order[1:]):
        if rates[i] > gap * rates[below]:
            levels.append([])
        levels[-1].append(i)
    return levels


def pieces(target, run: Callable[[], object], repeats: int) -> dict[str, float]:
    """Medians (s) of a compiled Target's forward and its parts over `repeats` calls of `run`: the whole forward,
    the compiled call, and within it the entry before the inductor graph (torch.compile's frame entry, guard check,
    AOT's wrapper), the graph itself (timed at inductor's compiled-graph call: its Python and its C++) and the exit
    after it; the logits computed after the call (0 where the graph computes them), and what is left (the Target's
    own code). The timers are wrapped around the parts for these calls only."""
    import statistics

    from torch._inductor.output_code import CompiledFxGraph

    spans: dict[str, list[tuple[float, float]]] = {"forward": [], "compiled call": [], "graph": [], "logits": []}

    def timed(name: str, fn: Callable) -> Callable:
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            spans[name].append((t0, time.perf_counter()))
            return out
        return wrapper

    graph_call, compiled, logits = CompiledFxGraph.__call__, target._compiled, target.logits
    CompiledFxGraph.__call__ = timed("graph", graph_call)
    target._compiled = timed("compiled call", compiled)
    target.logits = timed("logits", logits)
    try:
        for _ in range(repeats):
            timed("forward", run)()
    finally:
        CompiledFxGraph.__call__ = graph_call
        target._compiled = compiled
        del target.logits
    took = {name: [end - start for start, end in v] for name, v in spans.items()}
    m = {name: statistics.median(v) if v else 0.0 for name, v in took.items()}
    if len(spans["graph"]) == len(spans["compiled call"]):  # one graph a call (several where dynamo broke the graph)
        m["entry"] = statistics.median(g[0] - c[0] for c, g in zip(spans["compiled call"], spans["graph"]))
        m["exit"] = statistics.median(c[1] - g[1] for c, g in zip(spans["compiled call"], spans["graph"]))
    else:
        m["entry"] = m["exit"] = float("nan")
    m["rest"] = m["forward"] - m["compiled call"] - m["logits"]
    order = ["forward", "compiled call", "entry", "graph", "exit", "logits", "rest"]
    return {name: m[name] for name in order}


if __name__ == "__main__":
    main()
