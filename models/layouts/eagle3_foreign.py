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
`runtime_fusion` converts a head exactly, block by block: each fused layer's fc columns move with their id,
and so do its fc_norm weight (EAGLE-3.1), its slice of P-EAGLE's mask state and its slice of the norm over
the concatenation (norm_before_fc: an RMS over the whole concatenation does not depend on the block order).
fc blocks of a repeated id are summed (with fc_norm, each norm weight folded into its block first, leaving a
unit weight); a head fusing fewer than three layers gets zero fc blocks, unit norms and zero mask state for
unused capturable layers (their features are multiplied by zero). Refused, having no exact conversion: more
than three distinct layers; padding or summing under norm_before_fc (either changes the RMS its one norm
takes); a repeated id in a P-EAGLE head (two mask-state blocks have no single block through one fc block).

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
# Tensors laid out over the fused feature in one hidden_size block per fused layer, by the dim that spans it: the
# fc's columns, the one norm over the concatenation (norm_before_fc) and P-EAGLE's learned mask state. Each fc_norm
# (`fc_norm.{j}.weight`) is the norm of block j.
FEATURE_TENSORS = {"fc.weight": 1, "input_norm.weight": 0, "mask_hidden": 0}
FC_NORM = "fc_norm"


def fused_from_foreign(ids: Sequence[int] | None, offset: int, target, where: str) -> tuple[int, ...]:
    """eyas fused layer ids from a foreign config's aux ids (foreign = ours + offset), or the target's defaults."""
    if ids:
        return tuple(int(i) - offset for i in ids)
    if target is not None:
        return default_fused_layer_ids(target.num_layers)
    raise InputError(f"{where} does not record the fused target layers; load it with its target to use the "
                     "defaults (2, N//2, N-3)")


def runtime_fusion(head, target, layout: str, offset: int, first_capturable: int,
                   width: int | None = RUNTIME_FUSED_LAYERS) -> tuple[list[int], dict[str, torch.Tensor]]:
    """(foreign aux ids, the head's fusion tensors rewritten for them) that make runtime `layout` compute exactly
    the head's fusion: `FEATURE_TENSORS` and the fc_norm weights, block by block in the runtime's layer order.

    `first_capturable` is the lowest eyas id the runtime can capture; the target's layer count (from `target`,
    else the head's recorded identity) bounds the rest. `width`: the fused layers the runtime's fc reads (None: as
    many as the config names, DFlash's; the blocks are still sorted and a repeated layer's summed, since the
    runtime captures each layer once, in layer order)."""
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
    state = {k: v.detach() for k, v in head.state_dict().items()}
    # block j of every fused tensor (its fc columns, its norm, its slice of the mask state) -> fused layer ids[j]
    cut = {name: state[name].split(c.hidden_size, dim) for name, dim in FEATURE_TENSORS.items() if name in state}
    parts: dict[int, list[dict[str, torch.Tensor]]] = {}
    for j, i in enumerate(c.fused_layer_ids):
        part = {name: blocks[j] for name, blocks in cut.items()}
        if f"{FC_NORM}.{j}.weight" in state:
            part[FC_NORM] = state[f"{FC_NORM}.{j}.weight"]
        parts.setdefault(i, []).append(part)
    if width is not None and len(parts) > width:
        raise InputError(
            f"the head fuses {len(parts)} distinct target layers {sorted(parts)}; {layout} builds its fc for exactly "
            f"{width} and no exact conversion exists: train the head with {width} fused layers")
    blocks = {i: merged(same, layout) for i, same in parts.items()}
    if width is not None and len(blocks) < width:
        if "input_norm.weight" in state:
            raise InputError(f"norm_before_fc: the head's one RMSNorm spans its {len(c.fused_layer_ids)} fused states; "
                             f"{layout} fuses {RUNTIME_FUSED_LAYERS}, and a padding block would change that RMS: no "
                             "exact conversion, train the head with 3 distinct fused layers")
        spare = spare_layers(c, n, blocks, layout, first_capturable)
        log.info("%s: the head fuses layers %s; layers %s are added with zero fc blocks (the runtime fuses exactly %d)",
                 layout, sorted(blocks), spare, RUNTIME_FUSED_LAYERS)
        like = next(iter(blocks.values()))
        for i in spare:  # multiplied by a zero fc block: the runtime's feature there changes nothing
            blocks[i] = {name: (torch.ones_like(t) if name == FC_NORM else torch.zeros_like(t))
                         for name, t in like.items()}
    ids = sorted(blocks)
    fusion = {name: torch.cat([blocks[i][name] for i in ids], dim=dim).contiguous()
              for name, dim in FEATURE_TENSORS.items() if name in cut}
    if FC_NORM in blocks[ids[0]]:
        fusion.update({f"{FC_NORM}.{j}.weight": blocks[i][FC_NORM] for j, i in enumerate(ids)})
    return [i + offset for i in ids], fusion


def merged(same: list[dict[str, torch.Tensor]], layout: str) -> dict[str, torch.Tensor]:
    """One block for a layer the head fuses len(same) times. Its fc blocks sum (W_a x + W_b x = (W_a + W_b) x); with
    fc_norm, each norm weight folds into its fc block first: both norms normalise the same x, and RMS
    normalisation without its weight is one function of x, so W_a diag(g_a) + W_b diag(g_b) and a unit weight give
    the same fc input exactly."""
    if len(same) == 1:
        return same[0]
    if "input_norm.weight" in same[0]:
        raise InputError(f"norm_before_fc: the head's one RMSNorm spans its fused states, a layer fused twice among "
                         f"them; {layout} captures it once, and one block in place of two changes that RMS: no exact "
                         "conversion, train the head with 3 distinct fused layers")
    if "mask_hidden" in same[0]:
        raise InputError(f"mask_hidden: the P-EAGLE head fuses a layer twice and learned a mask-state block for each; "
                         f"{layout} captures the layer once, and one block cannot stand for two through the fc: no "
                         "exact conversion, train the head with distinct fused layers")
    dtype = same[0]["fc.weight"].dtype  # folded and summed in fp32, rounded once
    fc = [p["fc.weight"].float() * (p[FC_NORM].float()[None, :] if FC_NORM in p else 1.0) for p in same]
    out = {"fc.weight": torch.stack(fc).sum(0).to(dtype)}
    if FC_NORM in same[0]:
        out[FC_NORM] = torch.ones_like(same[0][FC_NORM])
    return out


def spare_layers(c: HeadConfig, n: int | None, blocks: dict[int, Any], layout: str, first_capturable: int) -> list[int]:
    """Capturable layers the head does not fuse, as many as the runtime's fc needs beyond the head's."""
    if n is None:
        raise InputError(f"the head fuses {len(blocks)} layers; {layout} needs exactly {RUNTIME_FUSED_LAYERS}: "
                         "pass --target so eyas can pad with zero blocks for unused layers")
    spare = [i for i in range(first_capturable, n) if i not in blocks][: RUNTIME_FUSED_LAYERS - len(blocks)]
    if len(blocks) + len(spare) < RUNTIME_FUSED_LAYERS:
        raise InputError(f"{layout} needs {RUNTIME_FUSED_LAYERS} distinct capturable layers, a {n}-layer target "
                         f"has only {n - first_capturable}")
    return spare


def layer_count(c: HeadConfig, target) -> int | None:
    """The target's decoder layer count: from `target`, else as the head recorded it (None when unknown)."""
    if target is not None:
        return target.num_layers
    return (c.target.num_hidden_layers if c.target is not None else 0) or None


def runtime_state(head, target, layout: str, offset: int, first_capturable: int,
                  renames: list[tuple[str, str]]) -> tuple[list[int], dict[str, torch.Tensor]]:
    """(foreign aux ids, state dict as the runtime names it): fusion converted (`runtime_fusion`), vocab maps
    dropped for a full draft vocab (`full_vocab`), keys renamed by `renames` (eyas -> stored prefixes)."""
    ids, fusion = runtime_fusion(head, target, layout, offset, first_capturable)
    state = {k: v.detach() for k, v in head.state_dict().items() if not k.startswith(f"{FC_NORM}.")}
    state.update(fusion)
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
