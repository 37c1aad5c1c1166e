"""What the corpus and kill tests start from, built once per session: a tiny target folder, heads for it,
conversations, prepared examples and a training checkpoint (all tiny, all CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eyas.models import DraftHead, Target, head_config_for, save_head
from tests.helpers.train import TINY_CONFIG, write_conversations, write_target


def _head(target: Target, folder: Path, head_type: str) -> Path:
    torch.manual_seed(0)
    vocab = 120 if head_type == "eagle3" else None
    head = DraftHead(head_config_for(target, head_type, draft_vocab_size=vocab, num_layers=1), target)
    if head_type == "eagle3":
        head.set_vocab_map(torch.randperm(target.vocab_size)[:120].sort().values)
    return save_head(head, folder)


def build_assets(root: Path, eyas) -> dict[str, Path]:
    """Paths by name; `eyas` is the tests.cli.harness.EyasProcesses that runs the commands."""
    a = {"root": root, "target": write_target(root / "target"), "config": TINY_CONFIG}
    target = Target.load(str(a["target"]))
    a["head"] = _head(target, root / "head-eagle3", "eagle3")
    a["head1"] = _head(target, root / "head-eagle1", "eagle1")
    a["chats"] = write_conversations(root / "chats.jsonl", rows=16)
    a["questions"] = root / "questions.jsonl"
    a["questions"].write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": [f"w{i} w{i + 1}"]})
                                      + "\n" for i in range(2)))
    a["examples"] = root / "examples"
    for argv in (["data", "prepare", "--target", a["target"], "--source", a["chats"], "--out", a["examples"],
                  "--held-out", "2"],
                 ["train", "--config", TINY_CONFIG, f"target.spec={a['target']}", f"data.source={a['chats']}",
                  f"output_dir={root / 'run'}", "schedule.total_steps=2", "checkpoint.every=2", "logging.every=1"]):
        result = eyas.run(argv, root)
        assert result.status == 0, result.stderr[-3000:]
    a["run"] = root / "run"
    a["checkpoint"] = root / "run" / "checkpoints" / "step-00000002"
    return a
