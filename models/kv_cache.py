"""The one key/value cache: preallocated, written in place, rows of different lengths side by side.

Used for the target in speculative generation and in regeneration, and for the draft head while drafting.
Every layer keeps its keys and values in buffers [B, kv_heads, capacity, head_dim]. Row b's committed
tokens fill columns [0, lengths[b]) in order, so a column is that row's position: the model's own
sliding-window and chunked attention masks hold exactly, nothing is padded in front, nothing is evicted.

A forward is bracketed by `with cache.writing(position_ids):`. Its n new tokens go after whatever is
pending, at columns lengths[b] + pending + j (one offset per row; one slice when all rows are as long),
and every column records its token's position (tree nodes at the same depth share one). Then either
- commit(counts, index): row b keeps counts[b] of its pending entries, those at index[b, :counts[b]]
  (a verified tree's accepted path; None keeps the first ones in place), or
- rollback(): every pending entry is dropped (a draft tree that has been verified).
Only the accepted tail moves; the context is never copied. keep_rows drops finished rows by moving the
last rows into their holes. It is a transformers `Cache`, so any model's attention writes through
`update` as with its own caches, and its fixed capacity makes the buffers' shapes stable across steps.
A fixed-shape forward (`writing(fixed=True)`: a compiled step replayed as one graph whatever the context, as
a CUDA graph on a GPU) attends over every column, the unused ones hidden by its mask, and writes through
column indices held in a tensor.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _Layer(CacheLayerMixin):
    """One layer's view of the cache's buffers, for code that reads a transformers cache layer by layer; the
    model's attention writes through `KVCache.update`."""

    is_sliding = False  # never evicts: windows are applied by the masks, from the recorded positions

    def __init__(self, cache: "KVCache", index: int) -> None:
        # not CacheLayerMixin.__init__: it assigns keys and values, which are the cache's
        self.cache, self.index = cache, index

    @property
    def keys(self) -> torch.Tensor | None:
        """[B, kv_heads, capacity, D], None until the layer's first write."""
        return self.cache.key_buffers[self.index]

    @property
    def values(self) -> torch.Tensor | None:
        return self.cache.value_buffers[self.index]

    @property
    def is_initialized(self) -> bool:
        return self.keys is not None

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.cache.allocate(self.index, key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.get_mask_sizes(query_length, self.index)

    def get_seq_length(self) -> int:
        return self.cache.width

    def get_max_length(self) -> int:
        return self.cache.capacity


class KVCache(Cache):
    """Keys/values of `num_layers` layers for `batch` rows of at most `capacity` tokens each (grows if needed).

    The buffers live in two lists on the cache, and everything a forward asks of it (`update`, the mask sizes,
    which layers slide) is answered there, never by visiting the layer objects: a compiled step then checks one
    tensor per buffer rather than each layer object's type and attributes (~150 of dynamo's guards for a 30-layer
    model)."""

    def __init__(self, num_layers: int, batch: int, capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(layers=[_Layer(self, i) for i in range(num_layers)])
        self.capacity = capacity
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [B] committed tokens per row
        self.host_lengths = [0] * batch  # the same, on the host: decisions about shapes need no device sync
        self.positions = torch.zeros(batch, capacity, dtype=torch.long, device=device)  # [B, capacity]
        self.pending = 0  # entries written since the last commit / rollback, the same number in every row
        self.fixed = False  # whether the forward in progress is a fixed-shape one (see `writing`)
        # per layer, whether the forward in progress reports its input (Target.forward sets it; empty between
        # forwards): a compiled step's graph outputs only those, and is traced anew for other layers (dynamo guards
        # the cache's attributes; flags, not layer numbers, which dynamo would make symbolic once they change)
        self.capture: tuple[bool, ...] = ()
        self._index: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (n, rows, cols) of the write in progress
        # the model whose forwards write the buffers (the first Target to run one over the cache claims it): it fixes
        # each layer's buffer shape but the rows and columns, so a compiled step of that model checks one key and one
        # value buffer only (target._frozen_module_guards)
        self.owner: object | None = None
        # whether compiled steps take the capacity as a symbol (`make_capacity_symbolic`)
        self.symbolic = False
        # per layer [B, kv_heads, capacity, D], allocated at the layer's first write (its shape, dtype and device)
        self.key_buffers: list[torch.Tensor | None] = [None] * num_layers
        self.value_buffers: list[torch.Tensor | None] = [None] * num_layers

    def allocate(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers for `layer`, shaped after its first entries key/value_states [_, kv_heads, n, D]."""
        shape = (self.batch, key_states.shape[1], self.capacity, key_states.shape[3])
        # zeros, not empty(): columns no row may see still enter the attention with weight 0, and 0 * NaN is NaN
        self.key_buffers[layer] = self._sized(_static(key_states.new_zeros(shape)))
        self.value_buffers[layer] = self._sized(_static(value_states.new_zeros(*shape[:3], value_states.shape[3])))

    def make_capacity_symbolic(self) -> None:
        """Compiled steps over this cache take its capacity (the buffers' and positions' columns) as a symbol from
        their first graph, so one graph serves caches of every capacity. Dynamo would specialise a graph to the first
        capacity it sees and compile another at the next cache's (the next prompt's plain decoding, say). Not for
        fixed-shape steps, whose graphs are per capacity bucket."""
        self.symbolic = True
        self.positions = self._sized(self.positions)
        for i, keys, values in list(self._buffers()):
            self.key_buffers[i], self.value_buffers[i] = self._sized(keys), self._sized(values)

    def _sized(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, ..., capacity(, D)], its capacity marked as a symbol for compiled steps where `make_capacity_symbolic`
        asked it (a mark on the tensor: each new buffer, grown or narrowed, is marked again)."""
        if self.symbolic:
            torch._dynamo.maybe_mark_dynamic(x, 1 if x.dim() == 2 else 2)
        return x

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states [B, kv_heads, n, D] -> layer `layer_idx`'s keys/values [B, kv_heads, width, D]
        (a fixed-shape forward: every column, [B, kv_heads, capacity, D])."""
        if self.key_buffers[layer_idx] is None:
            self.allocate(layer_idx, key_states, value_states)
        keys, values = self.key_buffers[layer_idx], self.value_buffers[layer_idx]
        if self.symbolic:  # every buffer's capacity is the positions': one symbol for a compiled step, not one each
            torch._check(keys.shape[2] == self.positions.shape[1])
            torch._check(values.shape[2] == self.positions.shape[1])
        n = key_states.shape[2]
        if not self.fixed and self.uniform is not None:  # (fixed: no row length is read, none enters the graph)
            start = self.uniform + self.pending
            keys[:, :, start: start + n] = key_states
            values[:, :, start: start + n] = value_states
        else:
            rows, cols = self.write_index(n, keys.device)
            keys[rows, :, cols] = key_states.transpose(1, 2)  # advanced indices first: [B, n, heads, D]
            values[rows, :, cols] = value_states.transpose(1, 2)
        if self.fixed:
            return keys, values
        width = self.width + n
        return keys[:, :, :width], values[:, :, :width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return (self.capacity if self.fixed else self.width + query_length), 0

    # every layer is full attention to transformers' masks (windows come from eyas's masks, by position)
    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layers)

    is_linear = is_dummy = is_sliding
    is_compileable = False

    def _buffers(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(layer, keys, values) of every layer written so far."""
        return ((i, k, v) for i, (k, v) in enumerate(zip(self.key_buffers, self.value_buffers)) if k is not None)

    # ---- geometry -----------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self.host_lengths)

    @property
    def uniform(self) -> int | None:
        """The common length when every row is as long (writes are one slice), else None."""
        first = self.host_lengths[0] if self.host_lengths else 0
        return first if all(n == first for n in self.host_lengths) else None

    @property
    def width(self) -> int:
        """Columns in use: the longest row plus the pending entries."""
        return (max(self.host_lengths) if self.host_lengths else 0) + self.pending

    def write_index(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [B, 1], cols [B, n]): where this forward's n new tokens go in each row."""
        if self._index is None or self._index[0] != n or self._index[1].device != device:
            cols = self.lengths.to(device)[:, None] + self.pending + torch.arange(n, device=device)
            self._index = (n, torch.arange(self.batch, device=device)[:, None], cols)
        return self._index[1], self._index[2]

    def key_positions(self, width: int | None = None) -> torch.Tensor:
        """[B, width] position of the token in each column (default: every column in use)."""
        return self.positions[:, : self.width if width is None else width]

    # ---- writing ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def writing(self, position_ids: torch.Tensor | int, fixed: bool = False, keep: int | None = None,
                capture: Sequence[int] = ()) -> Iterator[None]:
        """Bracket one forward over position_ids [B, n]: its layers write n entries per row after the pending ones,
        and the inputs of the layers in `capture` are reported (`capture`). An int n instead: n tokens that follow
        on from rows all as long, whose positions the forward takes from `next_positions` (a compiled step, in its
        graph).

        fixed: a fixed-shape forward (a compiled graph replayed whatever the context): every layer attends over all
        `capacity` columns (an explicit mask hides the unused ones) and writes through column indices made here, a
        tensor, so no length enters the graph as a number. keep: only the first `keep` of the n entries stay
        pending (the rest padded the forward to its size; they lie beyond the columns in use, never seen)."""
        n = position_ids if isinstance(position_ids, int) else position_ids.shape[1]
        self.reserve(self.width + n)
        if isinstance(position_ids, torch.Tensor):  # (an int: `next_positions` records them)
            if not fixed and self.uniform is not None:
                start = self.uniform + self.pending
                self.positions[:, start: start + n] = position_ids
            else:
                rows, cols = self.write_index(n, self.positions.device)
                self.positions[rows, cols] = position_ids.to(self.positions.device)
        self.fixed = fixed
        self.capture = tuple(i in capture for i in range(len(self.layers)))
        try:
            yield
        finally:
            self.pending += n if keep is None else keep
            self._index = None
            self.fixed = False
            self.capture = ()

    def next_positions(self, n: int) -> torch.Tensor:
        """[B, n] the positions of n tokens that follow on from every row (all as long), recorded as those of the
        columns they take. A compiled step makes them in its graph: as eager ops before it (a range, its expansion,
        the record) they cost ~0.1 ms of a bf16 SmolLM2-135M step, on the caches its weight reads leave."""
        start = self.uniform + self.pending
        positions = torch.arange(start, start + n, device=self.positions.device).expand(self.batch, n)
        self.positions[:, start: start + n] = positions
        return positions

    def reserve(self, need: int) -> None:
        """Room for `need` columns per row: the buffers at least double when they grow (their columns kept)."""
        if need <= self.capacity:
            return
        capacity = max(need, 2 * self.capacity)
        grown = self.positions.new_zeros(self.batch, capacity)
        grown[:, : self.capacity] = self.positions
        self.positions, self.capacity = self._sized(grown), capacity
        for i, keys, values in list(self._buffers()):
            self.key_buffers[i] = self._sized(_widened(keys, capacity))
            self.value_buffers[i] = self._sized(_widened(values, capacity))

    def commit(self, counts: Sequence[int], index: torch.Tensor | None = None) -> None:
        """Row b keeps counts[b] pending entries: index[b, :counts[b]] (ascending indices into the pending block,
        [B, A]) moved to the front of the block, or with index None the first counts[b] as they are."""
        if index is not None and index.shape[1] > 1:
            dev = self.positions.device
            rows = torch.arange(self.batch, device=dev)[:, None]
            src = self.lengths[:, None] + index.to(dev)
            dst = self.lengths[:, None] + torch.arange(index.shape[1], device=dev)
            self.positions[rows, dst] = self.positions[rows, src]
            for _, keys, values in self._buffers():
                d = keys.device
                r, s, t = rows.to(d), src.to(d), dst.to(d)
                keys[r, :, t] = keys[r, :, s]  # gathered (a copy) before written
                values[r, :, t] = values[r, :, s]
        self.host_lengths = [n + int(k) for n, k in zip(self.host_lengths, counts)]
        self.lengths = self.lengths + torch.as_tensor(list(counts), device=self.lengths.device)
        self.pending = 0

    def rollback(self) -> None:
        """Forget every pending entry."""
        self.pending = 0

    def keep_rows(self, keep: Sequence[int]) -> list[int]:
        """Only rows `keep` (ascending) go on; returns the old row now in each row. The kept rows beyond
        len(keep) move into the dropped rows below them (their columns in use only), then the buffers are
        narrowed to the first len(keep) rows (a view): the cache is never copied whole."""
        n, width = len(keep), self.width
        order, kept = list(range(n)), set(keep)
        holes = [r for r in range(n) if r not in kept]
        for hole, row in zip(holes, [r for r in keep if r >= n]):
            order[hole] = row
            self.positions[hole, :width] = self.positions[row, :width]
            for _, keys, values in self._buffers():
                keys[hole, :, :width] = keys[row, :, :width]
                values[hole, :, :width] = values[row, :, :width]
        for i, keys, values in list(self._buffers()):
            self.key_buffers[i], self.value_buffers[i] = self._sized(keys[:n]), self._sized(values[:n])
        self.positions = self._sized(self.positions[:n])
        self.lengths = self.lengths[torch.tensor(order, device=self.lengths.device)]
        self.host_lengths = [self.host_lengths[r] for r in order]
        return order

    def load_row(self, row: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                 positions: torch.Tensor) -> None:
        """Replace row `row` with a sequence computed elsewhere: per layer keys/values [kv_heads, n, D], positions
        [n]."""
        n = positions.shape[0]
        self.reserve(n)
        self.positions[row, :n] = positions
        for i, (k, v) in enumerate(zip(keys, values)):
            if self.key_buffers[i] is None:
                self.allocate(i, k[None], v[None])
            self.key_buffers[i][row, :, :n] = k
            self.value_buffers[i][row, :, :n] = v
        self.host_lengths[row] = n
        self.lengths[row] = n


def _widened(x: torch.Tensor, capacity: int) -> torch.Tensor:
    """x [B, kv_heads, C, D] with `capacity` columns, the first C as they were."""
    wide = x.new_zeros(*x.shape[:2], capacity, x.shape[3])
    wide[:, :, : x.shape[2]] = x
    return _static(wide)


def _static(buffer: torch.Tensor) -> torch.Tensor:
    """A buffer that compiled steps write in place: on CUDA its address is marked as fixed, so a step captured as a
    CUDA graph writes and reads it where it lies (an input at an address of its own would be copied in each replay,
    and one written in place would keep the step out of the graph)."""
    if buffer.is_cuda:
        torch._dynamo.mark_static_address(buffer)
    return buffer
