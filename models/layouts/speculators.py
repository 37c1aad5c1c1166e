"""The speculators library's `Eagle3Speculator` layout, which vLLM loads: `speculators_config` with the
verifier, `transformer_layer_config` (Llama), aux layer ids as HF hidden_states indices."""

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
    required,
    shape_from_llama,
    vocab_maps,
)
from .eagle3_foreign import check_target_width, foreign_ids, fused_from_foreign, identity, where

LAYER_ID_OFFSET = 0  # foreign aux id = eyas fused id (eagle3_foreign)
# speculators' GreedyTokenProposalConfig default; the chain length vLLM proposes unless told otherwise.
SPECULATIVE_TOKENS = 5
SPECULATORS_VERSION = "0.3.0"


class SpeculatorsLayout:
    name = "speculators"

    def detect(self, raw: dict[str, Any]) -> bool:
        if "speculators_model_type" not in raw:
            return False
        if raw["speculators_model_type"] != "eagle3":
            raise InputError(f"speculators model type {raw['speculators_model_type']!r} is not supported; eyas reads eagle3")
        return True

    def read(self, folder: Path, raw: dict[str, Any], target) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
        w = where(folder, self.name)
        spec = raw.get("speculators_config") or {}
        if spec.get("algorithm", "eagle3") != "eagle3":
            raise InputError(f"{w}: algorithm {spec['algorithm']!r} is not eagle3")
        llama = required(raw, "transformer_layer_config", w)
        if "norm_before_residual" not in raw:
            # speculators defaults it to False, vLLM to True: refuse to guess which the head was trained with.
            raise InputError(f"{w}: norm_before_residual is missing (speculators and vLLM default it differently)")
        if llama.get("model_type") != "llama":  # speculators builds other decoder layers (e.g. qwen3's q/k norms)
            raise InputError(f"{w}: transformer_layer_config model_type {llama.get('model_type')!r} is not supported; "
                             "eyas heads use llama layers")
        variants = [k for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if raw.get(k)]
        if variants:
            raise InputError(f"{w}: EAGLE-3 variants {variants} are not supported by eyas heads")
        shape = shape_from_llama(llama, w)
        check_target_width(raw, shape, w)
        fused = fused_from_foreign(raw.get("eagle_aux_hidden_state_layer_ids"), LAYER_ID_OFFSET, target, w)
        verifier = (spec.get("verifier") or {}).get("name_or_path") or ""
        config = HeadConfig(head_type="eagle3", draft_vocab_size=int(required(raw, "draft_vocab_size", w)),
                            fused_layer_ids=fused, target=identity(verifier, shape, fused), **shape)
        foreign = read_weights(folder)
        if "fc.weight" not in foreign:
            raise InputError(f"{folder}: no fc.weight among its weights, so it is not an EAGLE draft head")
        state = {k: v for k, v in foreign.items() if k not in BORROWED_KEYS}
        vocab_maps(state, config, folder)
        check_state(state, config, folder, self.name, [])
        return config, state

    def write(self, head, folder: Path) -> None:
        c = head.config
        if c.head_type != "eagle3":
            raise InputError(f"the speculators layout holds eagle3 heads only; this head is {c.head_type}")
        llama = llama_fields(c, head.fc.weight.dtype)
        verifier = c.target.name_or_path if c.target is not None else None
        config = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": SPECULATIVE_TOKENS,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                # eyas does not record the target's architecture class; speculators only uses it to compare verifiers.
                "verifier": {"name_or_path": verifier, "architectures": []},
            },
            "transformer_layer_config": llama,
            "draft_vocab_size": c.draft_vocab_size,
            "norm_before_residual": False,  # eyas keeps the un-normed hidden as the residual
            "target_hidden_size": c.hidden_size,
            "eagle_aux_hidden_state_layer_ids": foreign_ids(c, LAYER_ID_OFFSET, self.name),
            "torch_dtype": llama["torch_dtype"],
        }
        state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


register(SpeculatorsLayout())
