"""Time compiled forwards whose products take their weights as offsets into the buffer that holds them (as eyas runs
them on CPU: one graph constant for every weight of the products) against the same forwards taking one constant per
weight (the model's weights in the same buffer, which the rewrite is not shown).

    python benchmarks/weights_by_offset_ab.py --dtype bf16 --tokens 1 --rounds 600

Two compiled Targets over two copies of one model in one process, both copies' weights in a buffer of their own in step
order (`models/weight_arena.py`). A round runs one forward of --tokens tokens of each over --context cached tokens (one
token: a plain step; more: a verify of a chain under a tree mask), the order switching every round, so the machine's
drift hits both alike. Printed: each one's median forward and the median per-round ratio of the held-back forward to
eyas's (above 1: the offsets help). The two give the same logits, bit for bit, or the script stops.
"""
from __future__ import annotations

import copy

import torch
from step_ab import alternate, forwards, parser, report  # beside this script

from eyas.models import Target, weight_arena


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)

    eager = Target.load(args.target, dtype=args.dtype, device="cpu")
    eyas = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)
    other = copy.deepcopy(eager.model)
    weight_arena.arrange_weights(other, last=getattr(other.get_output_embeddings(), "weight", None))
    weight_arena._ARRANGED[other] = None  # the rewrite finds no buffer for these weights: one constant per weight
    held = "one constant per weight"
    steps = forwards({"eyas": eyas, held: Target(other, eager.tokenizer, eager.name_or_path, compile=True)},
                     args.context, args.tokens)
    if not torch.equal(steps["eyas"](), steps[held]()):
        raise SystemExit("the two give different logits")
    took = alternate(steps, args.rounds, switch=True)
    report(took, f"{args.dtype} {args.tokens} tokens", held, args.rounds)


if __name__ == "__main__":
    main()
