"""Time compiled verifies whose few-row products run eyas's row kernel (as eyas decides: `cpu_kernels.kernel_rows`)
against the same verifies with the kernel taking one row only (inductor's products for the rest).

    python benchmarks/kernel_rows_ab.py --dtype bf16 --tokens 4 --rounds 100

Two compiled Targets over two loads of the model in one process (a graph is the model's: over one model the second
would run the first's), the second compiled with `kernel_rows` held at 1 (and no cached graph: inductor's graph
cache keys on the pass's source, not on what it was told). A round runs one verify of
--tokens tokens (a chain under a tree mask, the logits of every token, as generation verifies) of each over --context
cached tokens, the order switching every round, so the machine's drift hits both alike. The logits each forward
computes (the lm_head's product, eager) take the same product in both. Printed: each one's median forward and the
median per-round ratio of the one-row forward to eyas's (above 1: the kernel's rows help).
"""
from __future__ import annotations

import argparse
import statistics
from unittest import mock

import torch
from step_ab import alternate, forwards, ratio  # beside this script

from eyas.models import Target, cpu_kernels


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--tokens", type=int, default=4, help="tokens a verify takes (2 or more)")
    p.add_argument("--rounds", type=int, default=100, help="alternating pairs of forwards timed")
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    args = p.parse_args(argv)
    if args.tokens < 2:
        raise SystemExit("--tokens: a verify takes 2 or more (one token is a plain step, the kernel's either way)")

    eager = Target.load(args.target, dtype=args.dtype, device="cpu")
    dtype = eager.dtype
    rows = cpu_kernels.kernel_rows(dtype)
    eyas = f"kernel up to {rows} rows"
    steps = forwards({eyas: Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)},
                        args.context, args.tokens)
    again = Target.load(args.target, dtype=args.dtype, device="cpu")
    one = Target(again.model, again.tokenizer, again.name_or_path, compile=True)
    with mock.patch.object(cpu_kernels, "kernel_rows", lambda dtype: 1), \
            torch._inductor.config.patch(fx_graph_cache=False):
        steps.update(forwards({"kernel at one row": one}, args.context, args.tokens))
    took = alternate(steps, args.rounds, switch=True)
    for name, times in took.items():
        print(f"{args.dtype} {args.tokens} tokens, {name}: median {1e3 * statistics.median(times):.2f} ms a forward")
    print(f"{args.dtype} {args.tokens} tokens, one row / eyas's rows, per round: median "
          f"{ratio(took, 'kernel at one row', eyas):.3f} ({args.rounds} rounds)")


if __name__ == "__main__":
    main()
