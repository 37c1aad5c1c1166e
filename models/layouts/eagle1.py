"""The EAGLE-1 reference layout (`cnets.Model`): a Llama config, `fc` with bias, `layers.{i}.*` (layer 0
without input_layernorm)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config import HeadConfig, TargetIdentity
from ..errors import InputError
from . import register
from .common import BORROWED_KEYS, CONFIG_NAME, WEIGHTS_NAME, check_state, llama_fields, read_weights, shape_from_llama

ARCHS = ("LlamaForCausalLM", "LlamaForCausalLMEagle")  # reference / SGLang's EAGLE-1 class


class Eagle1Layout:
    name = "eagle"

    def detect(self, raw: dict[str, Any]) -> bool:
        return any(a in ARCHS for a in raw.get("architectures") or [])

    def read(self, folder: Path, raw: dict[str, Any], target) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
        w = f"{folder / CONFIG_NAME} ({self.name} layout)"
        shape = shape_from_llama(raw, w)
        identity = TargetIdentity(name_or_path="", hidden_size=shape["hidden_size"], vocab_size=shape["vocab_size"],
                                  num_hidden_layers=0, tokenizer_fingerprint="")
        config = HeadConfig(head_type="eagle1", draft_vocab_size=shape["vocab_size"], target=identity, **shape)
        foreign = read_weights(folder)
        if "fc.weight" not in foreign:
            raise InputError(f"{folder}: no fc.weight among its weights, so it is not an EAGLE draft head")
        state = {k: v for k, v in foreign.items() if k not in BORROWED_KEYS}
        check_state(state, config, folder, self.name, [])
        return config, state

    def write(self, head, folder: Path) -> None:
        c = head.config
        if c.head_type != "eagle1":
            raise InputError(f"the eagle layout holds eagle1 heads only; this head is {c.head_type}")
        config = {"architectures": [ARCHS[0]], **llama_fields(c, head.fc.weight.dtype)}
        state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


register(Eagle1Layout())
