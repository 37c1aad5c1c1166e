"""The offline hidden-state cache reads back exactly what the target computes, and resumes."""

from __future__ import annotations

import datasets
import pytest
import torch

from eyas.data.hidden_cache import HiddenStateDataset, cache_hidden
from tests.helpers.decisions import Draws, assert_same_regeneration, lines_by_id
from tests.helpers.stored import assert_states_of_a_lone_forward
from tests.helpers.tiny import tiny_target

LAYERS = (1, 2, 4)  # 4 = the final normed state of the 4-layer tiny target


def examples(n=7):
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(4, 300, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
    return datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[i % 2 for i in range(len(r))] for r in rows]})


@pytest.mark.parametrize("layer_ids", [LAYERS, ()])
def test_reads_back_what_the_target_computes(tmp_path, layer_ids):
    target, ds = tiny_target(), examples()
    cache_hidden(target, ds, tmp_path / "c", layer_ids, dtype="fp32", batch_size=3, shard_examples=3)
    cached = HiddenStateDataset(tmp_path / "c", target)
    assert len(cached) == len(ds) and len(cached.index["shards"]) == 3
    for i, row in enumerate(ds):
        out = target(torch.tensor([row["input_ids"]]), layer_ids=layer_ids, logits=False)
        item = cached[i]
        assert item["input_ids"].tolist() == row["input_ids"] and item["loss_mask"].tolist() == row["loss_mask"]
        torch.testing.assert_close(item["hidden"], out.hidden[0], rtol=1e-5, atol=1e-5)
        if layer_ids:
            torch.testing.assert_close(item["features"], out.features[0], rtol=1e-5, atol=1e-5)
        else:
            assert "features" not in item


def test_bf16_storage_and_resume(tmp_path, monkeypatch):
    target, ds = tiny_target(), examples()
    cache_hidden(target, ds, tmp_path / "full", LAYERS, batch_size=2, shard_examples=2)

    calls = []
    real_save = __import__("eyas.data.hidden_cache", fromlist=["save"]).save

    def dying_save(tensors, metadata=None):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed while writing the third shard
        return real_save(tensors, metadata)

    monkeypatch.setattr("eyas.data.hidden_cache.save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        cache_hidden(target, ds, tmp_path / "resumed", LAYERS, batch_size=2, shard_examples=2)
    with pytest.raises(ValueError, match="incomplete"):
        HiddenStateDataset(tmp_path / "resumed")
    resumed_saves = []
    monkeypatch.setattr("eyas.data.hidden_cache.save", lambda t, m=None: resumed_saves.append(1) or real_save(t, m))
    cache_hidden(target, ds, tmp_path / "resumed", LAYERS, batch_size=2, shard_examples=2)
    assert len(resumed_saves) == 2  # 4 shards: 2 were done before the kill, only the rest are computed
    full, resumed = HiddenStateDataset(tmp_path / "full"), HiddenStateDataset(tmp_path / "resumed")
    for i in range(len(ds)):
        assert full[i]["hidden"].dtype == torch.bfloat16
        for k in ("input_ids", "loss_mask"):
            assert torch.equal(full[i][k], resumed[i][k])
        for cache in (full, resumed):
            assert_states_of_a_lone_forward(cache[i], target, LAYERS)
    with pytest.raises(ValueError, match="different layer_ids"):
        cache_hidden(target, ds, tmp_path / "full", (1,))


def test_regeneration_split_in_parts_merges_into_what_one_run_writes(tmp_path, monkeypatch):
    """Two parts (every other id) of a sampled regeneration with a cache merge, when the last one finishes, into
    one JSONL and one cache holding what a single run writes; the merge adds nothing twice when rerun. What one run
    writes: each conversation's text, ids and loss mask (unless a draw parted by rounding: the parts batch other rows
    together), its states those of a forward of it alone up to bf16 rounding."""
    from eyas.data.hidden_cache import append_cache
    from eyas.data.regen_store import merge_parts, parts_folder, regenerate_jsonl
    from eyas.data.regenerate import RegenConfig
    from tests.data.test_regenerate import EOS, cache_rows, conversations, tokens

    target = tiny_target()
    ds = datasets.Dataset.from_dict({"messages": conversations(), "problem": [""] * 7})
    cfg = RegenConfig(max_new_tokens=10, temperature=0.8, seed=3)
    kw = dict(batch_size=3, eos_ids=EOS, progress=False, shard_examples=2, layer_ids=LAYERS)
    draws = Draws(monkeypatch)
    whole_draws = draws.start()
    regenerate_jsonl(target, ds, tmp_path / "whole.jsonl", cfg, cache_hidden=tmp_path / "whole", **kw)
    out, cache = tmp_path / "split.jsonl", tmp_path / "split"
    split_draws = draws.start()
    first = regenerate_jsonl(target, ds, out, cfg, cache_hidden=cache, part=(1, 2), **kw)
    assert first.conversations == 3 and not out.exists()  # ids 1, 3, 5; the other part is not done yet
    regenerate_jsonl(target, ds, out, cfg, cache_hidden=cache, part=(0, 2), **kw)
    assert not parts_folder(out).exists()
    lines, whole = lines_by_id(out), lines_by_id(tmp_path / "whole.jsonl")
    assert sorted(lines) == list(range(7))
    parted = assert_same_regeneration(whole_draws, split_draws, whole, lines)
    ours, ref = cache_rows(cache, target), cache_rows(tmp_path / "whole", target)
    assert assert_same_regeneration(whole_draws, split_draws, tokens(ref), tokens(ours)) == parted
    for rows in (ours, ref):
        for item in rows.values():
            assert_states_of_a_lone_forward(item, target, LAYERS)
    assert append_cache(cache, tmp_path / "whole") == 0  # every example is there already
    assert not merge_parts(out, cache, 2)  # nothing left to merge
