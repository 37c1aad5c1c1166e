"""SGLang's `LlamaForCausalLMEagle3` layout, which SpecForge also writes, and the EAGLE-3 reference layout it
grew from: a Llama config with `draft_vocab_size` (SGLang: also `eagle_config` with the aux layer ids), the
decoder layer named `midlayer`. The reference writes `architectures: ["LlamaForCausalLM"]`, no layer ids and
`pytorch_model.bin`; both are read here.

Imports read the EAGLE-3.1 fields SpecForge configs carry, `fc_norm` and `norm_output` (as vLLM and SGLang
read it: true feeds the post-norm state to the next step), and `norm_before_fc` (NVIDIA's checkpoints keep it
in `eagle_config`, where vLLM looks first). Exports are written for SGLang: `eagle_config` ids, one decoder
layer, and none of norm_before_residual, a window, fc_norm, norm_before_fc or norm_output (the `llama_eagle3.py`
this layout was checked against has none of them and skips weights it has no parameter for), so such heads are
refused and belong in the speculators layout. The EAGLE-3 reference (SafeAILab/EAGLE `eagle/model/cnets.py`)
loads the same folder but ignores `eagle_config` and `head_dim`: it fuses the inputs of layers 2, N//2, N-3 and uses
hidden_size // num_heads, so a head that differs there is written for SGLang with a warning."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config import HeadConfig, default_fused_layer_ids
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
from .eagle3_foreign import (
    check_target_width,
    fused_from_foreign,
    identity,
    layer_count,
    runtime_state,
    where,
    window_from_foreign,
)

log = logging.getLogger(__name__)

ARCHS = ("LlamaForCausalLMEagle3",)
REFERENCE_ARCH = "LlamaForCausalLM"  # the EAGLE-3 reference: told apart from EAGLE-1 by draft_vocab_size
RENAMES = [("layers.0.", "midlayer.")]  # eyas prefix -> stored prefix
LAYER_ID_OFFSET = -1  # foreign aux id = eyas fused id - 1 (eagle3_foreign)
FIRST_CAPTURABLE = 1  # SGLang cannot capture the embedding output (eyas id 0)
# The EAGLE-3 options a config may carry, top level or in eagle_config (read there first, as vLLM does).
OPTIONS = ("norm_before_residual", "fc_norm", "norm_before_fc", "norm_output")
UNSERVED = ("fc_norm", "norm_before_fc", "norm_output")  # options SGLang's llama_eagle3.py does not read


class SGLangLayout:
    name = "sglang"

    def detect(self, raw: dict[str, Any]) -> bool:
        archs = raw.get("architectures") or []
        return any(a in ARCHS for a in archs) or (REFERENCE_ARCH in archs and "draft_vocab_size" in raw)

    def read(self, folder: Path, raw: dict[str, Any], target) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
        w = where(folder, self.name)
        shape = shape_from_llama(raw, w)
        check_target_width(raw, shape, w)
        eagle = raw.get("eagle_config") or {}
        fused = fused_from_foreign(eagle.get("eagle_aux_hidden_state_layer_ids"), LAYER_ID_OFFSET, target, w)
        config = HeadConfig(head_type="eagle3", draft_vocab_size=int(required(raw, "draft_vocab_size", w)),
                            fused_layer_ids=fused, target=identity("", shape),
                            options={k: bool(eagle.get(k, raw.get(k, False))) for k in OPTIONS},
                            sliding_window=window_from_foreign(raw, shape["num_layers"], w), **shape)
        foreign = read_weights(folder)
        if "fc.weight" not in foreign:
            raise InputError(f"{folder}: no fc.weight among its weights, so it is not an EAGLE draft head")
        back = [(new, old) for old, new in RENAMES]
        state = {rename(k, back): v for k, v in foreign.items() if k not in BORROWED_KEYS}
        vocab_maps(state, config, folder)
        check_state(state, config, folder, self.name, RENAMES)
        return config, state

    def write(self, head, folder: Path, target=None) -> None:
        c = head.config
        if c.head_type != "eagle3":
            raise InputError(f"the sglang layout holds eagle3 heads only; this head is {c.head_type}")
        if c.num_layers != 1:  # SGLang names a later layer's input norm `hidden_norm`: more than a prefix rename
            raise InputError(f"the sglang layout holds exactly 1 decoder layer; this head has {c.num_layers}")
        if c.options.norm_before_residual:
            raise InputError("SGLang's EAGLE-3 midlayer keeps the raw hidden as its residual; this head was trained "
                             "with norm_before_residual: export it as speculators (vLLM) instead")
        if c.sliding_window is not None:
            raise InputError(f"SGLang's EAGLE-3 midlayer attends over the whole context; this head has a "
                             f"{c.sliding_window}-token window: export it as speculators (vLLM) instead")
        unserved = [k for k in UNSERVED if getattr(c.options, k)]
        if unserved:
            raise InputError(f"{unserved[0]}: SGLang's llama_eagle3.py does not read it, so it would serve this head "
                             "without it: export it as speculators (vLLM) instead")
        ids, state = runtime_state(head, target, self.name, LAYER_ID_OFFSET, FIRST_CAPTURABLE, RENAMES)
        warn_reference(c, [i - LAYER_ID_OFFSET for i in ids], target)
        config = {"architectures": [ARCHS[0]], **llama_fields(c, head.fc.weight.dtype),
                  "draft_vocab_size": c.draft_vocab_size,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
        save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def warn_reference(c: HeadConfig, fused: list[int], target) -> None:
    """Say when the EAGLE-3 reference would misread this SGLang export (it serves SGLang exactly either way)."""
    n = layer_count(c, target)
    reasons = []
    if n is None or tuple(fused) != default_fused_layer_ids(n):
        reasons.append(f"it fuses layers {fused}, the reference always fuses 2, N//2, N-3")
    if c.head_dim * c.num_attention_heads != c.hidden_size:
        reasons.append(f"head_dim {c.head_dim} != hidden_size // num_attention_heads, which the reference assumes")
    if reasons:
        log.warning("the sglang export serves SGLang; the EAGLE-3 reference would misread it: %s", "; ".join(reasons))


register(SGLangLayout())
