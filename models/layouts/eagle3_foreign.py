"""What the EAGLE-3 runtime layouts (SGLang / the EAGLE-3 reference, speculators / vLLM) share: layer-id
conventions, the fused-layer conversion, the vocab maps and the window fields.

eyas numbers fused layers like HF `hidden_states`: id i is the *input* of layer i (the output of layer i-1);
id N is the decoder's output, which eyas takes *after* the final norm.
- SGLang / SpecForge: `eagle_aux_hidden_state_layer_ids` name layer *outputs*; SGLang adds 1 and captures
  `hidden + residual` at the input of that layer, so foreign = ours - 1 (SpecForge writes [1, 29, 57] for a
  61-layer target whose defaults are our [2, 30, 58]). SGLang cannot capture the embedding (our id 0: its
  residual is still None there), so a head fusing id 0 is refused.
- speculators / vLLM: the ids are HF hidden_states indices (vLLM captures index 0 before layer 0 and index
  k after layer k-1), so foreign = ours.
- The EAGLE-3 reference records no ids and always fuses the inputs of layers 2, N//2 and N-3.
Neither runtime applies the final norm to id N, so a head fusing id N is refused.

All three build the fusion `fc` for exactly three captured layers and concatenate them in layer order.
`runtime_fusion` converts a head exactly: fc column blocks of a repeated id are summed, blocks are sorted
with their ids, and a head fusing fewer than three layers gets zero blocks for unused capturable layers
(their features are multiplied by zero). More than three distinct layers cannot be converted and are refused.

Foreign layouts carry no tokenizer fingerprint and no target layer count: a loaded head is checked against
its target by hidden size, vocab size and layer count (its deepest fused layer) only.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from ..config import HeadConfig, TargetIdentity, default_fused_layer_ids
from ..errors import InputError
from .common import rename

log = logging.getLogger(__name__)

RUNTIME_FUSED_LAYERS = 3  # the fc width every EAGLE-3 runtime builds: 3 x hidden_size


def fused_from_foreign(ids: Sequence[int] | None, offset: int, target, where: str) -> tuple[int, ...]:
    """eyas fused layer ids from a foreign config's aux ids (foreign = ours + offset), or the target's defaults."""
    if ids:
        return tuple(int(i) - offset for i in ids)
    if target is not None:
        return default_fused_layer_ids(target.num_layers)
    raise InputError(f"{where} does not record the fused target layers; load it with its target to use the "
                     "defaults (2, N//2, N-3)")


def runtime_fusion(head, target, layout: str, offset: int, first_capturable: int) -> tuple[list[int], torch.Tensor]:
    """(foreign aux ids, fc weight [H, 3H]) that make runtime `layout` compute exactly the head's fusion.

    `first_capturable` is the lowest eyas id the runtime can capture; the target's layer count (from `target`,
    else the head's recorded identity) bounds the rest."""
    c = head.config
    n = layer_count(c, target)
    if n is not None and n in c.fused_layer_ids:
        raise InputError(
            f"the head fuses layer {n}, the target's final *normed* state; {layout} captures that state before the "
            "final norm, so the exported head would see different features")
    low = [i for i in c.fused_layer_ids if i < first_capturable]
    if low:
        raise InputError(f"the head fuses layer {low[0]} (the embedding output); {layout} cannot capture it "
                         f"(it captures layer ids >= {first_capturable} in eyas numbering)")
    blocks: dict[int, torch.Tensor] = {}
    for i, block in zip(c.fused_layer_ids, head.fc.weight.detach().split(c.hidden_size, dim=1)):
        blocks[i] = blocks[i] + block if i in blocks else block  # W_a x + W_b x == (W_a + W_b) x
    if len(blocks) > RUNTIME_FUSED_LAYERS:
        raise InputError(
            f"the head fuses {len(blocks)} distinct target layers {sorted(blocks)}; {layout} builds its fc for exactly "
            f"{RUNTIME_FUSED_LAYERS} and no exact conversion exists: train the head with 3 fused layers")
    if len(blocks) < RUNTIME_FUSED_LAYERS:
        if n is None:
            raise InputError(f"the head fuses {len(blocks)} layers; {layout} needs exactly {RUNTIME_FUSED_LAYERS}: "
                             "pass --target so eyas can pad with zero blocks for unused layers")
        spare = [i for i in range(first_capturable, n) if i not in blocks][: RUNTIME_FUSED_LAYERS - len(blocks)]
        if len(blocks) + len(spare) < RUNTIME_FUSED_LAYERS:
            raise InputError(f"{layout} needs {RUNTIME_FUSED_LAYERS} distinct capturable layers, a {n}-layer target "
                             f"has only {n - first_capturable}")
        log.info("%s: the head fuses layers %s; layers %s are added with zero fc blocks (the runtime fuses exactly %d)",
                 layout, sorted(blocks), spare, RUNTIME_FUSED_LAYERS)
        for i in spare:
            blocks[i] = torch.zeros_like(next(iter(blocks.values())))
    ids = sorted(blocks)
    return [i + offset for i in ids], torch.cat([blocks[i] for i in ids], dim=1).contiguous()


def layer_count(c: HeadConfig, target) -> int | None:
    """The target's decoder layer count: from `target`, else as the head recorded it (None when unknown)."""
    if target is not None:
        return target.num_layers
    return (c.target.num_hidden_layers if c.target is not None else 0) or None


def runtime_state(head, target, layout: str, offset: int, first_capturable: int,
                  renames: list[tuple[str, str]]) -> tuple[list[int], dict[str, torch.Tensor]]:
    """(foreign aux ids, state dict as the runtime names it): fusion converted (`runtime_fusion`), vocab maps
    dropped for a full draft vocab (`full_vocab`), keys renamed by `renames` (eyas -> stored prefixes)."""
    ids, fc = runtime_fusion(head, target, layout, offset, first_capturable)
    state = {k: v.detach() for k, v in head.state_dict().items()}
    state["fc.weight"] = fc
    full_vocab(state, head)
    return ids, {rename(k, renames): v.contiguous().cpu() for k, v in state.items()}


def full_vocab(state: dict[str, torch.Tensor], head) -> None:
    """A head predicting over the whole vocabulary is written without d2t / t2d (vLLM has no parameter for them
    then and the EAGLE-3 reference drops them): lm_head rows are put in target-id order so no map is needed."""
    c = head.config
    if c.draft_vocab_size != c.vocab_size:
        return
    order = head.draft_to_target.cpu()  # draft row i predicts target id order[i]
    rows = torch.empty_like(state["lm_head.weight"])
    rows[order] = state["lm_head.weight"]
    state["lm_head.weight"] = rows
    del state["d2t"], state["t2d"]


def window_from_foreign(d: dict[str, Any], num_layers: int, where: str) -> int | None:
    """HeadConfig.sliding_window from a Llama-style layer config's `layer_types` / `sliding_window`."""
    types = d.get("layer_types")
    if not types:
        return None  # Llama layers ignore `sliding_window` unless layer_types names sliding layers
    if len(types) != num_layers:
        raise InputError(f"{where}: layer_types has {len(types)} entries for {num_layers} decoder layers")
    kinds = set(types)
    if kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        raise InputError(f"{where}: layer_types {types} mixes attention kinds; "
                         "eyas heads use one window for all layers")
    if not d.get("sliding_window"):
        raise InputError(f"{where}: layer_types names sliding_attention layers but sliding_window is missing")
    return int(d["sliding_window"])


def window_fields(c: HeadConfig) -> dict[str, Any]:
    """The Llama-config fields that give every layer the head's window (vLLM reads layer_types per layer)."""
    if c.sliding_window is None:
        return {}
    return {"layer_types": ["sliding_attention"] * c.num_layers, "sliding_window": c.sliding_window}


def identity(verifier: str, shape: dict[str, Any]) -> TargetIdentity:
    """What a foreign layout tells of its target: widths and maybe a name; no layer count, no tokenizer."""
    return TargetIdentity(name_or_path=verifier, hidden_size=shape["hidden_size"], vocab_size=shape["vocab_size"],
                          num_hidden_layers=0, tokenizer_fingerprint="")


def check_target_width(raw: dict[str, Any], shape: dict[str, Any], where: str) -> None:
    target_hidden = raw.get("target_hidden_size")
    if target_hidden not in (None, shape["hidden_size"]):
        raise InputError(f"{where}: target_hidden_size {target_hidden} differs from hidden_size "
                         f"{shape['hidden_size']}; eyas heads share the target's width")


def where(folder: Path, layout: str) -> str:
    return f"{folder / 'config.json'} ({layout} layout)"
