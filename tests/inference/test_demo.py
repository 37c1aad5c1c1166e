"""`eyas demo --quick` on a tiny target: every step at the quick plan's sizes, said to be a smoke run, and a stop
during its regeneration keeps the answers in flight and resumes."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import torch

from eyas.inference.cli import main
from eyas.inference.main_job import QUICK
from eyas.models.drafters import NAMES, algorithm
from tests.helpers.plots import assert_plotted
from tests.helpers.train import TINY_CONFIG, write_conversations, write_target

# five categories: the quick plan's one question per category, four of them
QUESTIONS = [{"question_id": i, "category": c, "turns": [f"w{i} w{i + 1} w{i + 2} hello"]}
             for i, c in enumerate(["writing", "roleplay", "reasoning", "math", "coding"])]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models gain nothing from threads; on a shared CPU spinning ones cost a lot
    yield
    torch.set_num_threads(before)


@pytest.fixture
def quick_args(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    target = write_target(tmp_path / "target")
    data = write_conversations(tmp_path / "convs.jsonl", rows=40)
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return ["demo", "--quick", "--config", str(TINY_CONFIG), "--questions", str(questions), "--distill-source",
            str(data), "--out", str(tmp_path / "run"), f"target.spec={target}"]


@pytest.mark.parametrize("head_type", NAMES)
def test_quick_demo_reaches_every_step_at_its_sizes_and_says_it_is_a_smoke_run(tmp_path, quick_args, capsys,
                                                                                head_type):
    """Every head type through the whole path: regenerated states of the layers it reads, trained, exported, bench."""
    reduced = ["head.draft_vocab_size=64"] if algorithm(head_type).reduced_vocab else []
    assert main([*quick_args, f"head.type={head_type}", *reduced]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "selfdistill.jsonl").read_text().splitlines()]
    assert 0 < len(rows) <= QUICK.distill.conversations
    assert (run / "checkpoints" / f"step-{QUICK.steps:08d}").is_dir()  # trained the quick plan's steps
    assert (run / "export" / "config.json").is_file()  # exported into the run folder
    report = json.loads((run / "bench" / "report.json").read_text())
    assert report["overall"]["questions"] == QUICK.limit < len(QUESTIONS)
    assert report["settings"]["max_new_tokens"] == QUICK.max_new_tokens
    assert "smoke run" in report["settings"]["note"]
    assert json.loads((run / "head" / "config.json").read_text())["head_type"] == head_type
    assert_plotted(run / "bench" / "report.png")
    note = QUICK.note()
    assert out.startswith(note) and out.rstrip().endswith(note)  # said before it starts and after the table
    table = out[out.index("$ eyas bench"):]
    assert table.count(note) == 3  # the bench command's --note, the line above its table, the closing line
    assert re.search(r"demo took \d+ min \d+ s", out)
    for step in ("data regenerate", "train", "export", "bench"):
        assert re.search(rf"# eyas {step}: \d+ min \d+ s", out)


def test_a_stop_in_quick_regeneration_keeps_the_answers_in_flight_and_the_rerun_finishes(
        tmp_path, quick_args, capsys, monkeypatch):
    import eyas.data.regenerate as regen

    pick, calls = regen.Scheduler._choose, []

    def ctrl_c_at_the_fifth_pick(*a):
        calls.append(1)
        if len(calls) == 5:  # every row is still writing its first answer
            os.kill(os.getpid(), signal.SIGINT)
        return pick(*a)

    monkeypatch.setattr(regen.Scheduler, "_choose", ctrl_c_at_the_fifth_pick)
    quick_args = quick_args + ["schedule.total_steps=4"]  # the user's overrides win over the quick plan's
    assert main(quick_args) == 130
    err = capsys.readouterr().err
    kept = re.search(r"kept (\d+) answers in flight cut where they stood \((\d+) tokens\), dropped (\d+) "
                     r"conversations in flight", err)
    assert kept and int(kept[1]) > 0 and int(kept[2]) > 0
    stored = (tmp_path / "run" / "selfdistill.jsonl").read_text().splitlines()
    assert len(stored) == int(kept[1])  # nothing had finished: what is stored is what the stop kept
    assert "stopped during `eyas data regenerate`" in err and "rerun the same command" in err
    assert not (tmp_path / "run" / "checkpoints").exists()  # the demo stopped there

    monkeypatch.setattr(regen.Scheduler, "_choose", pick)
    assert main(quick_args) == 0  # the same command continues from the kept answers
    assert "4 training steps" in capsys.readouterr().out  # the note says what ran
    assert (tmp_path / "run" / "checkpoints" / "step-00000004").is_dir()
    rows = [json.loads(x)["id"] for x in (tmp_path / "run" / "selfdistill.jsonl").read_text().splitlines()]
    assert len(rows) == len(set(rows)) > len(stored)
    assert (tmp_path / "run" / "bench" / "report.json").is_file()
