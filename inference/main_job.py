"""`eyas demo`, the main job: train the demo head, export it, benchmark it, say where everything is.

Thin on purpose: each step is the real `eyas` command, printed before it runs, so the user can
rerun or vary any of them by hand. Training resumes from its newest checkpoint when rerun.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Sequence

from .bench import load_questions

QUESTIONS_HINT = ("pass --questions: an MT-bench question.jsonl (FastChat's "
                  "fastchat/llm_judge/data/mt_bench/question.jsonl, 80 rows of question_id, category, turns)")


def run_main_job(
    config: str | os.PathLike, questions: str | os.PathLike | None, head_out: str | os.PathLike,
    report: str | os.PathLike | None = None, dtype: str = "fp32", limit: int | None = None,
    max_new_tokens: int = 256, overrides: Sequence[str] = (),
) -> int:
    """Run train -> export -> bench; returns the exit status of the first failing step, else 0."""
    from eyas.train.config import load_config

    if questions is None:
        raise ValueError(QUESTIONS_HINT)
    load_questions(questions, limit)  # a bad questions file fails now, not after training
    config = _find_config(config)
    run = load_config(config, list(overrides))

    report = Path(report) if report is not None else Path(run.output_dir) / "bench" / "report.json"
    steps = [
        ["train", "--config", str(config), *overrides],
        ["export", str(Path(run.output_dir) / "head"), "--out", str(head_out)],  # the trainer's final head
        ["bench", "--target", run.target.spec, "--head", str(head_out), "--questions", str(questions),
         "--out", str(report), "--dtype", dtype, "--max-new-tokens", str(max_new_tokens), "--prompt-lookup",
         *(["--limit", str(limit)] if limit is not None else [])],
    ]
    for argv in steps:
        if rc := _step(argv):
            return rc
    print(f"\nhead:   {head_out}  (trained in {run.output_dir})\nreport: {report}\nplot:   {report.with_suffix('.png')}")
    return 0


def _find_config(config: str | os.PathLike) -> Path:
    """As given, else relative to the source checkout (the demo config ships in its configs/)."""
    path = Path(config)
    if path.is_file():
        return path
    beside_source = Path(__file__).resolve().parents[1] / path
    if not path.is_absolute() and beside_source.is_file():
        return beside_source
    raise FileNotFoundError(f"training config {config} not found (run from the eyas checkout or pass --config)")


def _step(argv: list[str]) -> int:
    from .cli import main

    print(f"\n$ eyas {shlex.join(argv)}", flush=True)
    return main(argv)
