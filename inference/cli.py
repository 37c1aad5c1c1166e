"""`eyas` console script: one subcommand per job, each owned by the package that does the work.

Each package's `cli.py` exposes `register(subparsers)`, which adds its subcommands and sets
`func`. Those modules import torch/transformers only inside `func`, so `eyas --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap

from eyas.models.logs import show_library_logs

# (module, subcommands it registers) in the order `eyas --help` lists them.
COMMAND_MODULES = ["eyas.data.cli", "eyas.train.cli", "eyas.models.cli", "eyas.inference.commands"]


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions and epilogs are wrapped line by line, but indented lines (examples) are kept as they are; an
    option's default is shown unless its help already says it or the option has none (unset, a flag)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(indent + line if not line or line[0].isspace()
                         else textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
                         for line in text.splitlines())

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = any(action.default is x for x in (None, False, argparse.SUPPRESS))
        if "default" in text or not action.option_strings or unset:
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """ArgumentParser with eyas's HelpFormatter; subcommand parsers are made of this class too."""

    def __init__(self, *args, formatter_class: type = HelpFormatter, **kwargs) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="eyas",
        description="Train EAGLE-style draft heads for a frozen transformers model and run speculative decoding "
        "with them.",
        epilog="examples:\n"
        "  eyas demo --quick       # a smoke run of the whole pipeline in ~10 minutes on 2 CPU cores\n"
        "  eyas demo               # the main job: self-distil, train, export and benchmark the demo head\n"
        "  eyas generate --target smollm2-135m --head heads/smollm2-135m-eagle3 --prompt \"Hello!\"\n\n"
        "Run `eyas COMMAND --help` for what each command does, an example and its options.",
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an expected error too (also: EYAS_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from eyas.models.errors import EyasError

    show_library_logs(sys.stderr)
    try:
        return int(args.func(args) or 0)
    except EyasError as e:  # bad input: one clear line; anything else is a bug and keeps its traceback
        if args.debug or os.environ.get("EYAS_DEBUG", "") not in ("", "0"):
            import traceback

            traceback.print_exc()
        print(f"eyas {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the commands that stop gracefully (loading, say)
        print(f"eyas {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
