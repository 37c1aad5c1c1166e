"""Draft vocabulary: top-N loss-masked tokens, coverage, and stale stored maps detected."""

from __future__ import annotations

import datasets
import pytest
import torch

from eyas.data.vocab import build_vocab_map, load_vocab_map, read_vocab_map
from eyas.models import DraftHead, head_config_for
from tests.helpers.tiny import tiny_target, tiny_tokenizer


def examples(rows):
    return datasets.Dataset.from_dict({"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows]})


DATA = examples([
    ([10, 11, 11, 12, 12, 12], [0, 1, 1, 1, 1, 1]),  # 10 is context only: never counted
    ([10, 13, 12, 14], [0, 1, 1, 1]),
])  # masked counts: 12 x4, 11 x2, 13 x1, 14 x1


def test_top_n_and_coverage(tmp_path):
    vm = build_vocab_map(DATA, tiny_tokenizer(), 3)
    assert vm.draft_to_target.tolist() == [11, 12, 13]  # 13 and 14 tie: the lower id wins
    assert vm.coverage == pytest.approx(7 / 8)
    head = DraftHead(head_config_for(tiny_target(), draft_vocab_size=3), tiny_target())
    head.set_vocab_map(vm.draft_to_target)
    assert head.draft_to_target.tolist() == [11, 12, 13]


def test_stale_map_detected(tmp_path, caplog):
    caplog.set_level("INFO", logger="eyas.data.vocab")
    tok = tiny_tokenizer()
    path = tmp_path / "vocab.safetensors"
    first = build_vocab_map(DATA, tok, 3, cache_path=path)
    assert read_vocab_map(path).fingerprint == first.fingerprint
    assert build_vocab_map(DATA, tok, 3, cache_path=path).fingerprint == first.fingerprint  # reused
    assert "rebuilding" not in caplog.text

    other = examples([([20, 21, 21], [1, 1, 1])])
    rebuilt = build_vocab_map(other, tok, 3, cache_path=path)
    assert "different data" in caplog.text
    assert rebuilt.fingerprint != first.fingerprint and 21 in rebuilt.draft_to_target.tolist()

    bigger = tiny_tokenizer(vocab_size=400)
    with pytest.raises(ValueError, match="different tokenizer"):
        load_vocab_map(path, tokenizer=bigger, draft_vocab_size=3)
    with pytest.raises(ValueError, match="different draft_vocab_size"):
        load_vocab_map(path, tokenizer=tok, draft_vocab_size=4)
    with pytest.raises(ValueError, match="different data"):
        load_vocab_map(path, dataset=DATA)
    assert torch.equal(load_vocab_map(path, tokenizer=tok, draft_vocab_size=3, dataset=other).draft_to_target,
                       rebuilt.draft_to_target)


def test_a_hidden_state_cache_counts_per_shard_what_its_rows_hold(tmp_path):
    """The offline cache counts its tokens shard by shard (bincount); the counts, the map and the coverage equal
    those of the same rows as a dataset, for the whole cache and for a subset of its examples."""
    from eyas.data.hidden_cache import HiddenStateDataset, cache_hidden
    from eyas.data.vocab import coverage, token_counts
    from eyas.train.data import Subset

    target = tiny_target()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(4, 300, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (9,), generator=g)]
    ds = datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[int(i % 3 > 0) for i in range(len(r))]
                                                                      for r in rows]})
    cache_hidden(target, ds, tmp_path / "c", (), dtype="bf16", shard_examples=4)
    cached = HiddenStateDataset(tmp_path / "c", target)
    assert len(cached.index["shards"]) == 3
    subset, index = Subset(cached, [1, 4, 5, 8]), [1, 4, 5, 8]
    for counted, plain in ((cached, ds), (subset, ds.select(index))):
        assert (token_counts(counted, 320) == token_counts(plain, 320)).all()
        vm, ref = build_vocab_map(counted, tiny_tokenizer(), 20), build_vocab_map(plain, tiny_tokenizer(), 20)
        assert torch.equal(vm.draft_to_target, ref.draft_to_target) and vm.coverage == pytest.approx(ref.coverage)
        assert coverage(counted, vm.draft_to_target, 320) == pytest.approx(vm.coverage)
    assert cached.fingerprint() != subset.fingerprint() != Subset(cached, [1, 4, 5]).fingerprint()
    assert cached.lengths().tolist() == [len(r) for r in rows] and subset.lengths().tolist() == [len(rows[i])
                                                                                                  for i in index]
