"""What `eyas bench` reports, from its per-question rows: the summary, the table and the plot.

Every summary is recomputed from the rows alone, so a report.json can be re-summarised or
merged later. Conventions:
- tau: tokens gained per target verify forward (accepted drafts + the bonus token), pooled
  over all cycles of all questions.
- accept_rate_per_position[k]: among cycles that drafted position k+1 and accepted at least k
  drafts, the fraction that accepted at least k+1 (None where no cycle reached position k).
  Cycles of plain decoding (the planner found no tree worth drafting) draft nothing, so they
  count in tau (one token each) but not here; plain_cycle_fraction says how many there were.
- speedup: baseline time / eyas time over the same questions. When both produced the same
  number of tokens for every question (greedy) that is a ratio of times for the same tokens
  (`speedup_basis: "time"`); otherwise (sampling, or a mismatch) it is the ratio of tokens/s
  (`speedup_basis: "tokens_per_s"`).
- prompt_lookup_speedup: the prompt-lookup baseline's own speedup over plain generate, on
  the same basis, so it compares directly with `speedup`.
- engine_overhead_fraction: (total - draft - target) / total, eyas's own wall time.
- out_of_draft_vocab_fraction: share of eyas's output tokens outside the head's draft vocabulary
  (EAGLE-3): the head can never propose them, so each one ends its draft path. A high share (in
  one category, say) means the draft vocab, not the head's training, limits acceptance there.
- eyas_plain_* (with --eyas-plain): plain one-token decoding through eyas's Target. Its speedup
  over generate is what eyas's faster kernels alone give; `speedup_over_eyas_plain` is what the
  speculation adds on top of them.
- per-question speedups (`question_speedups`): each question's speedup over the reference, plain decoding
  through eyas's own Target when it ran (--eyas-plain), else generate, on the basis above, from the row's
  median times over its repeats. `worst_question_speedup` (and which question), `p10_question_speedup`,
  `median_question_speedup`, `slower_question_fraction` (share of questions below 1.0x), and
  `worst_run_speedup`: the lowest speedup of any single repeat (repeat r of eyas against repeat r of the
  reference, run beside it). `reference_vs_itself_worst_run` (with repeats): the machine's noise on the same
  scale, the lowest ratio between two repeats of the reference on one question (A/A); a worst run above it
  is within what identical runs differ by.
- vllm_* (with --vllm): the same head in vLLM (runtimes_vllm.py), a chain of vllm_draft_tokens per step.
  vllm_tau and vllm_accept_rate_per_position follow the definitions above; vllm_speedup is over generate;
  vllm_plain_* is vLLM without the head and `vllm_speedup_over_plain` what the head adds inside vLLM.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Sequence

from eyas.models.atomic import atomic_file


def summarize(rows: Sequence[dict[str, Any]], sampling: bool, depth: int | None = None) -> dict[str, Any]:
    """{"overall": {...}, "per_category": {category: {...}}, "questions": rows}."""
    by_category: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_category[r["category"]].append(r)
    positions = max([depth or 0] + [a - 1 for r in rows for a in r["accepted"]]
                    + [d for r in rows for d in r.get("depths", ())])
    return {
        "overall": _summary(rows, sampling, positions),
        "per_category": {c: _summary(rs, sampling, positions) for c, rs in by_category.items()},
        "questions": list(rows),
    }


def _summary(rows: Sequence[dict[str, Any]], sampling: bool, positions: int) -> dict[str, Any]:
    accepted = [a for r in rows for a in r["accepted"]]
    # rows from before per-cycle depths were recorded: every cycle drafted as deep as `positions`
    depths = [d for r in rows for d in r.get("depths", [positions] * len(r["accepted"]))]
    drafted = [n for r in rows for n in r.get("drafted", ())]
    spec_tokens, spec_time = _total(rows, "spec_tokens"), _total(rows, "spec_time_s")
    engine_time = _total(rows, "engine_time_s")
    draft_time, target_time = _total(rows, "draft_time_s"), _total(rows, "target_time_s")
    s: dict[str, Any] = {
        "questions": len(rows),
        "tau": sum(accepted) / len(accepted) if accepted else 0.0,
        "accept_rate_per_position": accept_rate_per_position(accepted, positions, depths),
        "plain_cycle_fraction": _ratio(sum(d == 0 for d in depths), len(depths)),
        "mean_draft_nodes": _ratio(sum(drafted), sum(n > 0 for n in drafted)),  # per drafting cycle
        "spec_tokens": spec_tokens, "spec_time_s": spec_time,
        "spec_tokens_per_s": _ratio(spec_tokens, spec_time),
        "draft_time_fraction": _ratio(draft_time, engine_time),
        "target_time_fraction": _ratio(target_time, engine_time),
        "engine_overhead_fraction": _ratio(engine_time - draft_time - target_time, engine_time),
        "exact_match_fraction": None if sampling else sum(bool(r["exact"]) for r in rows) / len(rows),
    }
    if all("out_of_draft_vocab_tokens" in r for r in rows):
        s["out_of_draft_vocab_fraction"] = _ratio(_total(rows, "out_of_draft_vocab_tokens"), spec_tokens)
    if all("baseline_time_s" in r for r in rows):  # transformers generate: the headline baseline
        base_tokens, base_time = _total(rows, "baseline_tokens"), _total(rows, "baseline_time_s")
        same_length = all(r["baseline_tokens"] == r["spec_tokens"] for r in rows)
        s.update({"baseline_tokens": base_tokens, "baseline_time_s": base_time,
                  "baseline_tokens_per_s": _ratio(base_tokens, base_time),
                  "speedup": _speedup(base_tokens, base_time, spec_tokens, spec_time, same_length),
                  "speedup_basis": "time" if same_length else "tokens_per_s"})
        if all("prompt_lookup_time_s" in r for r in rows):
            pl_tokens, pl_time = _total(rows, "prompt_lookup_tokens"), _total(rows, "prompt_lookup_time_s")
            pl_same = all(r["baseline_tokens"] == r["prompt_lookup_tokens"] for r in rows)
            s["prompt_lookup_tokens_per_s"] = _ratio(pl_tokens, pl_time)
            s["prompt_lookup_speedup"] = _speedup(base_tokens, base_time, pl_tokens, pl_time, pl_same)
        if rows and all("vllm_time_s" in r for r in rows):
            s.update(_vllm_summary(rows, sampling, base_tokens, base_time))
    if all("eyas_plain_time_s" in r for r in rows):
        ep_tokens, ep_time = _total(rows, "eyas_plain_tokens"), _total(rows, "eyas_plain_time_s")
        ep_same = all(r["eyas_plain_tokens"] == r["spec_tokens"] for r in rows)
        s["eyas_plain_tokens_per_s"] = _ratio(ep_tokens, ep_time)
        if "speedup" in s:
            s["eyas_plain_speedup"] = _speedup(base_tokens, base_time, ep_tokens, ep_time,
                                               all(r["baseline_tokens"] == r["eyas_plain_tokens"] for r in rows))
        s["speedup_over_eyas_plain"] = _speedup(ep_tokens, ep_time, spec_tokens, spec_time, ep_same)
        s.setdefault("speedup_basis", "time" if ep_same else "tokens_per_s")
    if rows:
        s.update(_distribution(rows))
    return s


def question_speedups(rows: Sequence[dict[str, Any]]) -> tuple[str, list[float], list[float]]:
    """(reference runtime, each question's speedup over it from median times, each question's worst single
    repeat). The reference is eyas's own plain decoding when every row has it, else generate."""
    ref = "eyas_plain" if all("eyas_plain_time_s" in r for r in rows) else "baseline"
    medians, worst = [], []
    for r in rows:
        same = r[f"{ref}_tokens"] == r["spec_tokens"]
        medians.append(_speedup(r[f"{ref}_tokens"], r[f"{ref}_time_s"], r["spec_tokens"], r["spec_time_s"], same))
        runs = zip(r.get(f"{ref}_times_s", [r[f"{ref}_time_s"]]), r.get("spec_times_s", [r["spec_time_s"]]))
        worst.append(min(_speedup(r[f"{ref}_tokens"], t_ref, r["spec_tokens"], t, same) for t_ref, t in runs))
    return ref, medians, worst


def reference_vs_itself(rows: Sequence[dict[str, Any]], ref: str) -> float | None:
    """The worst ratio between two repeats of the reference on the same question (A/A), None without repeats."""
    runs = [r[f"{ref}_times_s"] for r in rows if len(r.get(f"{ref}_times_s", ())) > 1]
    return min(a / b for t in runs for a in t for b in t) if runs else None


def _distribution(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ref, speedups, worst_runs = question_speedups(rows)
    order = sorted(range(len(rows)), key=speedups.__getitem__)
    return {"question_speedup_reference": ref, "reference_vs_itself_worst_run": reference_vs_itself(rows, ref),
            "worst_question_speedup": speedups[order[0]], "worst_question": rows[order[0]].get("question_id"),
            "p10_question_speedup": _quantile(speedups, 0.1), "median_question_speedup": _quantile(speedups, 0.5),
            "slower_question_fraction": sum(x < 1.0 for x in speedups) / len(speedups),
            "worst_run_speedup": min(worst_runs)}


def _quantile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def _vllm_summary(rows: Sequence[dict[str, Any]], sampling: bool, base_tokens: float,
                  base_time: float) -> dict[str, Any]:
    accepted = [a for r in rows for a in r["vllm_accepted"]]
    depth = max(r["vllm_draft_tokens"] for r in rows)
    tokens, time = _total(rows, "vllm_tokens"), _total(rows, "vllm_time_s")
    s: dict[str, Any] = {
        "vllm_tau": sum(accepted) / len(accepted) if accepted else 0.0,
        "vllm_accept_rate_per_position": accept_rate_per_position(accepted, depth),
        "vllm_tokens_per_s": _ratio(tokens, time),
        "vllm_speedup": _speedup(base_tokens, base_time, tokens, time,
                                 all(r["baseline_tokens"] == r["vllm_tokens"] for r in rows)),
        "vllm_exact_match_fraction": None if sampling else sum(bool(r["vllm_exact"]) for r in rows) / len(rows),
    }
    if all("vllm_plain_time_s" in r for r in rows):
        p_tokens, p_time = _total(rows, "vllm_plain_tokens"), _total(rows, "vllm_plain_time_s")
        s["vllm_plain_tokens_per_s"] = _ratio(p_tokens, p_time)
        s["vllm_speedup_over_plain"] = _speedup(p_tokens, p_time, tokens, time,
                                                all(r["vllm_plain_tokens"] == r["vllm_tokens"] for r in rows))
    return s


def accept_rate_per_position(accepted: Sequence[int], positions: int,
                             depths: Sequence[int] | None = None) -> list[float | None]:
    """accepted: tokens gained per cycle (drafts + 1 bonus); depths: each cycle's draft tree depth (None: all
    `positions` deep). Entry k: P(>= k+1 drafts | >= k drafts), over cycles that drafted position k+1."""
    depths = depths if depths is not None else [positions] * len(accepted)
    rates: list[float | None] = []
    for k in range(positions):
        reached = [a - 1 > k for a, d in zip(accepted, depths) if d > k and a - 1 >= k]
        rates.append(sum(reached) / len(reached) if reached else None)
    return rates


def _total(rows: Sequence[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _speedup(base_tokens: float, base_time: float, tokens: float, time: float, same_length: bool) -> float:
    if same_length:
        return _ratio(base_time, time)
    return _ratio(_ratio(tokens, time), _ratio(base_tokens, base_time))


def format_table(report: dict[str, Any]) -> str:
    """Per category then overall: tau, tokens/s, speedups, the spread of per-question speedups, time shares,
    exactness."""
    def x(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    ref = report["overall"].get("question_speedup_reference", "baseline")
    lines = [("category", "n", "tau", "base tok/s", "eyas tok/s", "speedup", "vs plain", "worst", "p10", "slower %",
              "lookup x", "draft %", "overhead %", "plain %", "oov %", "exact")]
    groups = sorted(report["per_category"].items()) + [("overall", report["overall"])]
    for name, s in groups:
        exact, oov = s["exact_match_fraction"], s.get("out_of_draft_vocab_fraction")
        base = s.get("baseline_tokens_per_s")
        lines.append((name, str(s["questions"]), f"{s['tau']:.2f}", "-" if base is None else f"{base:.1f}",
                      f"{s['spec_tokens_per_s']:.1f}", x(s.get("speedup")), x(s.get("speedup_over_eyas_plain")),
                      x(s["worst_question_speedup"]), x(s["p10_question_speedup"]),
                      f"{100 * s['slower_question_fraction']:.0f}", x(s.get("prompt_lookup_speedup")),
                      f"{100 * s['draft_time_fraction']:.1f}", f"{100 * s['engine_overhead_fraction']:.1f}",
                      f"{100 * s['plain_cycle_fraction']:.0f}", "-" if oov is None else f"{100 * oov:.1f}",
                      "-" if exact is None else f"{exact:.2f}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
           for line in lines]
    out.insert(1, "-" * len(out[0]))
    out.insert(len(out) - 1, "-" * len(out[0]))
    if note := report.get("settings", {}).get("note"):
        out.insert(0, note)
    if dtype_note := report.get("settings", {}).get("dtype_note"):
        out.append(dtype_note)
    repeats = report.get("settings", {}).get("repeats", 1)
    against = "eyas's own plain decoding" if ref == "eyas_plain" else "generate"
    o = report["overall"]
    out.append(f"worst / p10 / slower %: per-question speedups over {against}"
               + (f", each the median of {repeats} alternated repeats" if repeats > 1 else "")
               + f"; worst question {o['worst_question']} ({o['worst_question_speedup']:.2f}x), "
               f"worst single run {o['worst_run_speedup']:.2f}x"
               + ("" if o.get("reference_vs_itself_worst_run") is None else
                  f" (the reference against itself: {o['reference_vs_itself_worst_run']:.2f}x)"))
    if o["speedup_basis"] != "time":
        out.append("speedups are tokens/s ratios: outputs differ in length (sampling), so times are not for the "
                   "same tokens")
    if "vllm_tau" in o:
        rates = ", ".join("-" if r is None else f"{r:.2f}" for r in o["vllm_accept_rate_per_position"])
        exact = o["vllm_exact_match_fraction"]
        plain = (f"; vLLM plain {o['vllm_plain_tokens_per_s']:.1f} tok/s, the head adds "
                 f"{o['vllm_speedup_over_plain']:.2f}x") if "vllm_plain_tokens_per_s" in o else ""
        out.append(f"vLLM {report['settings'].get('vllm', {}).get('version', '')}, same head: tau {o['vllm_tau']:.2f} "
                   f"(acceptance per position {rates}), {o['vllm_tokens_per_s']:.1f} tok/s, "
                   f"{o['vllm_speedup']:.2f}x generate{plain}" + ("" if exact is None else f", exact {exact:.2f}"))
    if "eyas_plain_tokens_per_s" in o:
        generate = f", {o['eyas_plain_speedup']:.2f}x generate (kernels alone)" if "eyas_plain_speedup" in o else ""
        out.append(f"eyas plain one-token decoding: {o['eyas_plain_tokens_per_s']:.1f} tok/s{generate}; speculation "
                   f"adds {o['speedup_over_eyas_plain']:.2f}x on top")
    return "\n".join(out)


def write_plot(report: dict[str, Any], path: str | os.PathLike) -> None:
    """Three panels: acceptance per draft position; speedup per category, eyas's bars beside those of prompt
    lookup and vLLM where they ran; and every question's speedup over the per-question reference."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_speed, ax_q) = plt.subplots(1, 3, figsize=(16, 4.2), gridspec_kw={"width_ratios": [1, 1, 1.3]})
    o = report["overall"]
    rates = {"eyas": o["accept_rate_per_position"], "vLLM": o.get("vllm_accept_rate_per_position")}
    positions = max(len(r) for r in rates.values() if r is not None)
    _bars(ax_acc, list(range(1, positions + 1)),
          [(name, [r[k] if r is not None and k < len(r) else None for k in range(positions)], color)
           for (name, r), color in zip(rates.items(), ("tab:blue", "tab:orange")) if r is not None])
    vllm_tau = f", vLLM {o['vllm_tau']:.2f}" if "vllm_tau" in o else ""
    title = f"acceptance per position (tau {o['tau']:.2f}{vllm_tau})"
    ax_acc.set(xlabel="draft position", ylabel="acceptance rate (given previous accepted)", ylim=(0, 1), title=title)

    groups = sorted(report["per_category"].items()) + [("overall", o)]
    generate = "speedup" in o
    series = [("eyas", "speedup" if generate else "speedup_over_eyas_plain", "tab:blue"),
              ("prompt lookup", "prompt_lookup_speedup", "tab:gray"), ("vLLM", "vllm_speedup", "tab:orange")]
    _bars(ax_speed, [n for n, _ in groups], [(label, [s[key] for _, s in groups], color)
                                            for label, key, color in series if all(key in s for _, s in groups)])
    ax_speed.axhline(1.0, color="black", linewidth=0.8)
    plt.setp(ax_speed.get_xticklabels(), rotation=30, ha="right")
    ax_speed.set(ylabel=f"speedup over {'transformers generate' if generate else 'eyas plain decoding'}",
                 title="speedup per category")

    # every question, grouped by category and sorted within it: the spread the means hide
    rows = report["questions"]
    ref, speedups, _ = question_speedups(rows)
    categories = sorted({r["category"] for r in rows})
    x = 0
    for c, color in zip(categories, plt.cm.tab10.colors * (len(categories) // 10 + 1)):
        values = sorted(v for r, v in zip(rows, speedups) if r["category"] == c)
        ax_q.scatter(range(x, x + len(values)), values, s=12, color=color, label=c)
        x += len(values)
    for level, style in ((1.0, "-"), (0.97, ":")):
        ax_q.axhline(level, color="black", linewidth=0.8, linestyle=style)
    ax_q.set(xlabel="question (by category, sorted)", xticks=[],
             ylabel=f"speedup over {'eyas plain decoding' if ref == 'eyas_plain' else 'transformers generate'}",
             title=f"per question: worst {o['worst_question_speedup']:.2f}x, p10 {o['p10_question_speedup']:.2f}x, "
                   f"{100 * o['slower_question_fraction']:.0f}% below 1x")
    ax_q.legend(fontsize=7, ncol=2, loc="upper left")
    st = report.get("settings", {})
    note = f"\n{st['note']}" if st.get("note") else ""
    fig.suptitle(f"{st.get('target', '')}  {st.get('dtype', '')}  T={st.get('temperature', '')}  "
                 f"{st.get('max_new_tokens', '')} new tokens{note}", fontsize=9)
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)


def _bars(ax, labels: list, series: list[tuple[str, list[float | None], str]]) -> None:
    """Grouped bars: one group per label, one bar per series (None values left out), each with its value."""
    width = 0.8 / len(series)
    for j, (name, values, color) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i, v in enumerate(values) if v is not None]
        ax.bar_label(ax.bar(xs, [v for v in values if v is not None], width, label=name, color=color), fmt="%.2f")
    ax.set_xticks(range(len(labels)), labels)
    ax.margins(y=0.2)  # room for the values and the legend above the bars
    if len(series) > 1:
        ax.legend(loc="upper left")
