"""`eyas` console script: one subcommand per job, each owned by the package that does the work.

Each package's `cli.py` exposes `register(subparsers)`, which adds its subcommands and sets
`func`. Those modules import torch/transformers only inside `func`, so `eyas --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# (module, subcommands it registers) in the order `eyas --help` lists them.
COMMAND_MODULES = ["eyas.data.cli", "eyas.train.cli", "eyas.models.cli", "eyas.inference.commands"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eyas",
        description="Train EAGLE-style draft heads for a frozen transformers model and run speculative decoding with them.",
        epilog="Run `eyas COMMAND --help` for the options of each command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from eyas.models.errors import EyasError

    # the library reports through `logging`; the CLI shows its INFO lines (progress notes, measured costs)
    root = logging.getLogger("eyas")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)

    try:
        return int(args.func(args) or 0)
    except (EyasError, ValueError, FileNotFoundError) as e:
        # Bad input gets one clear line, not a traceback; bugs still raise.
        print(f"eyas {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the commands that stop gracefully (loading, say)
        print(f"eyas {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
