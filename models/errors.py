"""The errors eyas raises for problems its user can fix.

Everything eyas refuses on purpose (bad input, a head that does not fit its target, a feature a target
cannot run exactly) raises an `EyasError`: the CLI prints it as one line naming the problem and the fix,
and exits 2. Any other exception is a bug and keeps its traceback. The subclasses that describe bad
values also derive from ValueError, so library callers that catch ValueError keep working.
"""

from __future__ import annotations


def brief(e: BaseException, limit: int = 300) -> str:
    """A foreign exception's message on one line (some span paragraphs), for an EyasError that wraps it."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class EyasError(Exception):
    """Base class: an expected failure whose message names the problem and what to do about it."""


class InputError(EyasError, ValueError):
    """A value, file or option the user gave cannot be used."""


class MissingInput(InputError, FileNotFoundError):
    """A file or folder the user named (or that a step needs) does not exist or is not what it should be."""


class ConfigError(InputError):
    """A run config that cannot be used; the message names the key and the fix."""


class HeadTargetMismatch(InputError):
    """The head was trained for a different target; running it would give garbage, not an error."""


class Unsupported(EyasError):
    """A target or head needs something eyas cannot do exactly; the message names the feature."""
