"""The speculators library's layout, which vLLM loads: `Eagle3Speculator` (EAGLE-3, with the EAGLE-3.1 norms),
`PEagleSpeculator` (P-EAGLE, the same head plus a mask token and a learned mask state) and `DFlashSpeculator`
(DFlash: Qwen3 decoder layers denoising a block). `speculators_config` names the algorithm and the verifier,
`transformer_layer_config` the decoder, the aux layer ids are HF hidden_states indices. One path reads and writes
all three: `SPECULATOR_TYPES` says what each adds, and its family (`EAGLE`, `DFLASH`) what its decoder, fused layers
and weights are.

Checked against speculators 0.9.0 (`Eagle3SpeculatorConfig` / `Eagle3DraftModel`, `PEagleSpeculatorConfig` /
`PEagleDraftModel`, `DFlashSpeculatorConfig` / `DFlashDraftModel`) and vLLM 0.32 (`update_eagle3` / `update_peagle`
/ `update_dflash`, `Eagle3LlamaForCausalLM`, `DFlashQwen3ForCausalLM`): vLLM builds the EAGLE fc for three aux
layers, has no d2t parameter when the draft vocab is the full vocab, honours `norm_before_residual`,
`norm_before_fc`, per-layer `layer_types` windows and, for eagle3 heads, `fc_norm` and `norm_output`; a peagle head
drafts in parallel (`mask_token_id` becomes its pard token, `mask_hidden` is fused like the target's states). The
EAGLE file holds the target's token embedding when the export has the target, as speculators saves those heads: its
`from_pretrained` otherwise initialises one (vLLM would share the target's either way). A dflash head's file holds
neither embedding nor lm_head (speculators reloads both from the verifier, vLLM shares the target's); vLLM's
`update_dflash` turns the aux ids into z-lab's target_layer_ids (aux - 1) and `sliding_window_non_causal` into a
causal flag for *every* layer (causal unless it is true), so it is written true: the block attends both ways, as
speculators trains full-attention layers and eyas runs them."""

from __future__ import annotations

import importlib.metadata
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config import HeadConfig
from ..errors import InputError
from ..loading import ALIASES, cache_home
from . import register
from . import zlab_dflash as dflash
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
# The EAGLE-3 options, stored as top-level config fields of the same name by the EAGLE algorithms here.
EAGLE3_FIELDS = ("norm_before_residual", "fc_norm", "norm_before_fc", "norm_output")


class Eagle:
    """EAGLE-3 and P-EAGLE: Llama layers, the three fused layers every EAGLE-3 runtime reads, the draft vocabulary
    maps, the target's embedding in the file."""

    decoder = "llama"
    layer_ids = "eagle_aux_hidden_state_layer_ids"
    constants: dict[str, Any] = {}  # config fields written as they are

    def check(self, raw: dict[str, Any], where: str) -> None:
        """Nothing to refuse beyond the decoder's fields (`shape`) and the options HeadConfig checks."""

    def shape(self, layer: dict[str, Any], where: str) -> tuple[dict[str, Any], int | None]:
        shape = shape_from_llama(layer, where)
        return shape, window_from_foreign(layer, shape["num_layers"], where)

    def fused(self, raw: dict[str, Any], target, where: str) -> tuple[int, ...]:
        return fused_from_foreign(raw.get(self.layer_ids), LAYER_ID_OFFSET, target, where)

    def weights(self, foreign: dict[str, torch.Tensor], config: HeadConfig, folder: Path) -> dict[str, torch.Tensor]:
        state = {k: v for k, v in foreign.items() if k not in BORROWED_KEYS}
        vocab_maps(state, config, folder)
        return state

    def written(self, head, target, layout: str) -> tuple[list[int], dict[str, torch.Tensor], dict[str, Any]]:
        """(aux ids, weights, transformer_layer_config) of the export."""
        c = head.config
        ids, state = runtime_state(head, target, layout, LAYER_ID_OFFSET, FIRST_CAPTURABLE, [])
        if target is not None:  # as speculators saves heads: its from_pretrained loads the embedding from the file
            embedding = target.embed_tokens.weight.detach()
            state["embed_tokens.weight"] = embedding.to("cpu", head.fc.weight.dtype).contiguous()
        else:
            log.warning("the speculators export has no token embedding: vLLM shares the target's, but the "
                        "speculators library would initialise one of its own; pass --target to include it")
        return ids, state, {**llama_fields(c, head.fc.weight.dtype), **window_fields(c)}


class DFlash:
    """DFlash: Qwen3 layers (zlab_dflash), any number of fused layers, no embedding or lm_head in the file. A window
    is refused both ways: speculators' DFlashDraftModel windows the context from each block's anchor, vLLM from each
    block position, so no window is computed alike by both."""

    decoder = "qwen3"
    layer_ids = "aux_hidden_state_layer_ids"
    constants = {"sample_from_anchor": False, "sliding_window_non_causal": True}
    WINDOW = ("a sliding window: speculators' DFlashDraftModel windows the context from each block's anchor, vLLM "
              "0.32 from each block position, so the two runtimes compute different heads")

    def check(self, raw: dict[str, Any], where: str) -> None:
        dflash.check_neutral(raw, where)

    def shape(self, layer: dict[str, Any], where: str) -> tuple[dict[str, Any], int | None]:
        shape, window = dflash.decoder_shape(layer, where)
        if window is not None:
            raise InputError(f"{where}: {self.WINDOW}")
        return shape, None

    def fused(self, raw: dict[str, Any], target, where: str) -> tuple[int, ...]:
        return tuple(int(i) - LAYER_ID_OFFSET for i in raw[self.layer_ids])

    def weights(self, foreign: dict[str, torch.Tensor], config: HeadConfig, folder: Path) -> dict[str, torch.Tensor]:
        return dflash.own_weights(foreign)

    def written(self, head, target, layout: str) -> tuple[list[int], dict[str, torch.Tensor], dict[str, Any]]:
        if head.config.sliding_window is not None:
            raise InputError(f"{self.WINDOW}; export it as zlab")
        ids, state = dflash.runtime_state(head, target, layout, LAYER_ID_OFFSET)
        return ids, state, dflash.decoder_fields(head)


EAGLE, DFLASH = Eagle(), DFlash()


@dataclass(frozen=True)
class SpeculatorType:
    """What one speculators_model_type adds to its family's config; it names the eyas head_type it holds."""

    architecture: str
    family: Eagle | DFlash
    fields: tuple[str, ...] = ()  # its options, stored as top-level fields of the same name
    # the option proposal_methods[0].speculative_tokens records on import (None: not read); an export writes the
    # positions a parallel drafter proposes per forward, else SPECULATIVE_TOKENS
    tokens: str | None = None
    # fields whose absence is refused on import, and why
    required: dict[str, str] = field(default_factory=dict)
    # options vLLM 0.32 does not read for this algorithm: a head that sets one is refused on export
    unread: tuple[str, ...] = ()
    # weights speculators stores with a leading [1, 1] (eyas keeps them without)
    batched: tuple[str, ...] = ()


VLLM_REQUIRES = "vLLM's update_dflash requires it"
SPECULATOR_TYPES = {
    "eagle3": SpeculatorType("Eagle3Speculator", EAGLE, EAGLE3_FIELDS, required={
        "norm_before_residual": "speculators and vLLM default it differently"}),
    # update_peagle passes neither fc_norm nor norm_output on (norm_output is moot when drafting in parallel: no
    # state is fed back), so vLLM would build the head without its fc_norm
    "peagle": SpeculatorType("PEagleSpeculator", EAGLE, (*EAGLE3_FIELDS, "mask_token_id"), tokens="depths",
                             unread=("fc_norm",), batched=("mask_hidden",)),
    # speculative_tokens is block_size - 1 (the anchor is the bonus token: sample_from_anchor false)
    "dflash": SpeculatorType("DFlashSpeculator", DFLASH, ("block_size", "mask_token_id"), required={
        "aux_hidden_state_layer_ids": VLLM_REQUIRES, "mask_token_id": VLLM_REQUIRES,
        "block_size": "speculators defaults it to 8, eyas to 16"}),
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
        family = stype.family
        spec = raw.get("speculators_config") or {}
        if spec.get("algorithm", kind) != kind:
            raise InputError(f"{w}: algorithm {spec['algorithm']!r} is not {kind}")
        layer = required(raw, "transformer_layer_config", w)
        for key, why in stype.required.items():
            if raw.get(key) is None:
                raise InputError(f"{w}: {key} is missing ({why})")
        if layer.get("model_type") != family.decoder:  # speculators builds what the model type names
            raise InputError(f"{w}: transformer_layer_config model_type {layer.get('model_type')!r} is not supported "
                             f"for {kind} heads; eyas's are {family.decoder} layers")
        family.check(raw, w)
        shape, window = family.shape(layer, w)
        check_target_width(raw, shape, w)
        options = {k: raw[k] for k in stype.fields if raw.get(k) is not None}
        method = (spec.get("proposal_methods") or [{}])[0]
        if stype.tokens and method.get("speculative_tokens"):
            options[stype.tokens] = int(method["speculative_tokens"])
        verifier = (spec.get("verifier") or {}).get("name_or_path") or ""
        config = HeadConfig(head_type=kind, draft_vocab_size=int(required(raw, "draft_vocab_size", w)),
                            fused_layer_ids=family.fused(raw, target, w), target=identity(verifier, shape),
                            options=options, sliding_window=window, **shape)
        foreign = read_weights(folder)
        if "fc.weight" not in foreign:
            raise InputError(f"{folder}: no fc.weight among its weights, so it is not a {kind} draft head")
        state = family.weights(foreign, config, folder)
        for k in stype.batched:
            if k in state and tuple(state[k].shape[:2]) == (1, 1):
                state[k] = state[k][0, 0]
        check_state(state, config, folder, self.name, [])
        return config, state

    def write(self, head, folder: Path, target=None) -> None:
        c, o = head.config, head.config.options
        stype = SPECULATOR_TYPES.get(c.head_type)
        if stype is None:
            raise InputError(f"the speculators layout holds {', '.join(SPECULATOR_TYPES)} heads; this head is "
                             f"{c.head_type}")
        unread = [k for k in stype.unread if getattr(o, k)]
        if unread:
            raise InputError(f"{unread[0]}: vLLM 0.32 does not read it for {c.head_type} heads (its update_"
                             f"{c.head_type} drops the field), so it would serve this head without it")
        ids, state, layer = stype.family.written(head, target, self.name)
        for k in stype.batched:
            state[k] = state[k][None, None].contiguous()
        tokens = head.draft_positions if head.algorithm.drafting == "parallel" else SPECULATIVE_TOKENS
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
            "transformer_layer_config": layer,
            "draft_vocab_size": c.draft_vocab_size,
            **{k: getattr(o, k) for k in stype.fields},
            **stype.family.constants,
            "target_hidden_size": c.hidden_size,
            stype.family.layer_ids: ids,
            "torch_dtype": layer["torch_dtype"],
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
