"""Where the library's `logging` output goes when a command runs; in models/ so every package can use it."""

from __future__ import annotations

import logging


def show_library_logs(stream) -> None:
    """The library reports through `logging`; a command shows its INFO lines (progress notes, measured costs)."""
    root = logging.getLogger("eyas")
    if not root.handlers:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
