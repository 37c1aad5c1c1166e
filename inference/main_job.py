"""`eyas demo`, the main job: make self-distilled data, train the demo head, export it, benchmark it.

Thin on purpose: each step is the real `eyas` command, printed before it runs, so the user can
rerun or vary any of them by hand. Every step resumes: regeneration skips conversations already
written, training continues from its newest checkpoint.

Why self-distillation: the head is judged on how often it guesses what *this* target says. ShareGPT's
answers were written by other models; the target rewriting them (greedy, as the benchmark decodes)
gives training text whose next tokens the head can actually learn. The main job writes it to
<output_dir>/selfdistill.jsonl with `eyas data regenerate` and trains on it (`data.source=` that file).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence



@dataclass(frozen=True)
class SelfDistill:
    """How the training file is made: the target answers the first user turn of `source`'s conversations."""

    source: str = "sharegpt"
    # The first N conversations (prompts over max_length are skipped): 800 take ~45 min on 2 CPU cores.
    # 0 = no self-distillation, train on the config's data.source as it is.
    conversations: int = 800
    max_new_tokens: int = 384
    max_length: int = 640  # prompt + answer
    batch_size: int = 64  # fp32 batched decoding on a CPU gets cheaper per token up to ~64 rows


def run_main_job(
    config: str | os.PathLike, questions: str | os.PathLike, head_out: str | os.PathLike,
    report: str | os.PathLike | None = None, dtype: str = "fp32", limit: int | None = None,
    per_category: int | None = None, max_new_tokens: int = 256, overrides: Sequence[str] = (),
    distill: SelfDistill = SelfDistill(),
) -> int:
    """Run [regenerate ->] train -> export -> bench; returns the exit status of the first failing step, else 0."""
    from eyas.train.config import load_config

    from .bench import load_questions

    load_questions(questions, limit, per_category)  # a bad questions file fails now, not after training
    config = _find_config(config)
    run = load_config(config, list(overrides))

    report = Path(report) if report is not None else Path(run.output_dir) / "bench" / "report.json"
    steps, overrides = [], list(overrides)
    if distill.conversations > 0:  # states captured while generating: training needs no target pass
        data, cache = Path(run.output_dir) / "selfdistill.jsonl", Path(run.output_dir) / "hidden"
        steps.append(["data", "regenerate", "--target", run.target.spec, "--source", distill.source,
                      "--out", str(data), "--cache-hidden", str(cache), "--head-type", run.head.type,
                      "--limit", str(distill.conversations), "--max-turns", "1",
                      "--max-new-tokens", str(distill.max_new_tokens), "--max-length", str(distill.max_length),
                      "--batch-size", str(distill.batch_size), "--dtype", "fp32",
                      *(["--layers", ",".join(map(str, layers))] if (layers := run.head.fused_layer_ids) else [])])
        overrides += [f"data.source={data}", "data.hidden_states=offline", f"data.cache_dir={cache}"]
    steps += [
        ["train", "--config", str(config), *overrides],
        ["export", str(Path(run.output_dir) / "head"), "--out", str(head_out)],  # the trainer's final head
        ["bench", "--target", run.target.spec, "--head", str(head_out), "--questions", str(questions),
         "--out", str(report), "--dtype", dtype, "--max-new-tokens", str(max_new_tokens), "--prompt-lookup",
         *(["--limit", str(limit)] if limit is not None else []),
         *(["--per-category", str(per_category)] if per_category is not None else [])],
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
    from eyas.models.errors import MissingInput

    raise MissingInput(f"training config {config} not found (run from the eyas checkout or pass --config)")


def _step(argv: list[str]) -> int:
    from .cli import main

    print(f"\n$ eyas {shlex.join(argv)}", flush=True)
    return main(argv)
