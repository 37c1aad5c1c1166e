"""The EAGLE-1 reference layout (`cnets.Model`): a Llama config, `fc` with bias, `layers.{i}.*` (layer 0
without input_layernorm), `pytorch_model.bin` holding the token embedding too.

Exports are written for the PyPI EAGLE-1 release, eagle-llm 1.2.1 (`eagle.model.cnets.Model`): it reads only
`pytorch_model.bin` and loads it strictly, so the file carries `embed_tokens.weight`, taken from the target
(export needs one). That release computes head_dim as hidden_size // num_heads and rotates at base 10000
whatever `rope_theta` says; EAGLE's GitHub code since EAGLE-2 (`cnets1.py`, loading non-strictly, either
weights file) honours `rope_theta`. A head with another head_dim is refused; one with another rope_theta is
written with a warning that eagle-llm 1.2.1 would misread it. eagle-llm 1.2.1 runs Llama and Mixtral targets."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from ..config import HeadConfig, TargetIdentity
from ..errors import InputError
from . import register
from .common import (
    BORROWED_KEYS,
    CONFIG_NAME,
    LEGACY_WEIGHTS_NAME,
    check_state,
    llama_fields,
    read_weights,
    shape_from_llama,
    target_architectures,
)

log = logging.getLogger(__name__)

ARCHS = ("LlamaForCausalLM", "LlamaForCausalLMEagle")  # reference / SGLang's EAGLE-1 class
REFERENCE_ROPE_THETA = 10000.0  # eagle-llm 1.2.1's LlamaRotaryEmbedding base; it never reads rope_theta
REFERENCE_TARGETS = ("LlamaForCausalLM", "MixtralForCausalLM")  # the target classes eagle-llm 1.2.1 builds


class Eagle1Layout:
    name = "eagle"

    def detect(self, raw: dict[str, Any]) -> bool:
        # draft_vocab_size marks the EAGLE-3 reference, which also writes LlamaForCausalLM (sglang layout)
        return any(a in ARCHS for a in raw.get("architectures") or []) and "draft_vocab_size" not in raw

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

    def write(self, head, folder: Path, target=None) -> None:
        c = head.config
        if c.head_type != "eagle1":
            raise InputError(f"the eagle layout holds eagle1 heads only; this head is {c.head_type}")
        if target is None:
            raise InputError("the EAGLE-1 reference (eagle-llm 1.2.1) loads the head strictly, token embedding "
                             "included: pass --target so eyas can write the target's embedding into the file")
        if c.head_dim * c.num_attention_heads != c.hidden_size:
            raise InputError(f"head_dim {c.head_dim} x {c.num_attention_heads} heads != hidden_size {c.hidden_size}; "
                             "the EAGLE-1 reference derives head_dim as hidden_size // num_heads")
        if c.sliding_window is not None:
            raise InputError(f"the EAGLE-1 reference attends over the whole context; this head has a "
                             f"{c.sliding_window}-token window")
        warn_release(c, target)
        dtype = head.fc.weight.dtype
        state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach().to("cpu", dtype).contiguous()
        config = {"architectures": [ARCHS[0]], **llama_fields(c, dtype), "bias": True}  # bias: the fc's
        torch.save(state, folder / LEGACY_WEIGHTS_NAME)
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def warn_release(c: HeadConfig, target) -> None:
    """Say when eagle-llm 1.2.1 would misread this export (EAGLE's GitHub code since EAGLE-2 reads it as written)."""
    reasons = []
    if c.rope_theta != REFERENCE_ROPE_THETA:
        reasons.append(f"the head rotates at rope_theta {c.rope_theta:g}, eagle-llm 1.2.1 at {REFERENCE_ROPE_THETA:g}")
    archs = target_architectures(target)
    if not set(archs) & set(REFERENCE_TARGETS):
        reasons.append(f"the target is {archs}, eagle-llm 1.2.1 builds {' or '.join(REFERENCE_TARGETS)} targets only")
    if reasons:
        log.warning("eagle-llm 1.2.1 would misread this EAGLE-1 export (EAGLE's code since EAGLE-2 reads it as "
                    "written): %s", "; ".join(reasons))


register(Eagle1Layout())
