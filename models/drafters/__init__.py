"""The drafter algorithms, one module each, found by name through `algorithm(name)`.

Each module `models/drafters/<name>.py` defines `ALGORITHM`, an `Algorithm` (base.py): its settings
(`Options`, a dataclass with a described field each), its head (`head_class`, an nn.Module), what it reads
from the target, its training unroll, how it drafts (`drafting`: a tree grown level by level, or a block of
positions from one forward) and its memory model. Nothing outside a module tests which algorithm a head is:
adding one is a new module and its name below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..errors import InputError

if TYPE_CHECKING:
    from .base import Algorithm

NAMES: tuple[str, ...] = ("eagle1", "eagle3", "peagle", "dflash")
_LOADED: dict[str, "Algorithm"] = {}


def algorithm(name: str) -> "Algorithm":
    """The algorithm registered as `name` (its module is imported on first use)."""
    if name not in NAMES:
        raise InputError(f"head_type {name!r} is not one of {', '.join(NAMES)}")
    if name not in _LOADED:
        _LOADED[name] = importlib.import_module(f".{name}", __name__).ALGORITHM
    return _LOADED[name]
