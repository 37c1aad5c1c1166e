"""`eyas data ...`: prepare training data for a target."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare data: regenerate answers, build the draft vocab, cache hidden states",
                       description="Data preparation for a given target.")
    dsub = p.add_subparsers(dest="data_command", metavar="DATA_COMMAND", required=True)
    for name, text in [("regenerate", "rewrite assistant turns with the target itself (self-distillation)"),
                       ("vocab", "build the draft vocabulary (d2t/t2d) from loss-masked token frequencies"),
                       ("cache-hidden", "store the target hidden states a head needs as safetensors shards")]:
        dsub.add_parser(name, help=text, description=text).set_defaults(func=_todo)


def _todo(args: argparse.Namespace) -> int:
    raise NotImplementedError(f"eyas data {args.data_command} is not implemented yet")
