"""`accelerate launch -m eyas.train --config RUN.yaml [key=value ...]` (also works as plain `python -m`)."""

from __future__ import annotations

import argparse
import os
import sys

from .cli import EPILOG, add_arguments, train_command


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m eyas.train", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args()
    from eyas.models.errors import EyasError
    from eyas.models.logs import show_library_logs

    show_library_logs(sys.stdout)  # under a launcher, each run's notes beside accelerate's own on stdout

    try:
        code = train_command(args)
    except EyasError as e:  # bad input: one clear line; anything else is a bug and keeps its traceback
        print(f"eyas train: error: {e}", file=sys.stderr)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torch + gloo can abort at interpreter exit after a finished run; everything is flushed and saved.
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
