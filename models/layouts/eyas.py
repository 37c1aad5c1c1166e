"""eyas's own layout: config.json holds the HeadConfig (which alone rebuilds the head) including the identity
of the target it was trained for; model.safetensors holds only the head's own weights and vocab maps,
never the borrowed embedding or lm_head.

Format 2 keeps the algorithm's own settings under `options`; format 1 (EAGLE-1 and EAGLE-3 heads of earlier eyas
versions, EAGLE-3's `norm_before_residual` among the shape fields) reads as the same head."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..atomic import atomic_folder
from ..config import HeadConfig
from ..errors import InputError, MissingInput
from ..loading import load_safetensors
from . import register
from .common import CONFIG_NAME, HEAD_FILES, WEIGHTS_NAME

FORMAT_VERSION = 2


class EyasLayout:
    name = "eyas"

    def detect(self, raw: dict[str, Any]) -> bool:
        return "eyas_format" in raw

    def read(self, folder: Path, raw: dict[str, Any], target) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
        if not isinstance(raw["eyas_format"], int) or raw["eyas_format"] > FORMAT_VERSION:
            raise InputError(f"{folder} uses head format {raw['eyas_format']!r}; "
                             f"this eyas reads up to {FORMAT_VERSION}")
        try:
            config = HeadConfig.from_dict({k: v for k, v in raw.items() if k not in ("eyas_format", "extra")})
        except (TypeError, ValueError) as e:
            raise InputError(f"{folder / CONFIG_NAME}: {e}") from e
        weights = folder / WEIGHTS_NAME
        if not weights.is_file():
            raise MissingInput(f"{folder} has {CONFIG_NAME} but no {WEIGHTS_NAME}")
        return config, load_safetensors(weights)

    def write(self, head, folder: Path, target=None, extra: dict[str, Any] | None = None) -> None:
        config = {"eyas_format": FORMAT_VERSION, **head.config.to_dict(), **({"extra": extra} if extra else {})}
        state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt", "eyas_format": str(FORMAT_VERSION)})
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")

    def save(self, head, folder: str | Path, extra: dict[str, Any] | None = None) -> Path:
        with atomic_folder(folder, HEAD_FILES) as tmp:
            self.write(head, tmp, extra=extra)
        return Path(folder)


register(EyasLayout())
