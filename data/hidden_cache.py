"""Offline hidden-state cache: what a head needs from the frozen target, computed once.

Per token it stores input_ids, loss_mask, the final normed hidden state [H] (both head types:
the trainer gets target logits from it through the lm_head) and, for EAGLE-3, the fused layer
features [len(layer_ids) * H], in bf16/fp16. Layout of a cache folder:

    index.json                 target identity, layer ids, dtype, source fingerprint, shards
    shard-00000.safetensors    input_ids [N] int32, loss_mask [N] int8, offsets [n+1] int64,
                               hidden [N, H], features [N, F] (N = tokens of the shard's n examples)

Shards hold consecutive examples and are written atomically, then listed in index.json, so a
killed run resumes at the first missing shard. Reading is memory-mapped (safetensors safe_open).
"""

from __future__ import annotations

import bisect
import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import datasets
import torch
from safetensors import safe_open
from safetensors.torch import save
from tqdm.auto import tqdm

from eyas.models.atomic import atomic_file
from eyas.models.target import Target, resolve_dtype

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
    out = target(ids.to(target.device), attention_mask=pad.to(target.device), layer_ids=layer_ids, logits=False)
    return [(out.hidden[i, : len(r)], None if out.features is None else out.features[i, : len(r)])
            for i, r in enumerate(rows)]


def cache_hidden(target: Target, dataset: datasets.Dataset, folder: str | Path, layer_ids: Sequence[int] = (),
                 dtype: str | torch.dtype = "bf16", batch_size: int = 8, shard_examples: int = 512) -> Path:
    """Compute and store the target states for `dataset` (rows: input_ids, loss_mask); resumable.

    layer_ids: the EAGLE-3 fused layer ids (empty for EAGLE-1, which needs only the hidden state).
    A folder holding a cache of something else (other target, layers, dtype or data) is refused.
    """
    folder = Path(folder)
    store = resolve_dtype(dtype)
    meta = {
        "version": 1, "target": asdict(target.identity()), "layer_ids": list(layer_ids), "dtype": _STORAGE[store],
        "hidden_size": target.hidden_size, "data": f"{dataset._fingerprint}:{len(dataset)}",
        "num_examples": len(dataset), "shard_examples": shard_examples,
    }
    index = {**meta, "shards": [], "complete": False}
    if (folder / INDEX).is_file():
        old = json.loads((folder / INDEX).read_text())
        differs = [k for k in meta if old.get(k) != meta[k]]
        if differs:
            raise ValueError(f"{folder} holds a hidden-state cache for a different {', '.join(differs)}; "
                             "choose another folder or delete it")
        index = old
    num_shards = -(-len(dataset) // shard_examples)
    done = len(index["shards"])
    lengths = [len(x) for x in dataset["input_ids"]]
    todo_tokens = sum(lengths[done * shard_examples:])
    need = todo_tokens * bytes_per_token(target.hidden_size, len(layer_ids), store)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    print(f"hidden-state cache {folder}: {todo_tokens:,} tokens to store "
          f"({len(dataset) - min(len(dataset), done * shard_examples)} of {len(dataset)} examples), "
          f"~{need / 1e9:.2f} GB ({bytes_per_token(target.hidden_size, len(layer_ids), store):,} bytes/token); "
          f"{free / 1e9:.1f} GB free")
    if need > free:
        raise ValueError(f"the hidden-state cache needs ~{need / 1e9:.1f} GB but {folder} has {free / 1e9:.1f} GB free")
    bar = tqdm(total=todo_tokens, unit="tok", desc="caching hidden states")
    for s in range(done, num_shards):
        lo, hi = s * shard_examples, min(len(dataset), (s + 1) * shard_examples)
        rows = dataset.select(range(lo, hi))
        ids, masks = rows["input_ids"], rows["loss_mask"]
        hidden: list = [None] * len(ids)
        features: list = [None] * len(ids)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths batch with little padding
        for b in range(0, len(order), batch_size):
            chunk = order[b: b + batch_size]
            for i, (h, f) in zip(chunk, _run_batch(target, [ids[i] for i in chunk], layer_ids)):
                hidden[i], features[i] = h.to(store), None if f is None else f.to(store)
            bar.update(sum(len(ids[i]) for i in chunk))
        tensors = {
            "input_ids": torch.tensor([t for r in ids for t in r], dtype=torch.int32),
            "loss_mask": torch.tensor([m for r in masks for m in r], dtype=torch.int8),
            "offsets": torch.tensor([0] + lengths[lo:hi], dtype=torch.int64).cumsum(0),
            "hidden": torch.cat(hidden).cpu().contiguous(),
        }
        if layer_ids:
            tensors["features"] = torch.cat(features).cpu().contiguous()
        with atomic_file(folder / _shard_name(s), "wb") as f:
            f.write(save(tensors))
        index["shards"].append({"file": _shard_name(s), "first": lo, "count": hi - lo})
        index["complete"] = s == num_shards - 1
        with atomic_file(folder / INDEX) as f:
            json.dump(index, f, indent=1)
    bar.close()
    return folder


class HiddenStateDataset(torch.utils.data.Dataset):
    """Memory-mapped reader: item i = {input_ids [T], loss_mask [T], hidden [T, H], features [T, F]?}."""

    def __init__(self, folder: str | Path, target: Target | None = None) -> None:
        self.folder = Path(folder)
        if not (self.folder / INDEX).is_file():
            raise FileNotFoundError(f"{self.folder} is not a hidden-state cache (no {INDEX})")
        self.index = json.loads((self.folder / INDEX).read_text())
        if not self.index["complete"]:
            done = sum(s["count"] for s in self.index["shards"])
            raise ValueError(f"hidden-state cache {self.folder} is incomplete ({done} of "
                             f"{self.index['num_examples']} examples); rerun `eyas data cache-hidden` to finish it")
        if target is not None and self.index["target"]["tokenizer_fingerprint"] != target.identity().tokenizer_fingerprint:
            raise ValueError(f"hidden-state cache {self.folder} was computed by another target "
                             f"({self.index['target']['name_or_path']})")
        self.layer_ids: list[int] = self.index["layer_ids"]
        self._firsts = [s["first"] for s in self.index["shards"]]
        self._files: dict[int, object] = {}

    def __len__(self) -> int:
        return self.index["num_examples"]

    def _shard(self, s: int):
        if s not in self._files:  # opened lazily, so DataLoader workers each get their own handles
            self._files[s] = safe_open(str(self.folder / self.index["shards"][s]["file"]), framework="pt")
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

    def __getstate__(self) -> dict:  # safetensors handles do not pickle; reopen in the worker
        return {**self.__dict__, "_files": {}}
