"""Conversations → training examples for one target: token ids and an assistant-only loss mask.

Truncation policy: a rendered conversation longer than `max_length` tokens keeps its first
`max_length` tokens (system prompt and early turns are context the later turns depend on);
if no loss-masked token survives the cut, the row is skipped as "too_long".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, Sequence

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from eyas.models.errors import InputError

from .chat_template import TemplateError, render_with_mask
from .sources import REASONS, FieldMap, SourceInfo, load_conversations

SKIP_REASONS = REASONS + ("template_error", "too_long")
EXAMPLE_FEATURES = datasets.Features({
    "input_ids": datasets.Sequence(datasets.Value("int32")),
    "loss_mask": datasets.Sequence(datasets.Value("int8")),
    "skip": datasets.Value("string"),
})


@dataclass
class SkipSummary:
    """How many rows were read, kept, and skipped per reason."""

    total: int
    kept: int
    skipped: dict[str, int] = field(default_factory=dict)
    source: SourceInfo | None = None

    def __str__(self) -> str:
        head = f"{self.source}\n" if self.source else ""
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) or "none"
        return f"{head}kept {self.kept} of {self.total} rows; skipped {self.total - self.kept} ({reasons})"


def _example(row: dict, tokenizer: PreTrainedTokenizerBase, max_length: int, last_only: bool,
             eos_ids: Sequence[int] | None) -> dict:
    empty = {"input_ids": [], "loss_mask": []}
    if row["problem"]:
        return {**empty, "skip": row["problem"]}
    try:
        r = render_with_mask(tokenizer, row["messages"], last_only, eos_ids, max_tokens=max_length)
    except TemplateError:
        return {**empty, "skip": "template_error"}
    if not any(r.loss_mask):  # sources guarantee a non-empty assistant turn, so it was cut off
        return {**empty, "skip": "too_long"}
    return {"input_ids": r.input_ids, "loss_mask": r.loss_mask, "skip": ""}


def build_examples(
    source: str | datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int = 2048,
    assistant_turns: Literal["all", "last"] = "all",
    field_map: FieldMap | dict | str | None = None,
    limit: int | None = None,
    num_proc: int | None = None,
    eos_ids: Sequence[int] | None = None,
) -> tuple[datasets.Dataset, SkipSummary]:
    """Tokenize a source with the tokenizer's chat template.

    source: a spec for `load_conversations` ("sharegpt", a file or folder) or a dataset in its
    canonical schema. Returns (dataset with columns input_ids: list[int], loss_mask: list[int]
    (1 = assistant token, the training target), summary). Raises ValueError if no row is usable.
    eos_ids: token ids that end an assistant turn (default: the tokenizer's eos).
    """
    if assistant_turns not in ("all", "last"):
        raise InputError(f"assistant_turns must be 'all' or 'last', got {assistant_turns!r}")
    if max_length < 2:
        raise InputError(f"max_length must be at least 2, got {max_length}")
    info = None
    if isinstance(source, str):
        source, info = load_conversations(source, field_map, num_proc=num_proc)
    if limit is not None:
        source = source.select(range(min(limit, len(source))))
    if len(source) == 0:
        raise InputError(f"data source {info.name if info else ''} has no rows")
    ds = source.map(_example, fn_kwargs=dict(tokenizer=tokenizer, max_length=max_length,
                                             last_only=assistant_turns == "last", eos_ids=eos_ids),
                    remove_columns=source.column_names, features=EXAMPLE_FEATURES, num_proc=num_proc,
                    desc="tokenizing conversations")
    reasons = Counter(ds["skip"])
    kept = reasons.pop("", 0)
    summary = SkipSummary(total=len(ds), kept=kept, skipped=dict(reasons), source=info)
    if kept == 0:
        reasons = "; ".join(line.strip() for line in str(summary).splitlines())
        raise InputError(f"data source {info.name if info else ''}: no usable rows ({reasons})")
    if reasons:
        ds = ds.filter(lambda s: s == "", input_columns="skip", num_proc=num_proc, desc="dropping skipped rows")
    return ds.remove_columns("skip"), summary


def split_indices(n: int, held_out: float | int, seed: int) -> tuple[list[int], list[int]]:
    """Seeded (train, held-out) row indices, both ascending; held_out is a fraction (< 1) or a row count.

    The one split of eyas: `eyas data prepare` and `eyas train` (online or from a hidden-state cache of the
    same rows) hold out the same rows for the same seed."""
    count = int(held_out) if held_out >= 1 else round(held_out * n)
    if held_out > 0:
        count = max(count, 1)
    if not 0 <= count < n:
        raise InputError(f"held_out={held_out} leaves no training rows out of {n}; lower it")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[count:]), sorted(order[:count])


def split_examples(dataset: datasets.Dataset, held_out: float | int = 0.02,
                   seed: int = 0) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Deterministic (train, held_out) datasets by seed (`split_indices`)."""
    train, held = split_indices(len(dataset), held_out, seed)
    return dataset.select(train), dataset.select(held)
