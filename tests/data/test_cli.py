"""`eyas data prepare | vocab | cache-hidden | regenerate` end to end on a tiny target folder."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import torch

from eyas.data.hidden_cache import HiddenStateDataset
from eyas.inference.cli import main
from eyas.models import default_fused_layer_ids
from tests.data.test_regenerate import conversations
from tests.helpers.tiny import tiny_model, tiny_tokenizer


def tiny_folder_and_chats(tmp_path, monkeypatch):
    """A tiny target saved as a folder, and 12 conversations as JSONL."""
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "target"
    tiny_model().save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(12)))
    return target, src


def test_data_commands(tmp_path, monkeypatch):
    target, src = tiny_folder_and_chats(tmp_path, monkeypatch)

    assert main(["data", "regenerate", "--target", str(target), "--source", str(src), "--out",
                 str(tmp_path / "regen.jsonl"), "--max-new-tokens", "6", "--batch-size", "4",
                 "--cache-hidden", str(tmp_path / "regen-hidden"), "--shard-examples", "5"]) == 0
    assert len((tmp_path / "regen.jsonl").read_text().splitlines()) == 12
    regen_cached = HiddenStateDataset(tmp_path / "regen-hidden")
    assert len(regen_cached) == 12 and len(regen_cached.index["shards"]) == 3
    assert regen_cached.layer_ids == list(default_fused_layer_ids(4))
    assert regen_cached[0]["hidden"].dtype == torch.bfloat16
    ex = tmp_path / "ex"
    assert main(["data", "prepare", "--target", str(target), "--source", str(tmp_path / "regen.jsonl"),
                 "--out", str(ex), "--held-out", "2"]) == 0
    assert json.loads((ex / "prepare.json").read_text())["train"] == 10
    assert main(["data", "vocab", "--target", str(target), "--examples", str(ex), "--size", "50",
                 "--out", str(tmp_path / "vocab.safetensors")]) == 0
    assert main(["data", "cache-hidden", "--target", str(target), "--examples", str(ex), "--out",
                 str(tmp_path / "hidden")]) == 0
    cached = HiddenStateDataset(tmp_path / "hidden")
    assert len(cached) == 10 and cached[0]["features"].shape[-1] == 64 * len(default_fused_layer_ids(4))
    assert main(["data", "prepare", "--target", str(target), "--source", str(tmp_path / "missing.json"),
                 "--out", str(ex)]) == 2


def test_regenerate_ctrl_c_keeps_the_finished_and_a_larger_limit_extends(tmp_path, monkeypatch, capsys):
    import eyas.data.regenerate as regen

    target, src = tiny_folder_and_chats(tmp_path, monkeypatch)
    args = ["data", "regenerate", "--target", str(target), "--source", str(src), "--out", str(tmp_path / "regen.jsonl"),
            "--max-new-tokens", "6", "--batch-size", "4", "--cache-hidden", str(tmp_path / "hidden")]
    pick, calls = regen.Scheduler._choose, []

    def ctrl_c_at_the_tenth_pick(*a):
        calls.append(1)
        if len(calls) == 10:
            os.kill(os.getpid(), signal.SIGINT)
        return pick(*a)

    monkeypatch.setattr(regen.Scheduler, "_choose", ctrl_c_at_the_tenth_pick)
    assert main(args + ["--limit", "8"]) == 130
    err = capsys.readouterr().err
    stored = len((tmp_path / "regen.jsonl").read_text().splitlines())
    assert 0 < stored < 8 and f"stopped early after {stored} conversations" in err and "rerun the same command" in err
    assert re.search(r"dropped [1-9]\d* conversations in flight \([1-9]\d* generated tokens\)", err)  # batch of 4
    assert len(HiddenStateDataset(tmp_path / "hidden")) == stored  # readable at once
    monkeypatch.setattr(regen.Scheduler, "_choose", pick)
    assert main(args + ["--limit", "12"]) == 0
    rows = (tmp_path / "regen.jsonl").read_text().splitlines()
    assert len(rows) == len(HiddenStateDataset(tmp_path / "hidden")) == 12


def test_help_does_not_import_torch():
    code = "import sys, eyas.data.cli; assert 'torch' not in sys.modules and 'datasets' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
