"""SGLang's `LlamaForCausalLMEagle3` layout, which the EAGLE-3 reference and SpecForge also write: a Llama
config with `draft_vocab_size` and `eagle_config`, the decoder layer named `midlayer`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config import HeadConfig
from ..errors import InputError
from . import register
from .common import (
    BORROWED_KEYS,
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_state,
    llama_fields,
    read_weights,
    rename,
    required,
    shape_from_llama,
    vocab_maps,
)
from .eagle3_foreign import check_target_width, foreign_ids, fused_from_foreign, identity, where

ARCHS = ("LlamaForCausalLMEagle3",)
RENAMES = [("layers.0.", "midlayer.")]  # eyas prefix -> stored prefix
LAYER_ID_OFFSET = -1  # foreign aux id = eyas fused id - 1 (eagle3_foreign)


class SGLangLayout:
    name = "sglang"

    def detect(self, raw: dict[str, Any]) -> bool:
        return any(a in ARCHS for a in raw.get("architectures") or [])

    def read(self, folder: Path, raw: dict[str, Any], target) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
        w = where(folder, self.name)
        variants = [k for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if raw.get(k)]
        if variants:
            raise InputError(f"{w}: EAGLE-3 variants {variants} are not supported by eyas heads")
        shape = shape_from_llama(raw, w)
        check_target_width(raw, shape, w)
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        fused = fused_from_foreign(ids, LAYER_ID_OFFSET, target, w)
        config = HeadConfig(head_type="eagle3", draft_vocab_size=int(required(raw, "draft_vocab_size", w)),
                            fused_layer_ids=fused, target=identity("", shape, fused), **shape)
        foreign = read_weights(folder)
        if "fc.weight" not in foreign:
            raise InputError(f"{folder}: no fc.weight among its weights, so it is not an EAGLE draft head")
        back = [(new, old) for old, new in RENAMES]
        state = {rename(k, back): v for k, v in foreign.items() if k not in BORROWED_KEYS}
        vocab_maps(state, config, folder)
        check_state(state, config, folder, self.name, RENAMES)
        return config, state

    def write(self, head, folder: Path) -> None:
        c = head.config
        if c.head_type != "eagle3":
            raise InputError(f"the sglang layout holds eagle3 heads only; this head is {c.head_type}")
        if c.num_layers != 1:  # SGLang names a later layer's input norm `hidden_norm`: more than a prefix rename
            raise InputError(f"the sglang layout holds exactly 1 decoder layer; this head has {c.num_layers}")
        config = {"architectures": [ARCHS[0]], **llama_fields(c, head.fc.weight.dtype),
                  "draft_vocab_size": c.draft_vocab_size,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": foreign_ids(c, LAYER_ID_OFFSET, self.name),
                                   "use_aux_hidden_state": True}}
        state = {rename(k, RENAMES): v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


register(SGLangLayout())
