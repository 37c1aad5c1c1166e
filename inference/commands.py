"""`eyas generate`, `eyas chat` and `eyas bench`."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="speculative generation from a prompt with a trained head",
                       description="Generate text from --prompt with the target, accelerated by the draft head. "
                       "Greedy output is token-identical to the target's own; sampling keeps its distribution.")
    p.set_defaults(func=_todo)
    p = sub.add_parser("chat", help="interactive chat with streaming speculative generation",
                       description="Chat with the target through its chat template; replies stream as tokens are accepted.")
    p.set_defaults(func=_todo)
    p = sub.add_parser("bench", help="benchmark a head against plain generate on MT-bench style questions",
                       description="Measure acceptance length, per-position acceptance and end-to-end speedup "
                       "against plain transformers generate, interleaved in one process.")
    p.set_defaults(func=_todo)


def _todo(args: argparse.Namespace) -> int:
    raise NotImplementedError(f"eyas {args.command} is not implemented yet")
