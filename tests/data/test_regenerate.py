"""Continuous-batching regeneration: equal to one-at-a-time greedy, states equal a bare forward, resumable;
the hidden-state cache it writes equals `cache_hidden` over its output, also across a kill."""

from __future__ import annotations

import json
import os
import signal

import datasets
import pytest
import torch

from eyas.data.chat_template import render_with_mask
from eyas.data.hidden_cache import HiddenStateDataset, cache_hidden, stored_shards
from eyas.data.regen_store import regenerate_jsonl
from eyas.data.regenerate import RegenConfig, Scheduler, regenerate
from tests.helpers.decisions import Draws, assert_same_regeneration, lines_by_id
from tests.helpers.stored import assert_states_of_a_lone_forward
from tests.helpers.tiny import tiny_target

EOS = list(range(20, 60))  # many "end" ids so answers stop at different lengths and slots refill


def conversations(n=7):
    g = torch.Generator().manual_seed(1)
    convs = []
    for i in range(n):
        words = lambda k: " ".join(f"w{int(x)}" for x in torch.randint(60, 250, (k,), generator=g))  # noqa: E731
        conv = [{"role": "user", "content": words(2 + i % 5)}, {"role": "assistant", "content": "w1"}]
        if i % 3 == 0:  # multi-turn, with a system prompt
            conv = [{"role": "system", "content": words(3)}] + conv + [
                {"role": "user", "content": words(2)}, {"role": "assistant", "content": "w2"}]
        convs.append(conv)
    return convs


def run(target, batch_size, layer_ids=None, prefill_tokens=4096, **cfg):
    done = {}
    stats = regenerate(target, enumerate(conversations()), RegenConfig(max_new_tokens=12, **cfg),
                       batch_size=batch_size, layer_ids=layer_ids, eos_ids=EOS, progress=False,
                       prefill_tokens=prefill_tokens, on_done=lambda job: done.__setitem__(job.id, job))
    return done, stats


def answers(done):
    """{id: (regenerated conversation, final answer's tokens)} of run's jobs."""
    return {i: (job.out, job.generated) for i, job in done.items()}


def at_nth_done(n, action):
    """(on_done callback, ids it has seen): it records finished ids and calls action() at the n-th."""
    seen = []

    def on_done(job):
        seen.append(job.id)
        if len(seen) == n:
            action()

    return on_done, seen


def kill():  # as if the process died: nothing after this point runs
    raise KeyboardInterrupt


def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("span_cost", [None, 0])  # 0: every row of the cache attends over its own columns
def test_batched_greedy_equals_one_at_a_time(span_cost, monkeypatch):
    if span_cost is not None:
        monkeypatch.setattr("eyas.models.cpu_kernels.SPAN_CALL_COST", span_cost)
    target = tiny_target()
    draws = Draws(monkeypatch)
    single_draws = draws.start()
    single, _ = run(target, 1)
    batched_draws = draws.start()
    batched, stats = run(target, 3)
    assert sorted(batched) == list(range(7))
    lengths = {len(j.generated) for j in batched.values()}
    assert len(lengths) > 1  # answers of different lengths: slots were refilled mid-batch
    assert_same_regeneration(single_draws, batched_draws, answers(single), answers(batched))
    for job in batched.values():  # every turn kept its role; a conversation only ends early after a cut answer
        roles = [m["role"] for m in job.messages]
        assert [m["role"] for m in job.out] == roles[: len(job.out)] and job.out[-1]["role"] == "assistant"
        assert len(job.out) == len(roles) or len(job.generated) == 12
    assert stats.conversations == 7 and stats.useful_tokens >= sum(len(j.generated) for j in batched.values())


def test_grouped_prefill_equals_one_prompt_at_a_time(monkeypatch):
    target = tiny_target()
    groups = []  # (rows, prompt lengths) of every prefill
    real = Scheduler._prefill
    monkeypatch.setattr(Scheduler, "_prefill", lambda self, rows, prompts: groups.append(
        (rows, [len(p) for p in prompts])) or real(self, rows, prompts))
    draws = Draws(monkeypatch)
    alone_draws = draws.start()
    alone, _ = run(target, 4, prefill_tokens=1)
    assert {len(rows) for rows, _ in groups} == {1}
    groups.clear()
    grouped_draws = draws.start()
    grouped, _ = run(target, 4)
    rows, lengths = groups[0]
    assert len(rows) == 4 and len(set(lengths)) > 1  # the four first prompts (of different lengths) went in together
    assert rows == sorted(rows) and lengths == sorted(lengths, reverse=True)  # longest in the lowest row
    assert_same_regeneration(alone_draws, grouped_draws, answers(alone), answers(grouped))


def test_captured_states_equal_a_bare_forward():
    target = tiny_target()
    layers = (1, 2, 4)
    done, stats = run(target, 3, layer_ids=layers)
    for job in done.values():
        hidden = torch.cat([h.reshape(-1, h.shape[-1]) for h, _ in job.states])
        feats = torch.cat([f.reshape(-1, f.shape[-1]) for _, f in job.states])
        ids = torch.tensor([job.prompt + job.generated])
        ref = target(ids, layer_ids=layers, logits=False)
        torch.testing.assert_close(hidden, ref.hidden[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(feats, ref.features[0], rtol=1e-4, atol=1e-4)


def test_killed_and_resumed_equals_uninterrupted(tmp_path, monkeypatch):
    target = tiny_target()
    ds = datasets.Dataset.from_dict({"messages": conversations(), "problem": [""] * 5 + ["empty", ""]})
    cfg = RegenConfig(max_new_tokens=10, temperature=0.8, seed=3)
    draws = Draws(monkeypatch)
    full_draws = draws.start()
    regenerate_jsonl(target, ds, tmp_path / "full.jsonl", cfg, batch_size=3, eos_ids=EOS, progress=False)

    kill_after_three, seen = at_nth_done(3, kill)
    resumed_draws = draws.start()
    with pytest.raises(KeyboardInterrupt):
        regenerate_jsonl(target, ds, tmp_path / "resumed.jsonl", cfg, batch_size=3, eos_ids=EOS, progress=False,
                         on_done=kill_after_three)
    with open(tmp_path / "resumed.jsonl", "a") as f:
        f.write('{"id": 99, "mess')  # and a half-written line
    repeated = []
    regenerate_jsonl(target, ds, tmp_path / "resumed.jsonl", cfg, batch_size=3, eos_ids=EOS, progress=False,
                     on_done=lambda job: repeated.append(job.id))
    assert not set(repeated) & set(seen) and len(repeated) == 6 - 3
    full, resumed = lines_by_id(tmp_path / "full.jsonl"), lines_by_id(tmp_path / "resumed.jsonl")
    assert sorted(full) == [0, 1, 2, 3, 4, 6]  # the bad row (id 5) is never regenerated
    assert_same_regeneration(full_draws, resumed_draws, full, resumed)


def cache_rows(folder, target):
    """{dataset id: cached item} of a hidden-state cache written during regeneration."""
    ids = [i for shard_ids, _ in stored_shards(folder) for i in shard_ids]
    cached = HiddenStateDataset(folder, target)
    assert len(ids) == len(set(ids)) == len(cached)  # nothing stored twice
    return {i: cached[k] for k, i in enumerate(ids)}


def tokens(rows):
    """{dataset id: (input_ids, loss_mask)} of cache_rows: what must be exactly equal between runs."""
    return {i: (item["input_ids"].tolist(), item["loss_mask"].tolist()) for i, item in rows.items()}


def assert_states_alone(folder, target):
    """Every state a regeneration stored in `folder` is that of a forward of its example alone."""
    layer_ids = HiddenStateDataset(folder).layer_ids
    for item in cache_rows(folder, target).values():
        assert item["hidden"].dtype == torch.bfloat16
        assert_states_of_a_lone_forward(item, target, layer_ids)


def test_cache_written_while_regenerating_equals_cache_hidden_over_the_output(tmp_path):
    target = tiny_target()
    layers = (1, 2, 4)
    ds = datasets.Dataset.from_dict({"messages": conversations(), "problem": [""] * 7})
    stats = regenerate_jsonl(target, ds, tmp_path / "out.jsonl", RegenConfig(max_new_tokens=12), batch_size=3,
                             layer_ids=layers, eos_ids=EOS, progress=False, cache_hidden=tmp_path / "c",
                             cache_dtype="fp32", shard_examples=3)
    assert stats.mask_fallbacks == 0  # the rendering-based mask was used for every example
    lines = sorted((json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()), key=lambda r: r["id"])
    rendered = [render_with_mask(target.tokenizer, r["messages"], eos_ids=EOS) for r in lines]
    ref = datasets.Dataset.from_dict({"input_ids": [r.input_ids for r in rendered],
                                      "loss_mask": [r.loss_mask for r in rendered]})
    cache_hidden(target, ref, tmp_path / "ref", layers, dtype="fp32")
    ref_cache = HiddenStateDataset(tmp_path / "ref")
    ours = cache_rows(tmp_path / "c", target)
    assert sorted(ours) == [r["id"] for r in lines]
    assert any(len(r["messages"]) > 2 for r in lines)  # multi-turn: earlier regenerated answers are masked too
    for k, r in enumerate(lines):
        item, want = ours[r["id"]], ref_cache[k]
        n = len(item["input_ids"])
        # The rendering may add template glue after the final end-of-turn token (never generated).
        assert n <= len(want["input_ids"]) <= n + 2
        assert torch.equal(item["input_ids"], want["input_ids"][:n])
        assert torch.equal(item["loss_mask"], want["loss_mask"][:n])
        assert item["loss_mask"].sum() > 0
        torch.testing.assert_close(item["hidden"], want["hidden"][:n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(item["features"], want["features"][:n], rtol=1e-4, atol=1e-4)


def _uninterrupted(tmp_path, shard_examples: int):
    """Tiny target, 7 conversations (one marked bad), sampled generation: the reference run into full.jsonl / full/."""
    target = tiny_target()
    ds = datasets.Dataset.from_dict({"messages": conversations(), "problem": [""] * 5 + ["empty", ""]})
    cfg = RegenConfig(max_new_tokens=10, temperature=0.8, seed=3)
    kw = dict(batch_size=3, eos_ids=EOS, progress=False, shard_examples=shard_examples)
    regenerate_jsonl(target, ds, tmp_path / "full.jsonl", cfg, cache_hidden=tmp_path / "full", **kw)
    return target, ds, cfg, kw


def test_killed_and_resumed_with_cache_equals_uninterrupted(tmp_path, monkeypatch):
    draws = Draws(monkeypatch)
    full_draws = draws.start()
    target, ds, cfg, kw = _uninterrupted(tmp_path, shard_examples=2)

    resumed_draws = draws.start()
    with pytest.raises(KeyboardInterrupt):
        regenerate_jsonl(target, ds, tmp_path / "resumed.jsonl", cfg, cache_hidden=tmp_path / "resumed",
                         on_done=at_nth_done(5, kill)[0], **kw)
    in_shards = [i for ids, _ in stored_shards(tmp_path / "resumed") for i in ids]
    assert len(in_shards) == 4  # two shards of two; the fifth conversation was only buffered
    lines = (tmp_path / "resumed.jsonl").read_text().splitlines()
    assert len(lines) == 4
    # As if killed after writing the second shard but before its JSONL lines, mid-line:
    (tmp_path / "resumed.jsonl").write_text("\n".join(lines[:2]) + '\n{"id": 9')
    repeated = []
    regenerate_jsonl(target, ds, tmp_path / "resumed.jsonl", cfg, cache_hidden=tmp_path / "resumed",
                     on_done=lambda job: repeated.append(job.id), **kw)
    assert sorted(repeated) == sorted(set(range(7)) - {5} - set(in_shards))  # only what no shard held
    full = lines_by_id(tmp_path / "full.jsonl")
    assert sorted(full) == [0, 1, 2, 3, 4, 6]
    parted = assert_same_regeneration(full_draws, resumed_draws, full, lines_by_id(tmp_path / "resumed.jsonl"))
    want, got = cache_rows(tmp_path / "full", target), cache_rows(tmp_path / "resumed", target)
    assert assert_same_regeneration(full_draws, resumed_draws, tokens(want), tokens(got)) == parted
    for folder in ("full", "resumed"):  # bf16 storage of fp32 states from different batch compositions
        assert_states_alone(tmp_path / folder, target)
    with pytest.raises(ValueError, match="not in the hidden-state cache"):
        regenerate_jsonl(target, ds, tmp_path / "full.jsonl", cfg, cache_hidden=tmp_path / "other", **kw)


def test_ctrl_c_stores_the_finished_and_a_rerun_with_a_larger_limit_extends(tmp_path, monkeypatch):
    draws = Draws(monkeypatch)
    full_draws = draws.start()
    target, ds, cfg, kw = _uninterrupted(tmp_path, shard_examples=3)
    out_draws = draws.start()

    first5 = ds.select(range(5))  # `--limit 5`
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    on_done, seen = at_nth_done(1, ctrl_c)
    stats = regenerate_jsonl(target, first5, tmp_path / "out.jsonl", cfg, cache_hidden=tmp_path / "c", on_done=on_done,
                             **kw)
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers  # restored
    assert stats.stopped_by == signal.SIGINT and stats.conversations == len(seen) < 5
    stored = [json.loads(x)["id"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(stored) == sorted(seen) and stats.stored == len(seen)  # every finished one, nothing in flight
    assert sorted(cache_rows(tmp_path / "c", target)) == sorted(seen)  # readable: the index says complete

    repeated = []
    stats = regenerate_jsonl(target, first5, tmp_path / "out.jsonl", cfg, cache_hidden=tmp_path / "c",
                             on_done=repeated.append, **kw)  # the same command continues
    assert stats.stopped_by is None and stats.stored == 5
    assert sorted(j.id for j in repeated) == sorted(set(range(5)) - set(seen))
    regenerate_jsonl(target, ds, tmp_path / "out.jsonl", cfg, cache_hidden=tmp_path / "c", **kw)  # a larger limit
    full = lines_by_id(tmp_path / "full.jsonl")
    assert sorted(full) == [0, 1, 2, 3, 4, 6]
    parted = assert_same_regeneration(full_draws, out_draws, full, lines_by_id(tmp_path / "out.jsonl"))
    want, got = cache_rows(tmp_path / "full", target), cache_rows(tmp_path / "c", target)
    assert assert_same_regeneration(full_draws, out_draws, tokens(want), tokens(got)) == parted
    for folder in ("full", "c"):  # bf16 storage of fp32 states from different batch compositions
        assert_states_alone(tmp_path / folder, target)


@pytest.mark.parametrize("keep", [False, True])
def test_a_stop_drops_or_keeps_the_answers_in_flight_and_counts_them(tmp_path, keep):
    """Ctrl-C with 3 answers in flight: dropped (counted, a rerun regenerates them) or kept cut where they stood:
    exactly the uninterrupted run's first tokens, with their states, the cache readable."""
    target, ds, cfg, kw = _uninterrupted(tmp_path, shard_examples=3)
    on_done, seen = at_nth_done(1, ctrl_c)
    stats = regenerate_jsonl(target, ds, tmp_path / "out.jsonl", cfg, cache_hidden=tmp_path / "c", on_done=on_done,
                             keep_in_flight=keep, **kw)
    assert stats.stopped_by == signal.SIGINT
    assert stats.dropped + stats.cut_by_stop == kw["batch_size"]  # every row in flight is accounted for
    want, got = cache_rows(tmp_path / "full", target), cache_rows(tmp_path / "c", target)
    assert sorted(got) == sorted(seen) and stats.stored == len(seen)
    cut = [i for i in got if not torch.equal(got[i]["input_ids"], want[i]["input_ids"])]
    if not keep:
        assert not cut and stats.cut_by_stop == 0 and stats.dropped == 3 and stats.dropped_tokens > 0
        return
    assert len(cut) == stats.cut_by_stop > 0
    for i in cut:  # a strict prefix of the full answer, its states those of the same tokens
        n = len(got[i]["input_ids"])
        assert n < len(want[i]["input_ids"]) and torch.equal(got[i]["input_ids"], want[i]["input_ids"][:n])
        assert got[i]["hidden"].shape[0] == n
        assert_states_of_a_lone_forward(got[i], target, HiddenStateDataset(tmp_path / "c").layer_ids)
    assert stats.cut_by_stop_tokens > 0
    repeated = []  # a rerun regenerates only what the stop dropped: the cut answers stay as they are
    regenerate_jsonl(target, ds, tmp_path / "out.jsonl", cfg, cache_hidden=tmp_path / "c",
                     on_done=lambda job: repeated.append(job.id), **kw)
    assert sorted(repeated) == sorted(set(want) - set(seen))
    assert sorted(cache_rows(tmp_path / "c", target)) == sorted(want)


def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    target = tiny_target()
    ds = datasets.Dataset.from_dict({"messages": conversations(), "problem": [""] * 7})
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    on_done, seen = at_nth_done(2, lambda: (ctrl_c(), ctrl_c()))
    with pytest.raises(SystemExit) as exited:
        regenerate_jsonl(target, ds, tmp_path / "out.jsonl", RegenConfig(max_new_tokens=10), batch_size=3,
                         eos_ids=EOS, progress=False, on_done=on_done)
    assert exited.value.code == 130  # as a shell reports death by SIGINT
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2  # nothing after the abort


def test_too_long_prompts_are_counted_as_skipped():
    target = tiny_target()
    convs = conversations()
    prompts = [c[: next(i for i, m in enumerate(c) if m["role"] == "assistant")] for c in convs]
    lengths = [len(target.tokenizer.apply_chat_template(c, tokenize=True, add_generation_prompt=True)["input_ids"])
               for c in prompts]
    limit = sorted(lengths)[3]  # the first prompts of the 3 longest-or-equal do not fit
    too_long = sum(n >= limit for n in lengths)
    done = {}
    stats = regenerate(target, enumerate(convs), RegenConfig(max_new_tokens=4, max_length=limit), batch_size=3,
                       eos_ids=EOS, progress=False, on_done=lambda job: done.__setitem__(job.id, job))
    assert stats.skipped == {"first prompt reaches max_length": too_long} and 0 < too_long < 7
    assert stats.conversations == 7 - too_long == sum(bool(j.out) for j in done.values())


def test_a_corrupt_line_in_the_middle_is_refused_not_cut(tmp_path):
    """Only the last line can be half-written by a kill; a bad line elsewhere is named and nothing is dropped."""
    from eyas.data.regen_store import written_ids

    out = tmp_path / "out.jsonl"
    good = [json.dumps({"id": i, "messages": []}) for i in range(3)]
    out.write_text(good[0] + "\n" + "{garbage\n" + good[1] + "\n" + good[2] + "\n")
    before = out.read_bytes()
    with pytest.raises(ValueError, match=r"out.jsonl:2: not a conversation line"):
        written_ids(out)
    assert out.read_bytes() == before
    out.write_text("\n".join(good) + '\n{"id": 3, "mess')  # a kill mid-write: cut, the rest kept
    assert written_ids(out) == {0, 1, 2} and out.read_text() == "\n".join(good) + "\n"
