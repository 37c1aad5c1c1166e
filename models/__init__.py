"""Draft heads, the frozen-target adapter and the head format.

Names resolve lazily so that `eyas --help` (which imports eyas.models.cli) does not load torch.
"""

import importlib

_EXPORTS = {
    "HeadConfig": "config", "TargetIdentity": "config", "default_fused_layer_ids": "config",
    "check_head_matches": "config", "DraftHead": "drafters.base", "HeadOutput": "drafters.base",
    "algorithm": "drafters", "KVCache": "kv_cache",
    "Sampling": "sampling", "Target": "target", "TargetOutput": "target", "head_config_for": "head_config",
    "save_head": "layouts", "load_head": "layouts", "export_head": "layouts",
    "EyasError": "errors", "InputError": "errors", "HeadTargetMismatch": "errors", "Unsupported": "errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
