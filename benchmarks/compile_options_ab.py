"""Time a compiled plain step without one of eyas's inductor settings against the step with all of them.

    python benchmarks/compile_options_ab.py --dtype bf16 --without aot_inductor.custom_ops_to_c_shims --rounds 600

Two compiled Targets over one model in one process: one with `compile_options` as eyas sets them, one with the named
setting left out (inductor's default in its place). A round runs one plain step of each over --context cached tokens,
the order switching every round, so the machine's drift hits both alike. Printed: each one's median step and the
median per-round ratio of the step without the setting to the step with it (above 1: the setting helps).
"""
from __future__ import annotations

import argparse
import statistics
from unittest import mock

import torch
from step_ab import alternate, forwards, ratio  # beside this script

from eyas.models import Target
from eyas.models import target as target_module


def main(argv: list[str] | None = None) -> None:
    settings = target_module.compile_options(torch.device("cpu"))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--without", required=True, choices=sorted(settings), help="the setting the second step leaves out")
    p.add_argument("--rounds", type=int, default=400, help="alternating pairs of steps timed")
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    args = p.parse_args(argv)

    eager = Target.load(args.target, dtype=args.dtype, device="cpu")
    full = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)
    options = target_module.compile_options

    def without(*a, **kw):
        chosen = options(*a, **kw)
        chosen.pop(args.without)
        return chosen

    with mock.patch.object(target_module, "compile_options", without):
        less = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)
    with_, without_ = f"with {args.without}", f"without {args.without}"
    took = alternate(forwards({with_: full, without_: less}, args.context), args.rounds, switch=True)
    for name, times in took.items():
        print(f"{args.dtype} {name}: median {1e3 * statistics.median(times):.2f} ms a step")
    print(f"{args.dtype} without / with, per round: median {ratio(took, without_, with_):.3f} ({args.rounds} rounds)")


if __name__ == "__main__":
    main()
