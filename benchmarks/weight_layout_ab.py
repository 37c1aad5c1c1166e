"""A/B: a compiled one-token step with the target's weights as loaded against the same step with them in one
huge-page buffer in step order (`models/weight_arena.py`, what every CPU Target does).

    python benchmarks/weight_layout_ab.py [--target smollm2-135m] [--dtype bf16] [--rounds 30]

Two copies of the model in one process, each behind a compiled Target (one kept where it was loaded), each with a
cache of --context tokens; rounds of --steps plain steps alternate between them, so the machine's drift hits both
alike. Printed: each layout's median step and the median per-round speed of the buffer over the loaded layout, after
checking both give the same logits.
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch
from step_ab import alternate, forwards, ratio  # beside this script

from eyas.models import Target, weight_arena


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--context", type=int, default=200, help="tokens already in each cache")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=10, help="plain steps a round")
    args = p.parse_args(argv)

    loaded = Target.load(args.target, dtype=args.dtype, device="cpu", cpu_kernels=False)  # weights where loaded
    moved = copy.deepcopy(loaded.model)
    weight_arena._ARRANGED[loaded.model] = None  # keeps the first copy where it was loaded
    targets = {"as loaded": Target(loaded.model, loaded.tokenizer, loaded.name_or_path, compile=True),
               "one buffer": Target(moved, loaded.tokenizer, loaded.name_or_path, compile=True)}
    steps = forwards(targets, args.context)
    if not torch.equal(steps["as loaded"](), steps["one buffer"]()):
        raise SystemExit("the two layouts give different logits")
    took = alternate(steps, args.rounds, per_round=args.steps)
    print(f"{args.target} {args.dtype}: a compiled one-token step over {args.context} cached tokens, "
          f"{torch.get_num_threads()} threads, {args.rounds} alternating rounds of {args.steps} steps")
    for name, times in took.items():
        print(f"  {name:12s} {statistics.median(times) * 1e3:7.2f} ms")
    print(f"  one buffer's speed over as loaded, per round (median): {ratio(took, 'as loaded', 'one buffer'):.3f}")

if __name__ == "__main__":
    main()
