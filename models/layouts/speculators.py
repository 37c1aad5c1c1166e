"""The speculators library's layout, which vLLM loads: `Eagle3Speculator` (EAGLE-3, with the EAGLE-3.1 norms)
and `PEagleSpeculator` (P-EAGLE, the same head plus a mask token and a learned mask state). `speculators_config`
names the algorithm and the verifier, `transformer_layer_config` the decoder (Llama), the aux layer ids are HF
hidden_states indices. One path reads and writes both: `SPECULATOR_TYPES` says what each adds to the EAGLE-3
config.

Checked against speculators 0.9.0 (`Eagle3SpeculatorConfig` / `Eagle3DraftModel`, `PEagleSpeculatorConfig` /
`PEagleDraftModel`) and vLLM 0.32 (`update_eagle3` / `update_peagle`, `Eagle3LlamaForCausalLM`): vLLM builds the
fc for three aux layers, has no d2t parameter when the draft vocab is the full vocab, honours
`norm_before_residual`, `norm_before_fc`, per-layer `layer_types` windows and, for eagle3 heads, `fc_norm` and
`norm_output`; a peagle head drafts in parallel (`mask_token_id` becomes its pard token, `mask_hidden` is fused
like the target's states). The file holds the target's token embedding when the export has the target, as
speculators saves its heads: its `from_pretrained` otherwise initialises one (vLLM would share the target's
either way)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
from dataclasses import dataclass
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
# The EAGLE-3 options, stored as top-level config fields of the same name by every algorithm here.
EAGLE3_FIELDS = ("norm_before_residual", "fc_norm", "norm_before_fc", "norm_output")


@dataclass(frozen=True)
class SpeculatorType:
    """What one speculators_model_type adds to the EAGLE-3 config; it names the eyas head_type it holds."""

    architecture: str
    fields: tuple[str, ...] = ()  # its own options, stored as top-level fields of the same name
    # the option proposal_methods[0].speculative_tokens records (None: written as SPECULATIVE_TOKENS, not read)
    tokens: str | None = None
    # fields whose absence is refused on import: speculators and vLLM default them differently
    ambiguous: tuple[str, ...] = ()
    # options vLLM 0.32 does not read for this algorithm: a head that sets one is refused on export
    unread: tuple[str, ...] = ()
    # weights speculators stores with a leading [1, 1] (eyas keeps them without)
    batched: tuple[str, ...] = ()


SPECULATOR_TYPES = {
    # speculators defaults norm_before_residual to False, vLLM's update_eagle3 to True
    "eagle3": SpeculatorType("Eagle3Speculator", ambiguous=("norm_before_residual",)),
    # update_peagle passes neither fc_norm nor norm_output on (norm_output is moot when drafting in parallel: no
    # state is fed back), so vLLM would build the head without its fc_norm
    "peagle": SpeculatorType("PEagleSpeculator", fields=("mask_token_id",), tokens="depths", unread=("fc_norm",),
                             batched=("mask_hidden",)),
}


class SpeculatorsLayout:
    name = "speculators"

    def detect(self, raw: dict[str, Any]) -> bool:
        if "speculators_model_type" not in raw:
            return False
        if raw["speculators_model_type"] not in SPECULATOR_TYPES:
            raise InputError(f"speculators model type {raw['speculators_model_type']!r} is not supported; "
                             f"eyas reads {', '.join(SPECULATOR_TYPES)}")
        return True

    def read(self, folder: Path, raw: dict[str, Any], target) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
        w = where(folder, self.name)
        kind = raw["speculators_model_type"]
        stype = SPECULATOR_TYPES[kind]
        spec = raw.get("speculators_config") or {}
        if spec.get("algorithm", kind) != kind:
            raise InputError(f"{w}: algorithm {spec['algorithm']!r} is not {kind}")
        llama = required(raw, "transformer_layer_config", w)
        for key in stype.ambiguous:
            if key not in raw:
                raise InputError(f"{w}: {key} is missing (speculators and vLLM default it differently)")
        if llama.get("model_type") != "llama":  # speculators builds other decoder layers (e.g. qwen3's q/k norms)
            raise InputError(f"{w}: transformer_layer_config model_type {llama.get('model_type')!r} is not supported; "
                             "eyas heads use llama layers")
        shape = shape_from_llama(llama, w)
        check_target_width(raw, shape, w)
        options = {k: raw[k] for k in (*EAGLE3_FIELDS, *stype.fields) if raw.get(k) is not None}
        method = (spec.get("proposal_methods") or [{}])[0]
        if stype.tokens and method.get("speculative_tokens"):
            options[stype.tokens] = int(method["speculative_tokens"])
        fused = fused_from_foreign(raw.get("eagle_aux_hidden_state_layer_ids"), LAYER_ID_OFFSET, target, w)
        verifier = (spec.get("verifier") or {}).get("name_or_path") or ""
        config = HeadConfig(head_type=kind, draft_vocab_size=int(required(raw, "draft_vocab_size", w)),
                            fused_layer_ids=fused, target=identity(verifier, shape), options=options,
                            sliding_window=window_from_foreign(llama, shape["num_layers"], w), **shape)
        foreign = read_weights(folder)
        if "fc.weight" not in foreign:
            raise InputError(f"{folder}: no fc.weight among its weights, so it is not an EAGLE draft head")
        state = {k: v for k, v in foreign.items() if k not in BORROWED_KEYS}
        for k in stype.batched:
            if k in state and tuple(state[k].shape[:2]) == (1, 1):
                state[k] = state[k][0, 0]
        vocab_maps(state, config, folder)
        check_state(state, config, folder, self.name, [])
        return config, state

    def write(self, head, folder: Path, target=None) -> None:
        c, o = head.config, head.config.options
        stype = SPECULATOR_TYPES.get(c.head_type)
        if stype is None:
            raise InputError(f"the speculators layout holds {' and '.join(SPECULATOR_TYPES)} heads; this head is "
                             f"{c.head_type}")
        unread = [k for k in stype.unread if getattr(o, k)]
        if unread:
            raise InputError(f"{unread[0]}: vLLM 0.32 does not read it for {c.head_type} heads (its update_"
                             f"{c.head_type} drops the field), so it would serve this head without it")
        ids, state = runtime_state(head, target, self.name, LAYER_ID_OFFSET, FIRST_CAPTURABLE, [])
        for k in stype.batched:
            state[k] = state[k][None, None].contiguous()
        if target is not None:  # as speculators saves heads: its from_pretrained loads the embedding from the file
            embedding = target.embed_tokens.weight.detach()
            state["embed_tokens.weight"] = embedding.to("cpu", head.fc.weight.dtype).contiguous()
        else:
            log.warning("the speculators export has no token embedding: vLLM shares the target's, but the "
                        "speculators library would initialise one of its own; pass --target to include it")
        llama = {**llama_fields(c, head.fc.weight.dtype), **window_fields(c)}
        tokens = getattr(o, stype.tokens) if stype.tokens else SPECULATIVE_TOKENS
        config = {
            "speculators_model_type": c.head_type,
            "architectures": [stype.architecture],
            "speculators_version": speculators_version(),
            "speculators_config": {
                "algorithm": c.head_type,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": verifier(c, target),
            },
            "transformer_layer_config": llama,
            "draft_vocab_size": c.draft_vocab_size,
            **{k: getattr(o, k) for k in (*EAGLE3_FIELDS, *stype.fields)},
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
