"""The draft vocabulary: the N target tokens most often trained on (loss-masked), as draft→target ids.

Stored as safetensors with a fingerprint of (tokenizer, data, N). A stored map is reused only
when all three match; otherwise `build_vocab_map` rebuilds it (saying why) and `load_vocab_map`
refuses, naming which part differs.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Union

import datasets
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from eyas.models.atomic import atomic_file
from eyas.models.errors import InputError
from eyas.models.target import tokenizer_fingerprint

logger = logging.getLogger(__name__)


@dataclass
class VocabMap:
    draft_to_target: torch.Tensor  # LongTensor [N], ascending target ids; feed to head.set_vocab_map
    coverage: float  # fraction of loss-masked training tokens whose target id is in the draft vocab
    fingerprint: str  # sha256 over the three parts below
    parts: dict[str, str]  # {"tokenizer", "data", "draft_vocab_size"}


class CountedRows(Protocol):
    """Rows that count their own tokens shard by shard (the offline hidden-state cache), instead of being read
    row by row as a datasets.Dataset."""

    def fingerprint(self) -> str: ...
    def token_counts(self, vocab_size: int) -> np.ndarray: ...


Rows = Union[datasets.Dataset, CountedRows]  # rows with input_ids and loss_mask


def data_fingerprint(dataset: Rows) -> str:
    """datasets' own content-chain fingerprint: equal for the same source, tokenizer and options (a cache: its own)."""
    if not isinstance(dataset, datasets.Dataset):
        return dataset.fingerprint()
    return f"{dataset._fingerprint}:{len(dataset)}"


def _parts(dataset: Rows, tokenizer: PreTrainedTokenizerBase, n: int) -> dict[str, str]:
    return {"tokenizer": tokenizer_fingerprint(tokenizer), "data": data_fingerprint(dataset),
            "draft_vocab_size": str(n)}


def _digest(parts: dict[str, str]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def token_counts(dataset: Rows, vocab_size: int, batch_size: int = 1000) -> np.ndarray:
    """[vocab_size] int64: how often each target id is a loss-masked (trained-on) token, counted batch by batch
    (memory: one batch of rows, never a list of every token)."""
    if not isinstance(dataset, datasets.Dataset):
        return dataset.token_counts(vocab_size)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in tqdm(dataset.iter(batch_size), total=-(-len(dataset) // batch_size), desc="counting tokens"):
        ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in batch["input_ids"]])
        mask = np.concatenate([np.asarray(x, dtype=bool) for x in batch["loss_mask"]])
        counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def coverage(dataset: Rows, draft_to_target: torch.Tensor, vocab_size: int) -> float:
    """Fraction of the loss-masked tokens of `dataset` that are in the draft vocabulary."""
    return _share(token_counts(dataset, vocab_size), draft_to_target.cpu().numpy())


def _share(counts: np.ndarray, ids: np.ndarray) -> float:
    """counts [V] per target id -> the fraction of all counted tokens that fall on `ids`."""
    total = int(counts.sum())
    return float(counts[ids].sum() / total) if total else 0.0


def build_vocab_map(dataset: Rows, tokenizer: PreTrainedTokenizerBase, draft_vocab_size: int,
                    cache_path: str | Path | None = None) -> VocabMap:
    """Top-`draft_vocab_size` loss-masked target tokens of `dataset` (rows: input_ids, loss_mask).

    Ties break towards the lower id; if fewer distinct tokens occur, unseen ids (lowest first)
    fill the rest so the map always has exactly N distinct ids.
    """
    vocab_size = len(tokenizer)
    if not 0 < draft_vocab_size <= vocab_size:
        raise InputError(f"a draft vocabulary of {draft_vocab_size} tokens does not fit the target's {vocab_size}; "
                         f"pick 1..{vocab_size} (--size, head.draft_vocab_size)")
    parts = _parts(dataset, tokenizer, draft_vocab_size)
    if cache_path is not None and Path(cache_path).is_file():
        stored = read_vocab_map(cache_path)
        stale = [k for k in parts if stored.parts.get(k) != parts[k]]
        if not stale:
            return stored
        logger.info("vocab map %s was built for a different %s; rebuilding", cache_path, ", ".join(stale))
    counts = token_counts(dataset, vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id asc
    chosen = np.sort(order[:draft_vocab_size])
    vm = VocabMap(torch.from_numpy(chosen).long(), _share(counts, chosen), _digest(parts), parts)
    if cache_path is not None:
        save_vocab_map(vm, cache_path)
    return vm


def save_vocab_map(vm: VocabMap, path: str | Path) -> None:
    meta = {"fingerprint": vm.fingerprint, "coverage": repr(vm.coverage),
            **{f"part.{k}": v for k, v in vm.parts.items()}}
    with atomic_file(path, "wb") as f:
        f.write(save({"draft_to_target": vm.draft_to_target.contiguous()}, metadata=meta))


def read_vocab_map(path: str | Path) -> VocabMap:
    """Read a stored map without checking what it was built for (see load_vocab_map)."""
    from safetensors import SafetensorError

    from eyas.models.errors import brief

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            ids = f.get_tensor("draft_to_target") if "draft_to_target" in f.keys() else None
    except (SafetensorError, OSError) as e:
        raise InputError(f"{path} is not a readable vocab map: truncated or corrupt ({brief(e)}); delete it (eyas "
                         "rebuilds it) or choose another path") from None
    if "fingerprint" not in meta or ids is None:
        raise InputError(f"{path} is not an eyas vocab map (no fingerprint)")
    parts = {k.removeprefix("part."): v for k, v in meta.items() if k.startswith("part.")}
    return VocabMap(ids, float(meta["coverage"]), meta["fingerprint"], parts)


def load_vocab_map(path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None,
                   draft_vocab_size: int | None = None, dataset: datasets.Dataset | None = None) -> VocabMap:
    """Read a stored map and refuse it if it was built for another tokenizer, size or data."""
    vm = read_vocab_map(path)
    expected = {}
    if tokenizer is not None:
        expected["tokenizer"] = tokenizer_fingerprint(tokenizer)
    if draft_vocab_size is not None:
        expected["draft_vocab_size"] = str(draft_vocab_size)
    if dataset is not None:
        expected["data"] = data_fingerprint(dataset)
    stale = [k for k, v in expected.items() if vm.parts.get(k) != v]
    if stale:
        raise InputError(f"vocab map {path} was built for a different {', '.join(stale)}; "
                         f"rebuild it with `eyas data vocab`")
    return vm
