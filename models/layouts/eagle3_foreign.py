"""What the two EAGLE-3 runtime layouts (SGLang, speculators) share: layer-id conventions and the fused-layer
checks. eyas numbers fused layers like HF `hidden_states`: id i is the *input* of layer i (the output of
layer i-1); id N is the decoder's output, which eyas takes *after* the final norm.
- SGLang / SpecForge: `eagle_aux_hidden_state_layer_ids` name layer *outputs*; SGLang adds 1 before
  capturing at the input of that layer, so foreign = ours - 1 (SpecForge writes [1, 29, 57] for a
  61-layer target whose defaults are our [2, 30, 58]).
- speculators / vLLM: the ids are HF hidden_states indices (vLLM captures index 0 before layer 0 and
  index k after layer k-1), so foreign = ours.
Neither runtime applies the final norm to id N, so a head fusing id N cannot be exported to them.
Foreign layouts carry no tokenizer fingerprint and no target layer count: a loaded head is checked
against its target by hidden size, vocab size and layer count (its deepest fused layer) only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..config import HeadConfig, TargetIdentity, default_fused_layer_ids
from ..errors import InputError


def fused_from_foreign(ids: Sequence[int] | None, offset: int, target, where: str) -> tuple[int, ...]:
    """eyas fused layer ids from a foreign config's aux ids (foreign = ours + offset), or the target's defaults."""
    if ids:
        return tuple(int(i) - offset for i in ids)
    if target is not None:
        return default_fused_layer_ids(target.num_layers)
    raise InputError(f"{where} does not record the fused target layers; load it with its target to use the "
                     "defaults (2, N//2, N-3)")


def foreign_ids(c: HeadConfig, offset: int, layout: str) -> list[int]:
    """The aux layer ids a runtime reads for head config `c`, refusing what it would capture differently."""
    if c.target is not None and c.target.num_hidden_layers in c.fused_layer_ids:
        raise InputError(
            f"the head fuses layer {c.target.num_hidden_layers}, the target's final *normed* state; {layout} captures "
            "that state before the final norm, so the exported head would see different features")
    return [i + offset for i in c.fused_layer_ids]


def identity(verifier: str, shape: dict[str, Any], fused: tuple[int, ...]) -> TargetIdentity:
    return TargetIdentity(name_or_path=verifier, hidden_size=shape["hidden_size"], vocab_size=shape["vocab_size"],
                          num_hidden_layers=max(fused, default=0), tokenizer_fingerprint="")


def check_target_width(raw: dict[str, Any], shape: dict[str, Any], where: str) -> None:
    target_hidden = raw.get("target_hidden_size")
    if target_hidden not in (None, shape["hidden_size"]):
        raise InputError(f"{where}: target_hidden_size {target_hidden} differs from hidden_size {shape['hidden_size']}; "
                         "eyas heads share the target's width")


def where(folder: Path, layout: str) -> str:
    return f"{folder / 'config.json'} ({layout} layout)"
