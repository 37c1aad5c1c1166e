"""The eyas head format: a folder with `config.json` + `model.safetensors`.

config.json holds the HeadConfig (which alone rebuilds the head) including the identity of the
target it was trained for; the safetensors hold only the head's own weights and vocab maps,
never the borrowed embedding or lm_head. Other layouts (SGLang, speculators, EAGLE-1) are
converted in `interop.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .atomic import atomic_folder
from .config import HeadConfig
from .head import DraftHead
from .target import Target, resolve_dtype

FORMAT_VERSION = 1
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


class HeadTargetMismatch(ValueError):
    """The head was trained for a different target; running it would give garbage, not an error."""


def check_head_matches(config: HeadConfig, target: Target) -> None:
    """Raise HeadTargetMismatch naming the first property where head and target disagree."""
    trained = config.target
    for name, head_value, target_value in [
        ("hidden size", config.hidden_size, target.hidden_size),
        ("vocab size", config.vocab_size, target.vocab_size),
    ]:
        if head_value != target_value:
            raise HeadTargetMismatch(
                f"{name} mismatch: the head was trained for {head_value}, target {target.name_or_path!r} has {target_value}"
            )
    if config.fused_layer_ids and max(config.fused_layer_ids) > target.num_layers:
        raise HeadTargetMismatch(
            f"layer mismatch: the head fuses target layers {list(config.fused_layer_ids)}, "
            f"target {target.name_or_path!r} has only {target.num_layers}"
        )
    if trained is not None and trained.tokenizer_fingerprint:
        current = target.identity().tokenizer_fingerprint
        if current and current != trained.tokenizer_fingerprint:
            raise HeadTargetMismatch(
                f"tokenizer mismatch: the head was trained for {trained.name_or_path!r} whose tokenizer vocabulary "
                f"differs from that of target {target.name_or_path!r} (fingerprints {trained.tokenizer_fingerprint[:19]}… "
                f"vs {current[:19]}…)"
            )


def save_head(head: DraftHead, folder: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write the head atomically; `extra` adds informational keys (e.g. training summary) to config.json."""
    config = {"eyas_format": FORMAT_VERSION, **head.config.to_dict(), **({"extra": extra} if extra else {})}
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    with atomic_folder(folder) as tmp:
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "eyas_format": str(FORMAT_VERSION)})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return Path(folder)


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a head folder: {CONFIG_NAME} is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def load_head(
    folder: str | Path, target: Target | None = None, dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> DraftHead:
    """Load a head in any supported layout; with `target`, check it fits and bind to it."""
    raw = read_config(folder)
    if "eyas_format" not in raw:
        from .interop import load_foreign

        config, state = load_foreign(Path(folder), raw, target)
    else:
        if raw["eyas_format"] > FORMAT_VERSION:
            raise ValueError(f"{folder} uses head format {raw['eyas_format']}; this eyas reads up to {FORMAT_VERSION}")
        config = HeadConfig.from_dict({k: v for k, v in raw.items() if k not in ("eyas_format", "extra")})
        weights = Path(folder) / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"{folder} has {CONFIG_NAME} but no {WEIGHTS_NAME}")
        state = load_file(str(weights))
    head = DraftHead(config)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder}: weights do not fit the config (missing {missing}, unexpected {unexpected})")
    if dtype is not None:
        head.to(resolve_dtype(dtype))
    if device is not None:
        head.to(device)
    if target is not None:
        head.bind(target)
    return head
