"""Offline hidden-state cache: what a head needs from the frozen target, computed once.

Per token it stores input_ids, loss_mask, the final normed hidden state [H] (both head types:
the trainer gets target logits from it through the lm_head) and, for EAGLE-3, the fused layer
features [len(layer_ids) * H], in bf16/fp16. Layout of a cache folder:

    index.json                 target identity, layer ids, dtype, source fingerprint, shards
    shard-00000.safetensors    input_ids [N] int32, loss_mask [N] int8, offsets [n+1] int64,
                               hidden [N, H], features [N, F] (N = tokens of the shard's n examples)

Shards hold consecutive examples and are written atomically, then listed in index.json, so a
killed run resumes at the first missing shard. Reading is memory-mapped (safetensors safe_open).
A cache written during regeneration (regen_store.py) also stores each shard's dataset ids ("ids"
[n] int64) and its JSONL lines (header metadata), which make the cache the source of truth.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import datasets
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save
from tqdm.auto import tqdm

from eyas.models.atomic import atomic_file, make_folder
from eyas.models.errors import InputError, MissingInput
from eyas.models.target import Target, resolve_dtype

logger = logging.getLogger(__name__)

INDEX = "index.json"
_STORAGE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def bytes_per_token(hidden_size: int, num_layers: int, dtype: torch.dtype) -> int:
    """Stored bytes per token: hidden + fused features + int32 id + int8 mask."""
    return hidden_size * (1 + num_layers) * dtype.itemsize + 5


def _shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def _run_batch(target: Target, rows: list[list[int]], layer_ids: Sequence[int]):
    """Right-padded batch → per-row (hidden [T, H], features [T, F] | None) of the real tokens."""
    t = max(map(len, rows))
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    pad = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        pad[i, : len(r)] = True
    out = target(ids.to(target.device), padding_mask=pad.to(target.device), layer_ids=layer_ids, logits=False)
    return [(out.hidden[i, : len(r)], None if out.features is None else out.features[i, : len(r)])
            for i, r in enumerate(rows)]


class CacheWriter:
    """Appends shards to a cache folder: each shard is written atomically, then listed in index.json.

    `provenance` (what the examples come from) joins the target, layers and dtype in index.json; a
    folder already holding a cache whose any of these differ is refused. Shards may carry the
    dataset ids of their examples ("ids" [n] int64) and string metadata (safetensors header).
    """

    def __init__(self, folder: str | Path, target: Target, layer_ids: Sequence[int], dtype: str | torch.dtype,
                 provenance: dict) -> None:
        self.folder = Path(folder)
        self.dtype = resolve_dtype(dtype)
        if self.dtype not in _STORAGE:
            raise InputError(f"storage dtype must be one of {sorted(_STORAGE.values())}, got {dtype!r}")
        self.layer_ids = tuple(layer_ids)
        meta = {"version": 1, "target": asdict(target.identity()), "layer_ids": list(layer_ids),
                "dtype": _STORAGE[self.dtype], "hidden_size": target.hidden_size, **provenance}
        self.index = {**meta, "num_examples": 0, "shards": [], "complete": False}
        if (self.folder / INDEX).is_file():
            old = json.loads((self.folder / INDEX).read_text())
            differs = [k for k in meta if old.get(k) != meta[k]]
            if differs:
                raise InputError(f"{self.folder} holds a hidden-state cache for a different {', '.join(differs)}; "
                                 "choose another folder or delete it")
            self.index = old
            kept = _readable_prefix(self.folder, old["shards"])
            if len(kept) < len(old["shards"]):
                self.index = {**old, "shards": kept, "num_examples": sum(s["count"] for s in kept), "complete": False}
        make_folder(self.folder)

    @property
    def written(self) -> int:
        """Examples already stored."""
        return sum(s["count"] for s in self.index["shards"])

    def bytes_per_token(self) -> int:
        return bytes_per_token(self.index["hidden_size"], len(self.layer_ids), self.dtype)

    def write(self, input_ids: list[list[int]], loss_mask: list[list[int]], hidden: list[torch.Tensor],
              features: list[torch.Tensor | None], ids: list[int] | None = None,
              metadata: dict[str, str] | None = None) -> None:
        """One shard of n examples: per example ids/mask [T] and hidden [T, H], features [T, F] (EAGLE-3)."""
        tensors = {
            "input_ids": torch.tensor([t for r in input_ids for t in r], dtype=torch.int32),
            "loss_mask": torch.tensor([m for r in loss_mask for m in r], dtype=torch.int8),
            "offsets": torch.tensor([0] + [len(r) for r in input_ids], dtype=torch.int64).cumsum(0),
            "hidden": torch.cat([h.to(self.dtype) for h in hidden]).cpu().contiguous(),
        }
        if self.layer_ids:
            tensors["features"] = torch.cat([f.to(self.dtype) for f in features]).cpu().contiguous()
        if ids is not None:
            tensors["ids"] = torch.tensor(ids, dtype=torch.int64)
        name = _shard_name(len(self.index["shards"]))
        with atomic_file(self.folder / name, "wb") as f:
            f.write(save(tensors, metadata))
        self.index["shards"].append({"file": name, "first": self.written, "count": len(input_ids)})
        self.index["num_examples"] = self.written
        self.index["complete"] = False
        self._write_index()

    def finish(self) -> None:
        """Mark the cache complete (readable by HiddenStateDataset)."""
        self.index["complete"] = True
        self._write_index()

    def _write_index(self) -> None:
        with atomic_file(self.folder / INDEX) as f:
            json.dump(self.index, f, indent=1)


def _open_shard(folder: Path, name: str):
    """safe_open of one shard, or an InputError naming it (missing, truncated or corrupt) and the fix."""
    from safetensors import SafetensorError

    from eyas.models.errors import brief

    try:
        return safe_open(str(folder / name), framework="pt")
    except (SafetensorError, OSError) as e:
        raise InputError(f"hidden-state cache shard {folder / name} is missing, truncated or corrupt ({brief(e)}); "
                         "rerun the command that wrote the cache (`eyas data cache-hidden` recomputes it from there)"
                         ) from None


def _readable_prefix(folder: Path, shards: list[dict]) -> list[dict]:
    """The shards before the first one that cannot be read (a disk fault, a copy cut short)."""
    for n, s in enumerate(shards):
        try:
            _open_shard(folder, s["file"])
        except InputError as e:
            logger.warning("%s: recomputing it and the %d shards after it", e, len(shards) - n - 1)
            return shards[:n]
    return shards


def stored_shards(folder: str | Path) -> list[tuple[list[int], dict[str, str]]]:
    """(dataset ids, header metadata) of every shard listed in the cache's index, in order."""
    folder = Path(folder)
    out = []
    if not (folder / INDEX).is_file():
        return out
    for s in json.loads((folder / INDEX).read_text())["shards"]:
        with _open_shard(folder, s["file"]) as f:
            ids = f.get_tensor("ids").tolist() if "ids" in f.keys() else []
            out.append((ids, f.metadata() or {}))
    return out


def append_cache(dest: str | Path, source: str | Path) -> int:
    """Add the examples of the complete cache `source` that `dest` does not hold yet (by the shards' dataset ids)
    to `dest` (created with source's metadata if missing; refused if that differs), shard by shard: each shard file
    is linked (or copied) under dest's next shard name, then listed in dest's index.json. Rerunning after a kill
    adds only what is missing. Returns the examples added. `source` is left as it was."""
    dest, source = Path(dest), Path(source)
    src = json.loads((source / INDEX).read_text())
    if not src["complete"]:
        raise InputError(f"hidden-state cache {source} is incomplete; finish the run that writes it first")
    meta = {k: v for k, v in src.items() if k not in ("num_examples", "shards", "complete")}
    index = {**meta, "num_examples": 0, "shards": [], "complete": False}
    if (dest / INDEX).is_file():
        index = json.loads((dest / INDEX).read_text())
        differs = [k for k in meta if index.get(k) != meta[k]]
        if differs:
            raise InputError(f"{dest} holds a hidden-state cache for a different {', '.join(differs)} than {source}")
    make_folder(dest)
    have = {i for ids, _ in stored_shards(dest) for i in ids}
    added = 0
    for shard, (ids, _) in zip(src["shards"], stored_shards(source)):
        if ids and set(ids) <= have:
            continue  # added by an earlier, interrupted merge
        name = _shard_name(len(index["shards"]))
        (dest / name).unlink(missing_ok=True)  # left by a kill between link and index
        try:
            os.link(source / shard["file"], dest / name)
        except OSError:  # another file system
            shutil.copyfile(source / shard["file"], dest / name)
        index["shards"].append({"file": name, "first": index["num_examples"], "count": shard["count"]})
        index["num_examples"] += shard["count"]
        added += shard["count"]
        with atomic_file(dest / INDEX) as f:
            json.dump(index, f, indent=1)
    index["complete"] = True
    with atomic_file(dest / INDEX) as f:
        json.dump(index, f, indent=1)
    return added


def cache_hidden(target: Target, dataset: datasets.Dataset, folder: str | Path, layer_ids: Sequence[int] = (),
                 dtype: str | torch.dtype = "bf16", batch_size: int = 8, shard_examples: int = 512) -> Path:
    """Compute and store the target states for `dataset` (rows: input_ids, loss_mask); resumable.

    layer_ids: the EAGLE-3 fused layer ids (empty for EAGLE-1, which needs only the hidden state).
    A folder holding a cache of something else (other target, layers, dtype or data) is refused.
    """
    writer = CacheWriter(folder, target, layer_ids, dtype, {
        "data": f"{dataset._fingerprint}:{len(dataset)}", "shard_examples": shard_examples})
    done = writer.written
    lengths = [len(x) for x in dataset["input_ids"]]
    todo_tokens = sum(lengths[done:])
    need = todo_tokens * writer.bytes_per_token()
    free = shutil.disk_usage(writer.folder).free
    logger.info("hidden-state cache %s: %s tokens to store (%d of %d examples), ~%.2f GB (%s bytes/token); "
                "%.1f GB free", writer.folder, f"{todo_tokens:,}", len(dataset) - done, len(dataset), need / 1e9,
                f"{writer.bytes_per_token():,}", free / 1e9)
    if need > free:
        raise InputError(f"the hidden-state cache needs ~{need / 1e9:.1f} GB but {writer.folder} has "
                         f"{free / 1e9:.1f} GB free")
    bar = tqdm(total=todo_tokens, unit="tok", desc="caching hidden states")
    for lo in range(done, len(dataset), shard_examples):
        rows = dataset.select(range(lo, min(len(dataset), lo + shard_examples)))
        ids, masks = rows["input_ids"], rows["loss_mask"]
        hidden: list = [None] * len(ids)
        features: list = [None] * len(ids)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths batch with little padding
        for b in range(0, len(order), batch_size):
            chunk = order[b: b + batch_size]
            for i, (h, f) in zip(chunk, _run_batch(target, [ids[i] for i in chunk], layer_ids)):
                hidden[i], features[i] = h.to(writer.dtype), None if f is None else f.to(writer.dtype)
            bar.update(sum(len(ids[i]) for i in chunk))
        writer.write(ids, masks, hidden, features)
    writer.finish()
    bar.close()
    return writer.folder


class HiddenStateDataset(torch.utils.data.Dataset):
    """Memory-mapped reader: item i = {input_ids [T], loss_mask [T], hidden [T, H], features [T, F]?}."""

    def __init__(self, folder: str | Path, target: Target | None = None) -> None:
        self.folder = Path(folder)
        if not (self.folder / INDEX).is_file():
            raise MissingInput(f"{self.folder} is not a hidden-state cache (no {INDEX})")
        self.index = json.loads((self.folder / INDEX).read_text())
        if not self.index["complete"]:
            raise InputError(f"hidden-state cache {self.folder} is incomplete ({self.index['num_examples']} examples "
                             "so far); rerun the command that wrote it (`eyas data cache-hidden` or `eyas data "
                             "regenerate --cache-hidden`) to finish it")
        fingerprint = self.index["target"]["tokenizer_fingerprint"]
        if target is not None and fingerprint != target.identity().tokenizer_fingerprint:
            raise InputError(f"hidden-state cache {self.folder} was computed by another target "
                             f"({self.index['target']['name_or_path']})")
        self.layer_ids: list[int] = self.index["layer_ids"]
        self._firsts = [s["first"] for s in self.index["shards"]]
        self._files: dict[int, object] = {}
        for s in range(len(self._firsts)):  # headers only: a damaged shard is named now, not mid-training
            self._shard(s)
        self._files = {}  # DataLoader workers open their own

    def __len__(self) -> int:
        return self.index["num_examples"]

    def _shard(self, s: int):
        if s not in self._files:  # opened lazily, so DataLoader workers each get their own handles
            self._files[s] = _open_shard(self.folder, self.index["shards"][s]["file"])
        return self._files[s]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = bisect.bisect_right(self._firsts, i) - 1
        f = self._shard(s)
        k = i - self._firsts[s]
        a, b = f.get_slice("offsets")[k: k + 2].tolist()
        item = {"input_ids": f.get_slice("input_ids")[a:b].long(), "loss_mask": f.get_slice("loss_mask")[a:b].long(),
                "hidden": f.get_slice("hidden")[a:b]}
        if self.layer_ids:
            item["features"] = f.get_slice("features")[a:b]
        return item

    def fingerprint(self, index: Sequence[int] | None = None) -> str:
        """Names what the cache (or its rows `index`) holds: a vocab map counted on it is reused only for it."""
        digest = hashlib.sha256(json.dumps(self.index, sort_keys=True).encode())
        if index is not None:
            digest.update(np.asarray(index, dtype=np.int64).tobytes())
        return f"hidden-cache-{digest.hexdigest()[:32]}:{len(self) if index is None else len(index)}"

    def lengths(self) -> np.ndarray:
        """[num_examples] tokens per example, from the shards' offsets (no states read)."""
        return np.concatenate([np.diff(self._shard(s).get_tensor("offsets").numpy())
                               for s in range(len(self.index["shards"]))] or [np.zeros(0, np.int64)])

    def token_counts(self, vocab_size: int, index: Sequence[int] | None = None) -> np.ndarray:
        """[vocab_size] int64: loss-masked tokens per target id over every example (or the examples `index`),
        counted shard by shard with bincount: memory is one shard's token ids, whatever the cache's size."""
        chosen = None
        if index is not None:
            chosen = np.zeros(len(self), dtype=bool)
            chosen[np.asarray(index, dtype=np.int64)] = True
        counts = np.zeros(vocab_size, dtype=np.int64)
        for s, shard in enumerate(self.index["shards"]):
            f = self._shard(s)
            ids, mask = f.get_tensor("input_ids").numpy(), f.get_tensor("loss_mask").numpy().astype(bool)
            if chosen is not None:  # each example's selection spread over its tokens
                per_example = chosen[shard["first"]: shard["first"] + shard["count"]]
                mask &= np.repeat(per_example, np.diff(f.get_tensor("offsets").numpy()))
            counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
        return counts

    def __getstate__(self) -> dict:  # safetensors handles do not pickle; reopen in the worker
        return {**self.__dict__, "_files": {}}
