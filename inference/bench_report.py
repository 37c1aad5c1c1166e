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
    positions = max([depth or 0] + [a - 1 for r in rows for a in r["accepted"]] + [d for r in rows for d in r.get("depths", ())])
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
    base_tokens, base_time = _total(rows, "baseline_tokens"), _total(rows, "baseline_time_s")
    spec_tokens, spec_time = _total(rows, "spec_tokens"), _total(rows, "spec_time_s")
    engine_time = _total(rows, "engine_time_s")
    draft_time, target_time = _total(rows, "draft_time_s"), _total(rows, "target_time_s")
    same_length = all(r["baseline_tokens"] == r["spec_tokens"] for r in rows)
    s: dict[str, Any] = {
        "questions": len(rows),
        "tau": sum(accepted) / len(accepted) if accepted else 0.0,
        "accept_rate_per_position": accept_rate_per_position(accepted, positions, depths),
        "plain_cycle_fraction": _ratio(sum(d == 0 for d in depths), len(depths)),
        "mean_draft_nodes": _ratio(sum(drafted), sum(n > 0 for n in drafted)),  # per drafting cycle
        "baseline_tokens": base_tokens, "spec_tokens": spec_tokens,
        "baseline_time_s": base_time, "spec_time_s": spec_time,
        "baseline_tokens_per_s": _ratio(base_tokens, base_time),
        "spec_tokens_per_s": _ratio(spec_tokens, spec_time),
        "speedup": _speedup(base_tokens, base_time, spec_tokens, spec_time, same_length),
        "speedup_basis": "time" if same_length else "tokens_per_s",
        "draft_time_fraction": _ratio(draft_time, engine_time),
        "target_time_fraction": _ratio(target_time, engine_time),
        "engine_overhead_fraction": _ratio(engine_time - draft_time - target_time, engine_time),
        "exact_match_fraction": None if sampling else sum(bool(r["exact"]) for r in rows) / len(rows),
    }
    if all("out_of_draft_vocab_tokens" in r for r in rows):
        s["out_of_draft_vocab_fraction"] = _ratio(_total(rows, "out_of_draft_vocab_tokens"), spec_tokens)
    if all("prompt_lookup_time_s" in r for r in rows):
        pl_tokens, pl_time = _total(rows, "prompt_lookup_tokens"), _total(rows, "prompt_lookup_time_s")
        pl_same = all(r["baseline_tokens"] == r["prompt_lookup_tokens"] for r in rows)
        s["prompt_lookup_tokens_per_s"] = _ratio(pl_tokens, pl_time)
        s["prompt_lookup_speedup"] = _speedup(base_tokens, base_time, pl_tokens, pl_time, pl_same)
    if rows and all("vllm_time_s" in r for r in rows):
        s.update(_vllm_summary(rows, sampling, base_tokens, base_time))
    if all("eyas_plain_time_s" in r for r in rows):
        ep_tokens, ep_time = _total(rows, "eyas_plain_tokens"), _total(rows, "eyas_plain_time_s")
        ep_same = all(r["baseline_tokens"] == r["eyas_plain_tokens"] for r in rows)
        s["eyas_plain_tokens_per_s"] = _ratio(ep_tokens, ep_time)
        s["eyas_plain_speedup"] = _speedup(base_tokens, base_time, ep_tokens, ep_time, ep_same)
        s["speedup_over_eyas_plain"] = _speedup(ep_tokens, ep_time, spec_tokens, spec_time,
                                                all(r["eyas_plain_tokens"] == r["spec_tokens"] for r in rows))
    return s


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
    """Per category then overall: tau, tokens/s, speedups, time shares, exactness."""
    lines = [("category", "n", "tau", "base tok/s", "eyas tok/s", "speedup", "lookup x", "draft %", "overhead %",
              "plain %", "oov %", "exact")]
    groups = sorted(report["per_category"].items()) + [("overall", report["overall"])]
    for name, s in groups:
        lookup = s.get("prompt_lookup_speedup")
        exact, oov = s["exact_match_fraction"], s.get("out_of_draft_vocab_fraction")
        lines.append((name, str(s["questions"]), f"{s['tau']:.2f}", f"{s['baseline_tokens_per_s']:.1f}",
                      f"{s['spec_tokens_per_s']:.1f}", f"{s['speedup']:.2f}x",
                      "-" if lookup is None else f"{lookup:.2f}x", f"{100 * s['draft_time_fraction']:.1f}",
                      f"{100 * s['engine_overhead_fraction']:.1f}", f"{100 * s['plain_cycle_fraction']:.0f}",
                      "-" if oov is None else f"{100 * oov:.1f}", "-" if exact is None else f"{exact:.2f}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
           for line in lines]
    out.insert(1, "-" * len(out[0]))
    out.insert(len(out) - 1, "-" * len(out[0]))
    if report["overall"]["speedup_basis"] != "time":
        out.append("speedup is a tokens/s ratio: outputs differ in length (sampling), so times are not for the same tokens")
    o = report["overall"]
    if "vllm_tau" in o:
        rates = ", ".join("-" if r is None else f"{r:.2f}" for r in o["vllm_accept_rate_per_position"])
        exact = o["vllm_exact_match_fraction"]
        plain = (f"; vLLM plain {o['vllm_plain_tokens_per_s']:.1f} tok/s, the head adds "
                 f"{o['vllm_speedup_over_plain']:.2f}x") if "vllm_plain_tokens_per_s" in o else ""
        out.append(f"vLLM {report['settings'].get('vllm', {}).get('version', '')}, same head: tau {o['vllm_tau']:.2f} "
                   f"(acceptance per position {rates}), {o['vllm_tokens_per_s']:.1f} tok/s, "
                   f"{o['vllm_speedup']:.2f}x generate{plain}" + ("" if exact is None else f", exact {exact:.2f}"))
    if "eyas_plain_speedup" in o:
        out.append(f"eyas plain one-token decoding: {o['eyas_plain_tokens_per_s']:.1f} tok/s, "
                   f"{o['eyas_plain_speedup']:.2f}x generate (kernels alone); speculation adds "
                   f"{o['speedup_over_eyas_plain']:.2f}x on top")
    return "\n".join(out)


def write_plot(report: dict[str, Any], path: str | os.PathLike) -> None:
    """Two panels: acceptance per draft position, and speedup per category, eyas's bars beside those of prompt
    lookup and vLLM where they ran."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
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
    series = [("eyas", "speedup", "tab:blue"), ("prompt lookup", "prompt_lookup_speedup", "tab:gray"),
              ("vLLM", "vllm_speedup", "tab:orange")]
    _bars(ax_speed, [n for n, _ in groups], [(label, [s[key] for _, s in groups], color)
                                            for label, key, color in series if all(key in s for _, s in groups)])
    ax_speed.axhline(1.0, color="black", linewidth=0.8)
    plt.setp(ax_speed.get_xticklabels(), rotation=30, ha="right")
    ax_speed.set(ylabel="speedup over transformers generate", title="speedup per category")
    st = report.get("settings", {})
    fig.suptitle(f"{st.get('target', '')}  {st.get('dtype', '')}  T={st.get('temperature', '')}  "
                 f"{st.get('max_new_tokens', '')} new tokens", fontsize=9)
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
