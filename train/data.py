"""Training examples in a deterministic order that does not depend on the number of processes.

The training split is read as an endless stream of per-epoch permutations (seeded by seed+epoch).
An optimizer step consumes the next `batch.size * processes * grad_accum` stream positions: micro-batch
a of rank r takes positions [a*size*world + r*size, +size). The trainer only stores how many
positions were consumed, so a resumed run, at the same or another world size, continues exactly
where the last one stopped, and a 2-process step sees the same examples as a 1-process step with
the doubled batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from eyas.data.examples import split_indices

from .config import DataConfig


class Examples(Protocol):
    """A datasets.Dataset (columns input_ids, loss_mask) or the data layer's HiddenStateDataset."""

    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> dict[str, Any]: ...


def load_examples(config: DataConfig, target, seed: int) -> tuple[Examples, Examples, str]:
    """(train, held_out, summary line). Online: tokenized conversations; offline: the hidden-state cache
    (items also carry `hidden` and, for EAGLE-3, `features`). Both are split by `split_indices`, so a
    cache built from the same examples gives an offline run the same train/held-out rows as online."""
    if config.hidden_states == "offline":
        from eyas.data.hidden_cache import HiddenStateDataset

        cache = HiddenStateDataset(config.cache_dir, target)
        train_idx, held_idx = split_indices(len(cache), config.held_out, seed)
        return Subset(cache, train_idx), Subset(cache, held_idx), f"{len(cache)} cached examples in {config.cache_dir}"
    examples, skips = _tokenized(config, config.source, target.tokenizer, field_map=config.field_map, limit=config.limit)
    train_idx, held_idx = split_indices(len(examples), config.held_out, seed)
    return examples.select(train_idx), examples.select(held_idx), str(skips)


class Subset:
    """Rows `index` of the offline cache (which, unlike a datasets.Dataset, has no .select)."""

    def __init__(self, examples: Examples, index: list[int]) -> None:
        self.examples, self.index = examples, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.examples[self.index[i]]

    @property
    def layer_ids(self) -> list[int]:
        return self.examples.layer_ids

    def token_rows(self):
        """The rows' input_ids and loss_mask as a datasets.Dataset (the cache's `token_rows`, selected)."""
        return self.examples.token_rows().select(self.index)


class ExampleStream:
    """Endless seeded epochs over `examples`; positions are global stream offsets."""

    def __init__(self, examples: Examples, seed: int, shuffle: bool = True) -> None:
        if len(examples) == 0:
            raise ValueError("no training examples (check data.source, data.limit and data.held_out)")
        self.examples, self.seed, self.shuffle = examples, seed, shuffle
        self._epoch, self._order = -1, None

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.examples))
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            n = len(self.examples)
            self._order = torch.randperm(n, generator=gen).tolist() if self.shuffle else list(range(n))
            self._epoch = epoch
        return self._order[offset]

    def rows(self, start: int, count: int) -> list[dict[str, Any]]:
        return [self.examples[self._index(p)] for p in range(start, start + count)]


def micro_batch_start(consumed: int, micro: int, rank: int, size: int, world: int) -> int:
    """Stream position of micro-batch `micro` of `rank` in the step that begins at `consumed`."""
    return consumed + micro * size * world + rank * size


def collate(rows: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row. -> input_ids, loss_mask, attention_mask [B, T] (+ features
    [B, T, F] and hidden [B, T, H] for cached rows)."""
    t = max(len(r["input_ids"]) for r in rows)
    b = len(rows)
    out = {"input_ids": torch.full((b, t), pad_id, dtype=torch.long),
           "loss_mask": torch.zeros(b, t, dtype=torch.bool),
           "attention_mask": torch.zeros(b, t, dtype=torch.bool)}
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        out["input_ids"][i, :n] = torch.as_tensor(r["input_ids"])
        out["loss_mask"][i, :n] = torch.as_tensor(r["loss_mask"]).bool()
        out["attention_mask"][i, :n] = True
    for key in ("features", "hidden"):
        if key in rows[0]:
            first = torch.as_tensor(rows[0][key])
            out[key] = first.new_zeros(b, t, first.shape[-1])
            for i, r in enumerate(rows):
                v = torch.as_tensor(r[key])
                out[key][i, : v.shape[0]] = v
    return out


def draft_vocab(config, target, train_set, size: int, accelerator, log: Callable[[str], None]) -> torch.Tensor:
    """The EAGLE-3 draft vocabulary of the run (draft id -> target id, [size]): the `size` most trained-on target
    tokens of the training data, or of `data.vocab_source`; its coverage of the training targets is logged."""
    from eyas.data.vocab import build_vocab_map, coverage

    d = config.data
    train_rows = train_set.token_rows() if d.hidden_states == "offline" else train_set  # the cache: tokens only
    with accelerator.main_process_first():  # the main process tokenizes (a vocab_source) and caches first
        counted = train_rows if d.vocab_source is None else vocab_source_rows(d, target.tokenizer)
        vocab = build_vocab_map(counted, target.tokenizer, size, vocab_cache_path(d, config.output_dir))
    if counted is train_rows:
        covered, counted_on = vocab.coverage, ""
    else:
        covered = coverage(train_rows, vocab.draft_to_target, len(target.tokenizer))
        counted_on = f" (counted on {d.vocab_source}: {vocab.coverage:.1%} there)"
    log(f"draft vocab: {size} tokens cover {covered:.1%} of training targets{counted_on}")
    return vocab.draft_to_target


def vocab_cache_path(config: DataConfig, output_dir: str) -> Path:
    return Path(config.vocab_cache) if config.vocab_cache else Path(output_dir) / "vocab_map.safetensors"


def vocab_source_rows(config: DataConfig, tokenizer):
    """Every row (input_ids, loss_mask) of `vocab_source`, read with the data layer's default field names and
    tokenized like the training data: what the draft vocab is counted on instead of the training set."""
    return _tokenized(config, config.vocab_source, tokenizer)[0]


def _tokenized(config: DataConfig, source: str, tokenizer, field_map: dict[str, str] | None = None,
               limit: int | None = None):
    """`source` through the data layer with the config's template options: (examples, skip counts)."""
    from eyas.data import build_examples

    return build_examples(source, tokenizer, max_length=config.max_length, assistant_turns=config.assistant_turns,
                          field_map=field_map, limit=limit, num_proc=config.num_proc if config.num_proc > 1 else None)
