"""Time compiled verifies as eyas runs them against the same verifies with one of its kernels held back: the row
kernel to one row (`--hold products`: inductor's products for the rest, where `cpu_kernels.kernel_rows` gives the
kernel more), or the attention kernel to graphs of a fixed size of up to 4 query rows (`--hold attention`: torch's
flash attention elsewhere, where `cpu_kernels.attention_kernel_takes` gives the kernel more).

    python benchmarks/kernel_rows_ab.py --dtype bf16 --tokens 4 --rounds 100
    python benchmarks/kernel_rows_ab.py --hold attention --tokens 8 --any-size

Two compiled Targets over two loads of the model in one process (a graph is the model's: over one model the second
would run the first's), the second compiled with its kernel held back (and no cached graph: inductor's graph cache
keys on the pass's source, not on what it was told). A round runs one verify of --tokens tokens (a chain under a tree
mask, the logits of every token, as generation verifies) of each over --context cached tokens, the order switching
every round, so the machine's drift hits both alike. With --any-size each first verifies another number of tokens, so
the timed verifies run the graph that takes any size, as generation's do once its tree size has changed. Each graph
computes its forward's logits too (the lm_head's product, one of the products held back). Printed: each one's median
forward and the median per-round ratio of the held-back forward to eyas's (above 1: eyas's kernels help).
"""
from __future__ import annotations

import argparse
from unittest import mock

import torch
from step_ab import alternate, forwards, report  # beside this script

from eyas.models import Target, cpu_kernels

HOLDS = {
    "products": ("the row kernel at one row", lambda: mock.patch.object(cpu_kernels, "kernel_rows", lambda dtype: 1)),
    "attention": ("the attention kernel at up to 4 rows, fixed sizes only", lambda: mock.patch.object(
        cpu_kernels, "attention_kernel_takes",
        lambda dtype, rows, head_dim: rows is not None and rows <= 4 and cpu_kernels.row_gemv.attend_takes(head_dim))),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--hold", default="products", choices=list(HOLDS), help="which kernel the second Target holds back")
    p.add_argument("--tokens", type=int, default=4, help="tokens a verify takes (2 or more)")
    p.add_argument("--any-size", action="store_true",
                   help="time the graph that takes any number of tokens (compiled after a verify of another size)")
    p.add_argument("--rounds", type=int, default=100, help="alternating pairs of forwards timed")
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    args = p.parse_args(argv)
    if args.tokens < 2:
        raise SystemExit("--tokens: a verify takes 2 or more (one token is a plain step, the kernels' either way)")

    held, hold = HOLDS[args.hold]

    def verifies(name: str, target: Target) -> dict:
        if args.any_size:
            forwards({name: target}, args.context, args.tokens + 1)
        return forwards({name: target}, args.context, args.tokens)

    eager = Target.load(args.target, dtype=args.dtype, device="cpu")
    steps = verifies("eyas", Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True))
    again = Target.load(args.target, dtype=args.dtype, device="cpu")
    with hold(), torch._inductor.config.patch(fx_graph_cache=False):
        steps.update(verifies(held, Target(again.model, again.tokenizer, again.name_or_path, compile=True)))
    took = alternate(steps, args.rounds, switch=True)
    graph = "the graph of any size" if args.any_size else "a graph of this size"
    report(took, f"{args.dtype} {args.tokens} tokens, {graph}", held, args.rounds)


if __name__ == "__main__":
    main()
