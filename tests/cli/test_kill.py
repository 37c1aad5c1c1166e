"""Killed at random moments (SIGKILL: no handler runs), then rerun to the end: train, export, regenerate and
cache-hidden leave no debris, no duplicated or lost rows, and (where the work is deterministic) what an
uninterrupted run writes. A first SIGINT/SIGTERM during training saves a checkpoint and exits 130/143."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli.harness import debris, snapshot

KILLS = 3  # kill moments per run, each drawn from the seeded generator over the uninterrupted run's duration


def _timed(eyas, argv, cwd) -> float:
    start = time.perf_counter()
    result = eyas.run(argv, cwd)
    assert result.status == 0, result.stderr[-3000:]
    return time.perf_counter() - start


def _killed_then_finished(eyas, argv, cwd: Path, duration: float, seed: int) -> list[float]:
    """Start `argv` KILLS times, SIGKILL each at a random moment within `duration`, then run it to the end."""
    rng, moments = random.Random(seed), []
    for _ in range(KILLS):
        moment = rng.uniform(0.05, duration)
        pid, _, _ = eyas.start(argv, cwd)
        time.sleep(moment)
        os.kill(pid, signal.SIGKILL)  # may come after it finished: then nothing is left to clean up
        assert eyas.wait(pid) in (0, -signal.SIGKILL)
        moments.append(round(moment, 2))
    result = eyas.run(argv, cwd)
    assert result.status == 0, result.stderr[-3000:]
    assert not debris(cwd), debris(cwd)
    return moments


def _tree_equal(a: Path, b: Path) -> None:
    assert snapshot(a) == snapshot(b)


def _train_rows(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]


TRAIN = ["schedule.total_steps=6", "checkpoint.every=2", "logging.every=1", "logging.eval_batches=0"]


def _train_argv(assets, out: Path) -> list[str]:
    return ["train", "--config", str(assets["config"]), f"target.spec={assets['target']}",
            f"data.source={assets['chats']}", f"output_dir={out}", *TRAIN]


@pytest.mark.parametrize("seed", [0, 1])
def test_train_killed_resumes_without_duplicate_or_lost_steps(eyas, assets, tmp_path, seed):
    duration = _timed(eyas, _train_argv(assets, tmp_path / "straight"), tmp_path)
    moments = _killed_then_finished(eyas, _train_argv(assets, tmp_path / "killed"), tmp_path, duration, seed)
    straight, killed = _train_rows(tmp_path / "straight"), _train_rows(tmp_path / "killed")
    assert [s for s, _ in killed] == list(range(1, 7)), (moments, killed)  # each step once, in order
    assert [loss for _, loss in killed] == pytest.approx([loss for _, loss in straight], abs=1e-6), moments
    assert not list((tmp_path / "killed" / "checkpoints").glob(".step-*"))
    a, b = (load_file(tmp_path / run / "head" / "model.safetensors") for run in ("straight", "killed"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), moments


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_train_stopped_by_a_signal_saves_and_exits_with_its_status(eyas, assets, tmp_path, signum, status):
    out = tmp_path / "run"
    argv = _train_argv(assets, out)[:-len(TRAIN)] + ["schedule.total_steps=400", "checkpoint.every=200",
                                                     "logging.every=1", "logging.eval_batches=0"]
    pid, _, err = eyas.start(argv, tmp_path)
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").is_file() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        assert time.time() < deadline, err.read_text()[-2000:]
        time.sleep(0.05)
    os.kill(pid, signum)
    assert eyas.wait(pid) == status, err.read_text()[-2000:]
    text = err.read_text()
    assert "Traceback" not in text and "resume with the same command" in text  # the trainer's notes: stderr
    (saved,) = (out / "checkpoints").glob("step-*")
    step = json.loads((saved / "trainer.json").read_text())["step"]
    assert 3 <= step < 400 and [s for s, _ in _train_rows(out)] == list(range(1, step + 1))


def test_export_killed_leaves_the_old_head_or_the_new_one(eyas, assets, tmp_path):
    argv = ["export", str(assets["head"]), "--out", str(tmp_path / "out"), "--format", "speculators"]
    duration = _timed(eyas, ["export", str(assets["head"]), "--out", str(tmp_path / "reference"), "--format",
                             "speculators"], tmp_path)
    for seed in range(3):
        _killed_then_finished(eyas, argv, tmp_path, duration * 1.5, seed)
        _tree_equal(tmp_path / "out", tmp_path / "reference")


REGEN = ["--limit", "8", "--max-new-tokens", "6", "--batch-size", "2", "--shard-examples", "2"]


@pytest.mark.parametrize("seed", [0, 1])
def test_regenerate_killed_keeps_every_row_once(eyas, assets, tmp_path, seed):
    from eyas.data.hidden_cache import HiddenStateDataset, stored_shards

    def argv(name):
        return ["data", "regenerate", "--target", str(assets["target"]), "--source", str(assets["chats"]),
                "--out", str(tmp_path / f"{name}.jsonl"), "--cache-hidden", str(tmp_path / f"{name}-hidden"), *REGEN]

    duration = _timed(eyas, argv("straight"), tmp_path)
    moments = _killed_then_finished(eyas, argv("killed"), tmp_path, duration, seed)
    ids = [json.loads(line)["id"] for line in (tmp_path / "killed.jsonl").read_text().splitlines()]
    assert sorted(int(i) for i in ids) == list(range(8)), (moments, ids)  # none lost, none twice
    cached = sorted(i for shard, _ in stored_shards(tmp_path / "killed-hidden") for i in shard)
    assert cached == list(range(8)) and len(HiddenStateDataset(tmp_path / "killed-hidden")) == 8, moments


def test_cache_hidden_killed_resumes_to_the_same_cache(eyas, assets, tmp_path):
    from eyas.data.hidden_cache import HiddenStateDataset
    from eyas.models import Target
    from tests.helpers.stored import assert_states_of_a_lone_forward

    def argv(name):  # fp32 states (stored in bf16), whether or not this CPU computes bf16 natively
        return ["data", "cache-hidden", "--target", str(assets["target"]), "--examples", str(assets["examples"]),
                "--out", str(tmp_path / name), "--batch-size", "2", "--dtype", "fp32"]

    target = Target.load(str(assets["target"]), dtype="fp32")
    duration = _timed(eyas, argv("straight"), tmp_path)
    for seed in range(2):
        moments = _killed_then_finished(eyas, argv("killed"), tmp_path, duration, seed)
        a, b = HiddenStateDataset(tmp_path / "straight"), HiddenStateDataset(tmp_path / "killed")
        assert len(a) == len(b) == 14, moments
        for i in range(len(a)):
            for key in ("input_ids", "loss_mask"):
                assert torch.equal(a[i][key], b[i][key]), (moments, i, key)
            assert_states_of_a_lone_forward(b[i], target, b.layer_ids)
