"""`eyas demo`, the main job: make self-distilled data, train the demo head, export it, benchmark it.

Thin on purpose: each step is the real `eyas` command, printed before it runs, so the user can
rerun or vary any of them by hand. Every step resumes: regeneration skips conversations already
written, training continues from its newest checkpoint.

Why self-distillation: the head is judged on how often it guesses what *this* target says. ShareGPT's
answers were written by other models; the target rewriting them (greedy, as the benchmark decodes)
gives training text whose next tokens the head can actually learn. The main job writes it to
<output_dir>/selfdistill.jsonl with `eyas data regenerate` and trains on it (`data.source=` that file).

How large each step is comes from a `DemoPlan`: FULL (the main job) or QUICK (`eyas demo --quick`: the same
steps, each small enough that the whole run takes minutes on 2 CPU cores; a smoke run, and it says so).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
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


@dataclass(frozen=True)
class DemoPlan:
    """How large each step of the demo is: FULL, the main job, or QUICK, a smoke run of the same steps."""

    distill: SelfDistill = SelfDistill()
    steps: int | None = None  # training steps (None: the config's schedule)
    training: tuple[str, ...] = ()  # more config overrides, applied before the user's own
    per_category: int | None = None  # bench questions: the first N of each category (None: all) ...
    limit: int | None = None  # ... then the first N of those (None: all)
    max_new_tokens: int = 256  # per bench question
    # A stop during regeneration keeps the answers in flight, cut where they stand (regenerate --keep-in-flight)
    # instead of dropping them for the rerun to regenerate in full.
    keep_in_flight: bool = False
    suffix: str = ""  # added to the default run and head folders: a quick run never resumes into a full one
    smoke: bool = False  # too small to measure anything: said before it starts and in the report, table and plot

    def overrides(self) -> list[str]:
        """The plan's training config overrides."""
        return ([f"schedule.total_steps={self.steps}"] if self.steps is not None else []) + list(self.training)

    def sizes(self, steps: int | None = None) -> str:
        """Its sizes in words: conversations, training steps (`steps`, else the plan's), bench questions."""
        steps = steps if steps is not None else self.steps
        trained = f"{steps} training steps" if steps is not None else "the config's training steps"
        return (f"{self.distill.conversations} conversations of at most {self.distill.max_new_tokens} tokens, "
                f"{trained}, {self.limit or 'all'} questions x {self.max_new_tokens} tokens")

    def note(self, steps: int | None = None) -> str | None:
        """What a smoke run of `steps` training steps is, in one line (None for a real run)."""
        if not self.smoke:
            return None
        return (f"quick demo, a smoke run ({self.sizes(steps)}): the head is barely trained, so its tau and speedup "
                "say nothing about what eyas does; `eyas demo` is the real run")


FULL = DemoPlan()
QUICK = DemoPlan(
    # Sized for ~10 minutes on 2 CPU cores. A quarter of ShareGPT's first prompts reach 320 tokens and are
    # skipped: ~95 answers of up to 96 tokens.
    SelfDistill(conversations=128, max_new_tokens=96, max_length=320, batch_size=32),
    steps=60,
    training=("schedule.warmup_steps=6", "logging.every=5", "logging.eval_every=0", "checkpoint.every=30",
              "data.held_out=8",
              "data.vocab_source=null"),  # count the draft vocab on the training data: all of ShareGPT takes minutes
    per_category=1, limit=4, max_new_tokens=64, keep_in_flight=True, suffix="-quick", smoke=True,
)


def run_main_job(
    config: str | os.PathLike, questions: str | os.PathLike, plan: DemoPlan = FULL,
    head_out: str | os.PathLike | None = None, out: str | os.PathLike | None = None,
    report: str | os.PathLike | None = None, dtype: str = "auto", overrides: Sequence[str] = (),
) -> int:
    """Run [regenerate ->] train -> export -> bench at the plan's sizes; returns the exit status of the first failing
    step, else 0.

    out: the run folder (self-distilled data, training run, bench report); default the config's output_dir + the
    plan's suffix. head_out: the exported head; default heads/<config name> + suffix, or OUT/export with `out`.
    """
    from eyas.train.config import load_config

    from .bench import load_questions

    load_questions(questions, plan.limit, plan.per_category)  # a bad questions file fails now, not after training
    config = _find_config(config)
    base = load_config(config, [*plan.overrides(), *overrides])
    run_dir = Path(out) if out is not None else Path(base.output_dir + plan.suffix)
    # every step runs the target in one dtype (the head trains on the states it will draft from)
    overrides = [*plan.overrides(), f"output_dir={run_dir}", f"target.dtype={dtype}", *overrides]
    run = load_config(config, overrides)  # the user's own output_dir= wins
    run_dir = Path(run.output_dir)
    if head_out is None:
        head_out = Path(out) / "export" if out is not None else Path("heads") / (config.stem + plan.suffix)
    report = Path(report) if report is not None else run_dir / "bench" / "report.json"
    distill = plan.distill
    steps = []
    if note := plan.note(run.schedule.total_steps):  # the steps the user's overrides leave
        print(f"{note}\n", flush=True)
    if distill.conversations > 0:  # states captured while generating: training needs no target pass
        data, cache = run_dir / "selfdistill.jsonl", run_dir / "hidden"
        steps.append(["data", "regenerate", "--target", run.target.spec, "--source", distill.source,
                      "--out", str(data), "--cache-hidden", str(cache), "--head-type", run.head.type,
                      "--limit", str(distill.conversations), "--max-turns", "1",
                      "--max-new-tokens", str(distill.max_new_tokens), "--max-length", str(distill.max_length),
                      "--batch-size", str(distill.batch_size), "--dtype", dtype,
                      *(["--keep-in-flight"] if plan.keep_in_flight else []),
                      *(["--head-layers", str(run.head.num_layers)] if run.head.num_layers else []),
                      *(["--layers", ",".join(map(str, layers))] if (layers := run.head.fused_layer_ids) else [])])
        overrides += [f"data.source={data}", "data.hidden_states=offline", f"data.cache_dir={cache}"]
    steps += [
        ["train", "--config", str(config), *overrides],
        ["export", str(run_dir / "head"), "--out", str(head_out)],  # the trainer's final head
        ["bench", "--target", run.target.spec, "--head", str(head_out), "--questions", str(questions),
         "--out", str(report), "--dtype", dtype, "--max-new-tokens", str(plan.max_new_tokens), "--prompt-lookup",
         *(["--limit", str(plan.limit)] if plan.limit is not None else []),
         *(["--per-category", str(plan.per_category)] if plan.per_category is not None else []),
         *(["--note", note] if note else [])],
    ]
    started = time.perf_counter()
    for argv in steps:
        if rc := _step(argv):
            if rc in (130, 143):  # stopped by a signal: every step resumes
                print(f"\neyas demo: stopped during `{_name(argv)}`; rerun the same command to continue",
                      file=sys.stderr)
            return rc
    print(f"\nhead:   {head_out}  (trained in {run_dir})\nreport: {report}\nplot:   {report.with_suffix('.png')}\n"
          f"demo took {_minutes(time.perf_counter() - started)}" + (f"\n{note}" if note else ""))
    return 0


def plan_with(plan: DemoPlan, **changes) -> DemoPlan:
    """`plan` with the changes that are not None: the demo's command-line flags over a plan's own sizes."""
    distill = {k: v for k, v in changes.pop("distill", {}).items() if v is not None}
    return dataclasses.replace(plan, distill=dataclasses.replace(plan.distill, **distill),
                               **{k: v for k, v in changes.items() if v is not None})


def _name(argv: list[str]) -> str:
    """The command a step runs, e.g. `eyas data regenerate`."""
    return "eyas " + " ".join(argv[:2] if argv[0] == "data" else argv[:1])


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s"


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
    started = time.perf_counter()
    rc = main(argv)
    print(f"# {_name(argv)}: {_minutes(time.perf_counter() - started)}", flush=True)
    return rc
