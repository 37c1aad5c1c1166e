"""The drafter algorithms side by side on the demo target: the same regenerated data, the same wall-clock training
budget, then held-out acceptance per draft position, tau, draft milliseconds per cycle and MT-bench speedup over
`generate` (fp32 greedy, and bf16 where the CPU computes it natively).

    python benchmarks/drafters.py --cache runs/cmp/hidden --source runs/cmp/regen.jsonl --budget-minutes 15

The budget is the same for every head: each head's seconds per optimizer step are measured back to back first (a
few steps each, the heads alternated), and each then trains budget / its step time steps on a cosine schedule.
Heads train offline from one hidden-state cache holding every layer any of them reads (`eyas data regenerate
--cache-hidden ... --layers 2,9,15,21,27,28` for SmolLM2's 30 layers). Writes OUT/report.json and OUT/report.png and
prints one table; every number in it comes from this one run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from eyas.inference.bench import run_bench
from eyas.models.cpu_kernels import native_bf16
from eyas.train.config import load_config
from eyas.train.trainer import run

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "smollm2-135m-eagle3.yaml"
# name -> overrides of the demo config (a one-layer EAGLE-3): the algorithms, EAGLE-3.1 as EAGLE-3 with its two
# norms; P-EAGLE and DFlash at their own default depths (4 and 3 layers), which the equal time budget pays for
VARIANTS = {
    "eagle3": ["head.type=eagle3"],
    "eagle3.1": ["head.type=eagle3", "head.options={fc_norm: true, norm_output: true}"],
    "peagle": ["head.type=peagle", "head.num_layers=null", "head.draft_vocab_size=8192", "head.options={depths: 6}"],
    "dflash": ["head.type=dflash", "head.num_layers=null", "head.draft_vocab_size=null",
               "head.options={block_size: 8, anchors: 32}"],
}


def overrides(args, name: str, out: Path, steps: int) -> list[str]:
    return [*VARIANTS[name], f"output_dir={out / name}", f"data.source={args.source}", "data.hidden_states=offline",
            f"data.cache_dir={args.cache}", f"data.vocab_cache={out / 'vocab_map.safetensors'}",
            f"schedule.total_steps={steps}", "schedule.warmup_steps=10", "logging.every=10", "logging.eval_every=0",
            "logging.backend=none", f"checkpoint.every={max(steps, 1)}", "checkpoint.keep=1",
            *args.override]


def step_seconds(args, out: Path, names: list[str], short: int = 2, long: int = 8) -> dict[str, float]:
    """Seconds per optimizer step of each head: (time of a `long`-step run - a `short`-step one) / the difference,
    so setup (loading, the draft vocabulary) cancels; the heads' runs alternate, so the machine's pace hits all."""
    took: dict[str, dict[int, float]] = {n: {} for n in names}
    for steps in (short, long):
        for name in names:
            folder = out / "calibrate" / f"{name}-{steps}"
            started = time.perf_counter()
            run(load_config(CONFIG, [*overrides(args, name, out, steps), f"output_dir={folder}",
                                     "logging.eval_batches=0"]))
            took[name][steps] = time.perf_counter() - started
    return {n: max(t[long] - t[short], 1e-3) / (long - short) for n, t in took.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", required=True, help="hidden-state cache holding every layer the heads read")
    p.add_argument("--source", required=True, help="the regenerated conversations the cache was written from")
    p.add_argument("--heads", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--budget-minutes", type=float, default=15.0, help="training time per head")
    p.add_argument("--out", default="runs/drafters", help="folder for the runs, the report and the plot")
    p.add_argument("--per-category", type=int, default=1, help="MT-bench questions per category in the bench")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="more run config overrides")
    p.add_argument("--train-only", action="store_true", help="train (or resume) every head, bench none")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(torch.get_num_threads())

    calibration = out / "step_seconds.json"  # measured once: a rerun trains (resumes) and benches the same steps
    if not calibration.is_file():
        calibration.write_text(json.dumps(step_seconds(args, out, args.heads)))
    seconds = json.loads(calibration.read_text())
    report: dict = {"budget_minutes": args.budget_minutes, "cpu": _cpu(), "heads": {}}
    for name in args.heads:  # every head trains first, then every head is benched (a run can bench on a quiet machine)
        steps = max(10, int(args.budget_minutes * 60 / seconds[name]))
        held_out = run(load_config(CONFIG, [*overrides(args, name, out, steps), "logging.eval_batches=16"]))
        report["heads"][name] = {"step_seconds": seconds[name], "steps": steps,
                                 "held_out": {k.removeprefix("eval/"): v for k, v in held_out.items()}}
    if args.train_only:
        return
    for name in args.heads:
        entry = report["heads"][name]
        for dtype in ["fp32"] + (["bf16"] if native_bf16() else []):
            bench = run_bench("smollm2-135m", str(out / name / "head"), "mt-bench", dtype=dtype,
                              per_category=args.per_category, max_new_tokens=args.max_new_tokens,
                              out=out / name / f"bench-{dtype}.json", progress=False)
            o, rows = bench["overall"], bench["questions"]
            drafting = sum(n > 0 for r in rows for n in r["drafted"])
            entry[dtype] = {"tau": o["tau"], "speedup": o.get("speedup"), "tokens_per_s": o["spec_tokens_per_s"],
                            "generate_tokens_per_s": o.get("baseline_tokens_per_s"),
                            "accept_rate_per_position": o["accept_rate_per_position"],
                            "draft_ms_per_cycle": 1e3 * sum(r["draft_time_s"] for r in rows) / max(drafting, 1),
                            "exact": o["exact_match_fraction"]}
        (out / "report.json").write_text(json.dumps(report, indent=2))
    print(table(report))
    plot(report, out / "report.png")


def table(report: dict) -> str:
    lines = [f"{'head':<10} {'steps':>6} {'held-out tau':>12} {'acc@1..4':>24} {'dtype':>5} {'tau':>5} "
             f"{'draft ms':>8} {'tok/s':>6} {'generate':>8} {'speedup':>7} {'exact':>5}"]
    for name, e in report["heads"].items():
        acc = " ".join(f"{e['held_out'].get(f'acc/step{i}', 0):.2f}" for i in range(4))
        for dtype in ("fp32", "bf16"):
            if dtype not in e:
                continue
            b = e[dtype]
            lines.append(f"{name:<10} {e['steps']:>6} {e['held_out'].get('tau', 0):>12.2f} {acc:>24} {dtype:>5} "
                         f"{b['tau']:>5.2f} {b['draft_ms_per_cycle']:>8.1f} {b['tokens_per_s']:>6.1f} "
                         f"{b['generate_tokens_per_s'] or 0:>8.1f} {b['speedup'] or 0:>6.2f}x {b['exact'] or 0:>5.2f}")
    lines.append(f"budget {report['budget_minutes']:g} min of training per head; {report['cpu']}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_speed) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, e in report["heads"].items():
        held = [e["held_out"].get(f"acc/step{i}") for i in range(8)]
        held = [a for a in held if a is not None]
        ax_acc.plot(range(1, len(held) + 1), held, marker="o", label=name)
    ax_acc.set(xlabel="draft position", ylabel="held-out top-1 accuracy", title="held-out acceptance per position")
    ax_acc.legend()
    names = list(report["heads"])
    for k, dtype in enumerate(("fp32", "bf16")):
        values = [report["heads"][n].get(dtype, {}).get("speedup") or 0 for n in names]
        bars = ax_speed.bar([i + 0.4 * k for i in range(len(names))], values, width=0.4, label=dtype)
        ax_speed.bar_label(bars, fmt="%.2fx", fontsize=8)
    ax_speed.axhline(1.0, color="grey", lw=0.8)
    ax_speed.set_xticks([i + 0.2 for i in range(len(names))], names)
    ax_speed.set(ylabel="speedup over generate", title="MT-bench, greedy")
    ax_speed.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _cpu() -> str:
    from eyas.inference.bench import machine

    m = machine()
    return f"{m['cpu']}, {m['cores']} cores, native bf16: {native_bf16() or 'none'}"


if __name__ == "__main__":
    main()
