"""Graceful stop: the first SIGINT/SIGTERM asks long work to stop at its next safe point.

Shared by training (checkpoint, then exit) and regeneration (write what is finished, then exit).
A second signal ends the process at once with the signal's exit status (SystemExit: cleanup handlers and
`finally` blocks run, no traceback); the work must keep what is on disk consistent for that case anyway
(atomic writes).
"""

from __future__ import annotations

import signal
import threading
from typing import Callable


class GracefulStop:
    """`with stop:` turns SIGINT/SIGTERM into a flag that the work checks at its safe points (`if stop:`).

    The previous handlers are restored on exit, so library callers keep their own. Outside the main
    thread (where Python cannot install handlers) it does nothing and never requests a stop.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, log: Callable[[str], None], action: str) -> None:
        self.log, self.action = log, action  # action: what happens next, e.g. "saving a checkpoint after this step"
        self.signum: int | None = None
        self._previous: dict = {}

    def __bool__(self) -> bool:
        return self.signum is not None

    @property
    def exit_status(self) -> int:
        """The shell convention for death by this signal: 128 + signal number (130 for SIGINT)."""
        return 128 + self.signum if self.signum is not None else 0

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # a second signal aborts at once, as the signal itself would
            self.log(f"received {signal.Signals(signum).name} again: aborting now")
            raise SystemExit(128 + signum)
        self.signum = signum
        self.log(f"received {signal.Signals(signum).name}: {self.action} (send it again to abort at once)")

    def __enter__(self) -> GracefulStop:
        self.signum = None
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
