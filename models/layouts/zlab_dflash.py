"""z-lab's DFlash layout, as its `dflash` package (0.1.0: `DFlashDraftModel`, a Qwen3PreTrainedModel, and
`dflash_generate`) and vLLM 0.32 (`DFlashQwen3ForCausalLM`, loaded for architecture `DFlashDraftModel`) read it;
and what the speculators layout's `dflash` row shares with it (`decoder_fields`, `decoder_shape`, `runtime_state`,
`own_weights`, `check_neutral`).

config.json is a Qwen3Config plus `num_target_layers` (z-lab's code reads it even when the ids are given) and
`dflash_config` {mask_token_id, target_layer_ids, block_size}. z-lab's target_layer_ids name layer *outputs*: its
code reads hidden_states[id + 1] and vLLM captures id + 1, so eyas id i is written i - 1. model.safetensors holds
the head's own weights under eyas's names (fc, hidden_norm, layers.{i}.*, norm): the token embedding and the
lm_head are the target's in z-lab's code, vLLM's and eyas's alike.

Both runtimes concatenate the fused states into the fc in the config's order (z-lab) or in layer order, each layer
once (vLLM captures them): the export writes the fc's blocks sorted by layer, a repeated layer's summed, which both
compute as the head does. A head fusing layer N (eyas: after the final norm) is refused, as vLLM captures it before
the norm. Attention: the block sees the context and all of itself in every full-attention layer (z-lab's and vLLM's
default); a sliding layer attends causally by default in both, so a window is written with `is_causal: false`, and
refused where the block is longer than the window (z-lab's non-causal window also cuts keys ahead of a query).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from ..config import HeadConfig, TargetIdentity
from ..drafters import algorithm
from ..errors import InputError
from . import register
from .common import BORROWED_KEYS, CONFIG_NAME, WEIGHTS_NAME, check_state, llama_fields, read_weights, shape_from_llama
from .eagle3_foreign import check_target_width, layer_count, runtime_fusion, where, window_from_foreign

ARCHITECTURE = "DFlashDraftModel"
LAYER_ID_OFFSET = -1  # z-lab id = eyas id - 1 (a layer's output is the next layer's input)
FIRST_CAPTURABLE = 0  # z-lab's id -1 reads hidden_states[0] (the embedding output); vLLM captures it too
BLOCK_SIZE = 16  # z-lab's default when a config does not name one
# DFlash2 (DFlash2DraftModel): a dynamic convolution around each layer's attention and MLP, and a candidate selector
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# What z-lab's or vLLM's DFlash model has beyond eyas's head, read from dflash_config or the top level (as z-lab's
# `_draft_value` reads them), with the values that leave it out: any other is refused, naming the field.
NEUTRAL = {
    "input_embedding_scale": (1,),  # z-lab: multiplies the block's raw embedding
    "output_multiplier": (1,),  # z-lab: multiplies the draft logits
    "final_logit_softcapping": (None, 0),  # z-lab: soft-caps the draft logits when > 0
    "logit_scale": (1,),  # vLLM: multiplies the draft logits
    "sample_from_anchor": (False,),  # vLLM, speculators: the anchor position drafts too (block_size drafts)
    "use_swa": (False,),  # vLLM: every layer sliding (z-lab's code ignores it)
    "swa_window_size": (None,),  # vLLM: a window other than sliding_window
    "attention_sink_bias": (False, None),  # vLLM: learned attention sinks
    "add_swa_attention_sink_bias": (False, None),
    "attention_value_scale": (None,),  # vLLM: scales the values
    "use_aux_hidden_state": (True,),  # vLLM: False drops the fc (the head reads no fused target states)
}
# vLLM substitutes this file's vector for the mask token's embedding; eyas's head reads the target's embedding
MASK_EMBEDDING = "mask_embedding.pt"


def knob(raw: dict[str, Any], name: str, default: Any = None) -> Any:
    """A DFlash setting as z-lab's code reads it: from dflash_config, else the top level."""
    return (raw.get("dflash_config") or {}).get(name, raw.get(name, default))


def check_neutral(raw: dict[str, Any], where: str) -> None:
    """Refuse, naming the field, what a DFlash config adds that eyas's head does not compute."""
    for name, neutral in NEUTRAL.items():
        value = knob(raw, name, neutral[0])
        if value not in neutral:
            raise InputError(f"{where}: {name} {value!r} is not supported (eyas's DFlash head runs as with "
                             f"{neutral[0]!r})")
    extra = [k for k in DFLASH2_FIELDS if knob(raw, k) is not None]
    if extra or "DFlash2DraftModel" in (raw.get("architectures") or []):
        raise InputError(f"{where}: a DFlash2 head ({', '.join(extra) or 'DFlash2DraftModel'}): its convolutions and "
                         "candidate selector are not part of eyas's DFlash head")


def decoder_shape(d: dict[str, Any], where: str) -> tuple[dict[str, Any], int | None]:
    """(HeadConfig shape fields, the window) of a DFlash decoder config as transformers' Qwen3Config reads it (z-lab's
    and speculators' DFlash models both build one from it); refuses what eyas's DFlash layers cannot run."""
    if d.get("model_type", "qwen3") != "qwen3":
        raise InputError(f"{where}: model_type {d['model_type']!r} is not supported: eyas's DFlash layers are Qwen3's")
    if d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta")) is None:
        raise InputError(f"{where}: rope_theta is missing (transformers' Qwen3Config defaults it to 10000, vLLM 0.32's "
                         "DFlash model to 1000000)")
    qwen3 = Qwen3Config(**d).to_dict()  # fills layer_types and the window as the references see them
    shape = shape_from_llama(qwen3, where, o_bias=True)  # Qwen3's attention_bias biases q/k/v/o, as eyas's DFlash
    return shape, window_from_foreign(qwen3, shape["num_layers"], where)


def decoder_fields(head) -> dict[str, Any]:
    """The head's decoder as a Qwen3 config (z-lab's config.json, speculators' transformer_layer_config); a window
    makes every layer sliding and non-causal (both references default sliding layers to causal)."""
    c = head.config
    fields = {**llama_fields(c, head.fc.weight.dtype, o_bias=True), "model_type": "qwen3", "use_sliding_window": False}
    if c.sliding_window is not None:
        fields.update(use_sliding_window=True, sliding_window=c.sliding_window, is_causal=False,
                      layer_types=["sliding_attention"] * c.num_layers)
    return fields


def runtime_state(head, target, layout: str, offset: int) -> tuple[list[int], dict[str, torch.Tensor]]:
    """(foreign layer ids, the head's weights) as a DFlash runtime reads them: the fc's blocks in layer order, a
    repeated layer's summed (`runtime_fusion` with no fixed width)."""
    ids, fusion = runtime_fusion(head, target, layout, offset, FIRST_CAPTURABLE, width=None)
    state = {k: v.detach() for k, v in head.state_dict().items()}
    state.update(fusion)
    return ids, {k: v.contiguous().cpu() for k, v in state.items()}


def own_weights(foreign: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A DFlash file's weights without the target's: the embedding and the lm_head (z-lab's code never reads them,
    speculators reloads both from the verifier for a full-vocabulary head)."""
    return {k: v for k, v in foreign.items() if k not in (*BORROWED_KEYS, "lm_head.weight")}


class ZlabLayout:
    name = "zlab"

    def detect(self, raw: dict[str, Any]) -> bool:
        if "speculators_model_type" in raw:  # speculators' save_pretrained writes its class name, DFlashDraftModel, too
            return False
        archs = raw.get("architectures") or []
        return "dflash_config" in raw or any(a in (ARCHITECTURE, "DFlash2DraftModel") for a in archs)

    def read(self, folder: Path, raw: dict[str, Any], target) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
        w = where(folder, self.name)
        check_neutral(raw, w)
        if (folder / MASK_EMBEDDING).is_file():
            raise InputError(f"{folder / MASK_EMBEDDING}: vLLM embeds the mask token with it; eyas's DFlash head reads "
                             "the target's embedding of mask_token_id")
        shape, window = decoder_shape(raw, w)
        check_target_width(raw, shape, w)
        # a layer attends causally: z-lab's code by is_causal, else sliding; vLLM by is_causal, dflash_config.causal,
        # else sliding (all layers slide alike here: mixed kinds are refused)
        forced, override = raw.get("is_causal"), (raw.get("dflash_config") or {}).get("causal")
        causal = [forced if forced is not None else window is not None,
                  forced if forced is not None else override if override is not None else window is not None]
        if any(causal):
            raise InputError(f"{w}: the block attends causally in {'z-lab' if causal[0] else 'vLLM'}'s reading "
                             "(is_causal, dflash_config.causal, or sliding layers without is_causal: false); eyas's "
                             "DFlash block attends both ways")
        block = int(knob(raw, "block_size", BLOCK_SIZE))
        if window is not None and block > window:
            raise InputError(f"{w}: block_size {block} is longer than the window {window}: z-lab's non-causal window "
                             "hides the block's far end from its first positions, eyas's does not")
        mask = knob(raw, "mask_token_id")
        if mask is None:
            raise InputError(f"{w}: dflash_config.mask_token_id is missing")
        n = raw.get("num_target_layers") or (target.num_layers if target is not None else None)
        ids = knob(raw, "target_layer_ids")
        if ids:
            fused = tuple(int(i) - LAYER_ID_OFFSET for i in ids)
        elif n:  # z-lab's build_target_layer_ids, which eyas's DFlash defaults mirror
            fused = algorithm("dflash").default_layers(int(n), shape["num_layers"])
        else:
            raise InputError(f"{w} names neither target_layer_ids nor num_target_layers; load it with its target")
        config = HeadConfig(head_type="dflash", draft_vocab_size=shape["vocab_size"], fused_layer_ids=fused,
                            target=TargetIdentity("", shape["hidden_size"], shape["vocab_size"],
                                                  int(raw.get("num_target_layers") or 0)),
                            options={"block_size": block, "mask_token_id": int(mask)}, sliding_window=window, **shape)
        state = own_weights(read_weights(folder))
        check_state(state, config, folder, self.name, [])
        return config, state

    def write(self, head, folder: Path, target=None) -> None:
        c, o = head.config, head.config.options
        if c.head_type != "dflash":
            raise InputError(f"the {self.name} layout holds dflash heads; this head is {c.head_type}")
        n = layer_count(c, target)
        if n is None:
            raise InputError("num_target_layers: z-lab's DFlashDraftModel needs the target's layer count, which this "
                             "head does not record: pass --target")
        if c.sliding_window is not None and o.block_size > c.sliding_window:
            raise InputError(f"block_size {o.block_size} is longer than the head's window {c.sliding_window}: z-lab's "
                             "non-causal window would hide the block's far end from its first positions")
        ids, state = runtime_state(head, target, self.name, LAYER_ID_OFFSET)
        config = {"architectures": [ARCHITECTURE], **decoder_fields(head), "num_target_layers": n,
                  "dflash_config": {"mask_token_id": o.mask_token_id, "target_layer_ids": ids,
                                    "block_size": o.block_size}}
        save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


register(ZlabLayout())
