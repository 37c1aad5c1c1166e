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


def test_stale_map_detected(tmp_path, capsys):
    tok = tiny_tokenizer()
    path = tmp_path / "vocab.safetensors"
    first = build_vocab_map(DATA, tok, 3, cache_path=path)
    assert read_vocab_map(path).fingerprint == first.fingerprint
    assert build_vocab_map(DATA, tok, 3, cache_path=path).fingerprint == first.fingerprint  # reused
    assert "rebuilding" not in capsys.readouterr().out

    other = examples([([20, 21, 21], [1, 1, 1])])
    rebuilt = build_vocab_map(other, tok, 3, cache_path=path)
    assert "different data" in capsys.readouterr().out
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
