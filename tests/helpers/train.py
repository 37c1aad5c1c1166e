"""Fixtures for the training tests: a tiny target saved as an HF folder and a conversation file,
so a run can be driven entirely by a RunConfig (in-process or under `accelerate launch`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from eyas.train.config import RunConfig, load_config
from tests.helpers.tiny import tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "configs" / "tiny-eagle3.yaml"


def write_target(folder: Path, arch: str = "llama") -> Path:
    if not (folder / "config.json").is_file():
        tiny_model(arch, seed=0).save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
    return folder


def write_conversations(path: Path, rows: int = 24, words: int = 14, seed: int = 0) -> Path:
    """Equal-length conversations (so every rank sees the same token count); the assistant
    continues a word pattern the head can learn."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            start = rng.randrange(0, 200)
            user = " ".join(f"w{start + i}" for i in range(words))
            answer = " ".join(f"w{(start + 2 * i) % 250}" for i in range(words))
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def tiny_run_config(tmp: Path, *overrides: str) -> RunConfig:
    """The tiny CI config pointed at a tiny target and conversations under `tmp`."""
    target = write_target(tmp.parent / "tiny-target") if (tmp.parent / "tiny-target").exists() else write_target(
        tmp.parent / "tiny-target")
    data = tmp.parent / "conversations.jsonl"
    if not data.is_file():
        write_conversations(data)
    return load_config(TINY_CONFIG, [f"target.spec={target}", f"data.source={data}", f"output_dir={tmp}",
                                     *overrides])


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state so the next in-process run builds a fresh Accelerator."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
