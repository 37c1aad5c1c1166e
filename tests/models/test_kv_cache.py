"""The one KV cache: rows of different lengths side by side, column = position, pending entries committed in place
(an accepted tree path moved to the front of its block) or rolled back, finished rows dropped, growth on demand."""

import torch

from eyas.models.kv_cache import KVCache

HEADS, DIM = 2, 3


def write(cache: KVCache, positions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward's worth of entries: every layer writes keys = values = the position (+ 100 x layer), so each
    column shows whose entry it holds. Returns layer 0's keys [B, heads, width, D] as the attention would see them."""
    pos = torch.tensor(positions)
    seen = None
    with cache.writing(pos):
        for i, layer in enumerate(cache.layers):
            kv = (pos[:, None, :, None] + 100 * i).float().expand(-1, HEADS, -1, DIM)
            keys, values = layer.update(kv, kv.clone(), i)
            seen = (keys, values) if seen is None else seen
    return seen


def column_values(cache: KVCache, layer: int = 0) -> list[list[int]]:
    """Row b's committed entries as the values written there (columns 0 .. lengths[b])."""
    keys = cache.layers[layer].keys
    return [keys[b, 0, :n, 0].long().tolist() for b, n in enumerate(cache.host_lengths)]


def test_rows_of_different_lengths_keep_column_equal_to_position():
    cache = KVCache(2, 2, 16)
    write(cache, [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
    cache.commit([5, 3])  # right-padded prefill: row 1 keeps its first 3
    assert cache.host_lengths == [5, 3] and cache.lengths.tolist() == [5, 3] and cache.uniform is None
    keys, _ = write(cache, [[5, 6], [3, 4]])  # each row writes after its own history
    assert keys.shape[2] == cache.width == 5 + 2  # the attention sees every column in use
    cache.commit([2, 2])
    assert column_values(cache) == [list(range(7)), list(range(5))]
    assert column_values(cache, 1) == [[100 + p for p in range(7)], [100 + p for p in range(5)]]
    assert cache.key_positions().tolist()[0] == list(range(7))
    assert cache.key_positions()[1, :5].tolist() == list(range(5))


def test_commit_keeps_the_accepted_path_and_rollback_drops_the_rest():
    cache = KVCache(1, 2, 16)
    write(cache, [[0, 1, 2], [0, 1, 2]])
    cache.commit([3, 3])
    # a tree of 5 nodes at depths 0 1 1 2 2 (positions 3 4 4 5 5): row 0 accepts nodes 0, 2, 4; row 1 node 0 only
    write(cache, [[3, 4, 4, 5, 5], [3, 4, 4, 5, 5]])
    assert cache.pending == 5
    cache.commit([3, 1], torch.tensor([[0, 2, 4], [0, 0, 0]]))
    assert cache.pending == 0 and cache.host_lengths == [6, 4]
    assert column_values(cache) == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3]]
    assert cache.key_positions()[0].tolist() == [0, 1, 2, 3, 4, 5]
    write(cache, [[6, 7], [4, 5]])  # a draft that is verified and thrown away
    cache.rollback()
    assert cache.pending == 0 and cache.width == 6 and column_values(cache) == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3]]


def test_finished_rows_leave_and_the_kept_rows_move_into_their_holes():
    cache = KVCache(1, 4, 8)
    write(cache, [[10 * r + j for j in range(3)] for r in range(4)])
    cache.commit([3, 2, 3, 1])
    order = cache.keep_rows([1, 3])  # rows 0 and 2 are done
    assert order == [3, 1]  # row 3 moved into the hole at row 0
    assert cache.batch == 2 and cache.host_lengths == [1, 2] and cache.lengths.tolist() == [1, 2]
    assert column_values(cache) == [[30], [10, 11]]
    assert cache.layers[0].keys.shape[0] == 2


def test_the_cache_grows_without_losing_what_it_holds():
    cache = KVCache(2, 1, 4)
    write(cache, [[0, 1, 2]])
    cache.commit([3])
    write(cache, [[3, 4, 5, 6, 7, 8]])  # past the capacity
    cache.commit([6])
    assert cache.capacity >= 9 and column_values(cache) == [list(range(9))]
    assert column_values(cache, 1) == [[100 + p for p in range(9)]]


def test_a_row_computed_elsewhere_loads_in_place():
    cache = KVCache(2, 2, 4)
    write(cache, [[0, 1], [0, 1]])
    cache.commit([2, 2])
    keys = [torch.full((HEADS, 6, DIM), 7.0 + i) for i in range(2)]
    cache.load_row(1, keys, [k.clone() for k in keys], torch.arange(6))
    assert cache.host_lengths == [2, 6] and cache.capacity >= 6
    assert column_values(cache) == [[0, 1], [7] * 6] and column_values(cache, 1)[1] == [8] * 6
    assert cache.key_positions()[1].tolist() == list(range(6))


def test_transformers_sees_the_width_in_use():
    """Masks transformers builds itself (a model's own causal mask over a uniform cache) size from these."""
    cache = KVCache(1, 1, 8)
    write(cache, [[0, 1, 2]])
    cache.commit([3])
    assert cache.get_seq_length() == 3 and cache.layers[0].get_mask_sizes(2) == (5, 0)
