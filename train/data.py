"""Training examples in a deterministic order that does not depend on the number of processes.

The training split is read as an endless stream of per-epoch permutations (seeded by seed+epoch).
An optimizer step consumes the next `batch.size * processes * grad_accum` stream positions: micro-batch
a of rank r takes positions [a*size*world + r*size, +size). The trainer only stores how many
positions were consumed, so a resumed run, at the same or another world size, continues exactly
where the last one stopped, and a 2-process step sees the same examples as a 1-process step with
the doubled batch. With `batch.group_by_length`, a step's examples are first sorted by length, so each
micro-batch holds examples of similar length (less padding); the step's set of examples is the same.

Batches are built by a torch DataLoader (worker processes, pinned memory on a GPU) from `StepSampler`, which
yields this rank's micro-batches in that order starting at any stream position.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from eyas.data.examples import split_indices
from eyas.models.errors import ConfigError, InputError

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
    examples, skips = _tokenized(config, config.source, target.tokenizer, field_map=config.field_map,
                                 limit=config.limit)
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

    def reader(self, reads: tuple[int, ...], num_layers: int, folder: str) -> Callable[[dict], torch.Tensor]:
        """A function from a cached batch to the states a head reading `reads` needs, [B, T, len(reads) * H]: the
        final hidden state (id num_layers), which every cache holds, and any of the fused layers it holds (one cache
        serves heads that read different layers of it). Raises ConfigError naming a layer it does not hold."""
        held = list(self.layer_ids)
        missing = [i for i in reads if i != num_layers and i not in held]
        if missing:
            raise ConfigError(f"the hidden-state cache {folder} holds layers {held} (and the final hidden state), the "
                              f"head reads {list(reads)}: set head.fused_layer_ids to layers it holds, or rebuild the "
                              "cache with those --layers")

        def states(batch: dict) -> torch.Tensor:
            h = batch["hidden"].shape[-1]
            parts = [batch["hidden"] if i == num_layers else batch["features"].narrow(-1, held.index(i) * h, h)
                     for i in reads]
            return parts[0] if len(parts) == 1 else torch.cat(parts, -1)

        return states

    def fingerprint(self) -> str:
        return self.examples.fingerprint(self.index)

    def token_counts(self, vocab_size: int):
        """Loss-masked tokens per target id over these rows (the cache counts them shard by shard)."""
        return self.examples.token_counts(vocab_size, self.index)

    def lengths(self):
        return self.examples.lengths()[self.index]


class ExampleStream:
    """Endless seeded epochs over `examples`; positions are global stream offsets."""

    def __init__(self, examples: Examples, seed: int, shuffle: bool = True) -> None:
        if len(examples) == 0:
            raise InputError("no training examples (check data.source, data.limit and data.held_out)")
        self.examples, self.seed, self.shuffle = examples, seed, shuffle
        self._epoch, self._order = -1, None

    def index(self, position: int) -> int:
        """The example at stream position `position`."""
        epoch, offset = divmod(position, len(self.examples))
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            n = len(self.examples)
            self._order = torch.randperm(n, generator=gen).tolist() if self.shuffle else list(range(n))
            self._epoch = epoch
        return self._order[offset]

    def rows(self, start: int, count: int) -> list[dict[str, Any]]:
        return [self.examples[self.index(p)] for p in range(start, start + count)]


def micro_batch_start(consumed: int, micro: int, rank: int, size: int, world: int) -> int:
    """Stream position of micro-batch `micro` of `rank` in the step that begins at `consumed`."""
    return consumed + micro * size * world + rank * size


class StepSampler(torch.utils.data.Sampler):
    """This rank's micro-batches (lists of example indices), step after step from stream position `consumed`.

    A step's examples are the stream positions [consumed, consumed + size * world * grad_accum); micro-batch a of
    rank r takes slot a * world + r of them, in stream order or, with `lengths`, sorted by length (ties in stream
    order). Either way the set of a step's examples depends only on the position, not on the world size."""

    def __init__(self, stream: ExampleStream, consumed: int, size: int, world: int, rank: int, grad_accum: int,
                 lengths: Sequence[int] | None = None) -> None:
        self.stream, self.consumed, self.size, self.world, self.rank = stream, consumed, size, world, rank
        self.grad_accum, self.lengths = grad_accum, lengths

    def __iter__(self) -> Iterator[list[int]]:
        step = self.size * self.world * self.grad_accum
        consumed = self.consumed
        while True:
            chosen = [self.stream.index(p) for p in range(consumed, consumed + step)]
            if self.lengths is not None:
                chosen = [chosen[j] for j in sorted(range(step), key=lambda j: (self.lengths[chosen[j]], j))]
            for micro in range(self.grad_accum):
                slot = (micro * self.world + self.rank) * self.size
                yield chosen[slot: slot + self.size]
            consumed += step


def lengths_of(examples: Examples) -> list[int]:
    """Tokens per example, read without materialising the token lists (Arrow for a dataset, offsets for a cache)."""
    if hasattr(examples, "lengths"):
        return examples.lengths().tolist()
    import pyarrow.compute as pc

    return pc.list_value_length(examples.with_format("arrow")["input_ids"]).to_numpy().tolist()


def loader_workers(requested: int | None, device: torch.device) -> int:
    """DataLoader worker processes: `requested`, else 4 on a GPU (the host prepares batches while the GPU runs) and
    none on a CPU (the cores are busy with training)."""
    if requested is not None:
        return requested
    return 0 if device.type == "cpu" else min(4, os.cpu_count() or 1)


def train_batches(examples: Examples, sampler: StepSampler, pad_id: int, workers: int,
                  pin_memory: bool) -> Iterator[dict[str, torch.Tensor]]:
    """Collated micro-batches (CPU tensors, pinned when asked) in the sampler's order, made by `workers`
    processes ahead of use."""
    loader = torch.utils.data.DataLoader(examples, batch_sampler=sampler, collate_fn=functools.partial(
        collate, pad_id=pad_id), num_workers=workers, pin_memory=pin_memory, persistent_workers=workers > 0,
        prefetch_factor=4 if workers else None,
        generator=torch.Generator())  # its own: an iterator draws a seed, which must not move the run's RNG (resume)
    return iter(loader)


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
    train_rows = train_set  # a datasets.Dataset, or the cache's rows (which count their tokens shard by shard)
    with accelerator.main_process_first():  # the main process tokenizes (a vocab_source) and caches first
        counted = train_rows if d.vocab_source is None else vocab_source_rows(d, target.tokenizer)
        vocab = build_vocab_map(counted, target.tokenizer, size, vocab_cache_path(d, config.output_dir))
    if accelerator.is_main_process:  # the other ranks read the stored map: they count nothing
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
    from eyas.data import build_examples, load_conversations

    workers = config.num_proc
    if workers is None:  # the source is read (and cached) once first, to see how large it is
        rows = len(load_conversations(source, field_map)[0])
        workers = tokenize_workers(min(rows, limit) if limit is not None else rows)
    return build_examples(source, tokenizer, max_length=config.max_length, assistant_turns=config.assistant_turns,
                          field_map=field_map, limit=limit, num_proc=workers if workers > 1 else None)


ROWS_PER_WORKER = 20_000  # below this, starting a tokenizer process costs more than it saves


def tokenize_workers(rows: int) -> int:
    """Tokenizer processes for `rows` conversations: one per ROWS_PER_WORKER rows, at most one per core (16 at
    most). The other ranks of a launch wait meanwhile (main_process_first), so the cores are free."""
    return max(1, min(rows // ROWS_PER_WORKER, os.cpu_count() or 1, 16))
