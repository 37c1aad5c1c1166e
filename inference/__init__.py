"""Speculative generation with EAGLE draft heads on an unmodified transformers target.

Names resolve lazily so that `eyas --help` does not load torch.
"""

import importlib

_EXPORTS = {
    "SpeculativeGenerator": "generator", "GenerationResult": "generator", "GenerationStats": "generator",
    "TreeOptions": "drafter", "DraftTree": "tree", "CostModel": "costs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
