"""`eyas train`: train a draft head in one process (use `accelerate launch -m eyas.train` for more)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="distill a draft head from a frozen target (one process)",
                       description="Train a draft head from a run YAML (configs/*.yaml) with key=value overrides. "
                       "For several processes or GPUs: accelerate launch -m eyas.train --config RUN.yaml")
    p.set_defaults(func=_todo)


def _todo(args: argparse.Namespace) -> int:
    raise NotImplementedError("eyas train is not implemented yet")
