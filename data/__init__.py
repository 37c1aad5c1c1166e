"""Data for a target: conversation sources, masked training examples, the draft vocabulary,
self-distillation and the offline hidden-state cache.

Names resolve lazily so that `eyas --help` (which imports eyas.data.cli) does not load torch.
"""

import importlib

_EXPORTS = {
    "FieldMap": "sources", "SourceInfo": "sources", "load_conversations": "sources",
    "build_examples": "examples", "split_examples": "examples", "SkipSummary": "examples",
    "render_with_mask": "chat_template",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
