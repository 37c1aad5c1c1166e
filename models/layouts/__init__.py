"""Head layouts: how a draft head is stored on disk, for eyas and for the runtimes that serve heads.

Each layout is a small module of its own, registered here by name: `eyas` (the native format), `zlab` (z-lab's
DFlash reference, which vLLM also serves), `speculators` (vLLM), `sglang` (SGLang / SpecForge, and the EAGLE-3
reference on import) and `eagle` (the EAGLE-1 reference). A layout knows how to recognise its config.json
(`detect`), read a head (`read`: config + weights in eyas naming) and write one (`write`) so that its runtime
computes what the head computes. Every layout loads directly (`load_head`, `--head`) and any head converts to any
layout that can hold it (`export_head`); a layout that cannot hold a head exactly refuses it, naming why.
docs/runtimes.md says which runtime version reads each layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from ..config import HeadConfig
from ..drafters.base import DraftHead
from ..errors import InputError, MissingInput
from .common import CONFIG_NAME, HEAD_FILES, read_config, stored_dtype


class Layout(Protocol):
    name: str

    def detect(self, raw: dict[str, Any]) -> bool:
        """Is this config.json in this layout?"""
        ...

    def read(self, folder: Path, raw: dict[str, Any], target) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
        """(HeadConfig, state dict in eyas naming) of the head in `folder`; `target` (optional) fills defaults."""
        ...

    def write(self, head: DraftHead, folder: Path, target=None) -> None:
        """Write `head` into the (empty, temporary) folder, or raise naming what this layout cannot hold.
        `target` (optional eyas Target) supplies what a runtime needs beyond the head (layer count, embedding)."""
        ...


LAYOUTS: dict[str, Layout] = {}


def register(layout: Layout) -> Layout:
    LAYOUTS[layout.name] = layout
    return layout


from . import eyas, zlab_dflash, speculators, sglang, eagle1  # noqa: E402,F401,I001  (each registers itself; detection tries them in this order)

FORMATS = tuple(LAYOUTS)


def detect_layout(raw: dict[str, Any]) -> str:
    """The name of the layout of a head's config.json."""
    for name, layout in LAYOUTS.items():
        if layout.detect(raw):
            return name
    archs = raw.get("architectures") or []
    raise InputError(
        f"unknown head layout (architectures={archs}): expected an eyas head (eyas_format), a z-lab DFlash head "
        "(DFlashDraftModel, dflash_config), a speculators head (speculators_model_type), an SGLang / EAGLE-3 "
        "reference head (LlamaForCausalLMEagle3, or LlamaForCausalLM with draft_vocab_size) or an EAGLE-1 reference "
        "head (LlamaForCausalLM)"
    )


def load_head(folder: str | Path, target=None, dtype: str | torch.dtype | None = None,
              device: str | torch.device | None = None) -> DraftHead:
    """Load a head in any registered layout; with `target`, check that it fits and bind it."""
    from ..target import resolve_dtype

    folder = Path(folder)
    raw = read_config(folder)
    config, state = LAYOUTS[detect_layout(raw)].read(folder, raw, target)
    head = DraftHead(config)
    _check_tensors(folder, head, state)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InputError(f"{folder}: weights do not fit the config (missing {missing}, unexpected {unexpected})")
    if dtype is not None:
        head.to(resolve_dtype(dtype))
    if device is not None:
        head.to(device)
    if target is not None:
        head.bind(target)
    return head


def _check_tensors(folder: Path, head: DraftHead, state: dict[str, torch.Tensor]) -> None:
    """Refuse weights that would fail to load or generate garbage: shapes other than the config's, NaN/inf values,
    a draft vocab map pointing outside the target vocabulary (it would fail mid-generation)."""
    expected = head.state_dict()
    wrong = [f"{k} {tuple(v.shape)} (config: {tuple(expected[k].shape)})" for k, v in state.items()
             if k in expected and v.shape != expected[k].shape]
    if wrong:
        raise InputError(f"{folder}: weight shapes do not match its {CONFIG_NAME}: {', '.join(wrong[:3])}"
                         f"{', ...' if len(wrong) > 3 else ''}; the config is not the one saved with these weights")
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise InputError(f"{folder}: {', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''} hold NaN or inf "
                         "(non-finite) values; the head is broken: export it again from a good checkpoint, or retrain")
    if "d2t" in state and state["d2t"].numel():
        ids = torch.arange(state["d2t"].numel()) + state["d2t"].long()
        vocab = head.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            far = int(ids.max()) if int(ids.max()) >= vocab else int(ids.min())
            raise InputError(f"{folder}: its draft vocab map (d2t) points past the target vocabulary of {vocab} tokens "
                             f"(id {far}); rebuild it with `eyas data vocab` and retrain, or export the head again")


def save_head(head: DraftHead, folder: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write `head` atomically in eyas's own layout; `extra` adds informational keys to config.json."""
    return LAYOUTS["eyas"].save(head, folder, extra)


def export_head(source: str | Path, out: str | Path, format: str = "eyas", target=None, force: bool = False) -> Path:
    """Write the head in `source` (a head folder in any layout, or a training checkpoint holding `head/`) as `format`.

    Written atomically; weights keep the source's floating-point dtype. `target` (an eyas Target) is checked
    against the head, and needed only for foreign EAGLE-3 heads that do not record their fused layers.
    An existing `out` is replaced only if it holds a head and nothing else, or with `force`.
    """
    from ..atomic import atomic_folder

    if format not in LAYOUTS:
        raise InputError(f"unknown export format {format!r}; choose one of {', '.join(LAYOUTS)}")
    folder = head_folder(Path(source))
    head = load_head(folder, target)
    head.to(stored_dtype(folder))
    scale = getattr(target.embed_tokens, "embed_scale", None) if target is not None else None
    if format != "eyas" and scale is not None and float(scale) != 1.0:
        raise InputError(f"target {target.name_or_path!r} scales its token embedding (embed_scale {float(scale):g}); "
                         f"the head reads the scaled embedding, while runtimes feed drafters the raw table: {format} "
                         "would draft differently from the head; keep it in the eyas format")
    with atomic_folder(out, HEAD_FILES, force) as tmp:
        LAYOUTS[format].write(head, tmp, target)
    return Path(out)


def head_folder(source: Path) -> Path:
    """A head folder, or the head/ folder of a training checkpoint."""
    if (source / CONFIG_NAME).is_file():
        return source
    if (source / "head" / CONFIG_NAME).is_file():  # a training checkpoint: the trainer writes the head there
        return source / "head"
    raise MissingInput(f"{source} is neither a head folder ({CONFIG_NAME}) "
                       f"nor a training checkpoint (head/{CONFIG_NAME})")
