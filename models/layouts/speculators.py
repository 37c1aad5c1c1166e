"""The speculators library's `Eagle3Speculator` layout, which vLLM loads: `speculators_config` with the
verifier, `transformer_layer_config` (Llama), aux layer ids as HF hidden_states indices.

Checked against speculators 0.9.0 (`Eagle3SpeculatorConfig`, `Eagle3DraftModel`) and vLLM 0.32
(`Eagle3LlamaForCausalLM`): vLLM builds the fc for three aux layers, has no d2t parameter when the draft
vocab is the full vocab, honours `norm_before_residual` and per-layer `layer_types` windows. The file holds
the target's token embedding when the export has the target, as speculators saves its heads: its
`Eagle3DraftModel.from_pretrained` otherwise initialises one (vLLM would share the target's either way)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config import HeadConfig
from ..errors import InputError
from ..loading import ALIASES, cache_home
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
    target_architectures,
    vocab_maps,
)
from .eagle3_foreign import (
    check_target_width,
    fused_from_foreign,
    identity,
    runtime_state,
    where,
    window_fields,
    window_from_foreign,
)

log = logging.getLogger(__name__)

LAYER_ID_OFFSET = 0  # foreign aux id = eyas fused id (eagle3_foreign)
FIRST_CAPTURABLE = 0  # vLLM captures hidden_states[0] (the embedding output) too
# speculators' GreedyTokenProposalConfig default; the chain length vLLM proposes unless told otherwise.
SPECULATIVE_TOKENS = 5
# The speculators release whose config this layout follows; the installed one is recorded when present.
SPECULATORS_VERSION = "0.9.0"
UNSUPPORTED_VARIANTS = ("norm_before_fc", "fc_norm", "norm_output")


class SpeculatorsLayout:
    name = "speculators"

    def detect(self, raw: dict[str, Any]) -> bool:
        if "speculators_model_type" not in raw:
            return False
        if raw["speculators_model_type"] != "eagle3":
            raise InputError(f"speculators model type {raw['speculators_model_type']!r} is not supported; "
                             "eyas reads eagle3")
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
        variants = [k for k in UNSUPPORTED_VARIANTS if raw.get(k)]
        if variants:
            raise InputError(f"{w}: EAGLE-3 variants {variants} are not supported by eyas heads")
        shape = shape_from_llama(llama, w)
        check_target_width(raw, shape, w)
        fused = fused_from_foreign(raw.get("eagle_aux_hidden_state_layer_ids"), LAYER_ID_OFFSET, target, w)
        verifier = (spec.get("verifier") or {}).get("name_or_path") or ""
        config = HeadConfig(head_type="eagle3", draft_vocab_size=int(required(raw, "draft_vocab_size", w)),
                            fused_layer_ids=fused, target=identity(verifier, shape),
                            options={"norm_before_residual": bool(raw["norm_before_residual"])},
                            sliding_window=window_from_foreign(llama, shape["num_layers"], w), **shape)
        foreign = read_weights(folder)
        if "fc.weight" not in foreign:
            raise InputError(f"{folder}: no fc.weight among its weights, so it is not an EAGLE draft head")
        state = {k: v for k, v in foreign.items() if k not in BORROWED_KEYS}
        vocab_maps(state, config, folder)
        check_state(state, config, folder, self.name, [])
        return config, state

    def write(self, head, folder: Path, target=None) -> None:
        c = head.config
        if c.head_type != "eagle3":
            raise InputError(f"the speculators layout holds eagle3 heads only; this head is {c.head_type}")
        ids, state = runtime_state(head, target, self.name, LAYER_ID_OFFSET, FIRST_CAPTURABLE, [])
        if target is not None:  # as speculators saves heads: its Eagle3DraftModel loads the embedding from the file
            embedding = target.embed_tokens.weight.detach()
            state["embed_tokens.weight"] = embedding.to("cpu", head.fc.weight.dtype).contiguous()
        else:
            log.warning("the speculators export has no token embedding: vLLM shares the target's, but the "
                        "speculators library would initialise one of its own; pass --target to include it")
        llama = {**llama_fields(c, head.fc.weight.dtype), **window_fields(c)}
        config = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "speculators_version": speculators_version(),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": SPECULATIVE_TOKENS,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": verifier(c, target),
            },
            "transformer_layer_config": llama,
            "draft_vocab_size": c.draft_vocab_size,
            "norm_before_residual": c.options.norm_before_residual,
            "target_hidden_size": c.hidden_size,
            "eagle_aux_hidden_state_layer_ids": ids,
            "torch_dtype": llama["torch_dtype"],
        }
        save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def speculators_version() -> str:
    try:
        return importlib.metadata.version("speculators")
    except importlib.metadata.PackageNotFoundError:
        return SPECULATORS_VERSION


def verifier(c: HeadConfig, target) -> dict[str, Any]:
    """speculators' verifier block: a hub id or path the library can load (an eyas alias becomes the hub id of
    the model it packages), and the target's architectures (from `target`, else from a local config.json)."""
    name = target.name_or_path if target is not None else (c.target.name_or_path if c.target is not None else "")
    archs = target_architectures(target) if target is not None else local_architectures(name)
    if not name or not archs:
        log.warning("the speculators verifier is incomplete (name_or_path=%r, architectures=%s): pass --target to "
                    "export so speculators can load the verifier", name, archs)
    if name in ALIASES:
        return {"name_or_path": ALIASES[name][2], "architectures": archs}
    path = Path(name).expanduser()
    return {"name_or_path": str(path.resolve()) if name and path.exists() else name, "architectures": archs}


def local_architectures(name: str) -> list[str]:
    """`architectures` of a target's config.json when it is on this machine (an alias's converted folder or a path)."""
    folder = cache_home() / "targets" / name if name in ALIASES else Path(name).expanduser()
    try:
        return list(json.loads((folder / CONFIG_NAME).read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return []


register(SpeculatorsLayout())
