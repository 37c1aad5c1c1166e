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
- runtimes (overall and per category): every runtime that ran, by its row prefix (RUNTIMES: `baseline` is
  generate, `spec` eyas with its planned trees, `eyas_chain` eyas verifying a chain of k at every step, `vllm` /
  `sglang` the engines with the head, `*_plain` without), each with tokens/s, `speedup` over the reference
  (generate, else eyas plain), `speedup_over_plain` over its own plain decoding, `exact_match_fraction`, its A/A
  spread `aa_spread` (per question the worst ratio between two of its repeats, the median over questions) and
  `aa_worst_run` (reference_vs_itself for that runtime: the worst question). A ratio between two runtimes counts
  only beyond the aa_spread of both (`*_within_noise`: True when it does not, None without repeats to tell). A runtime
  that drafts also has `counters` (steps = target verify forwards, drafts, draft tokens, accepted drafts,
  steps that accepted position k: the engine's own, eyas's under the same names), `tau` = tokens per verify
  forward = (steps + accepted) / steps, and acceptance per position by the definition above, from the counters
  (eyas's planned trees: from its cycles and their depths, as accept_rate_per_position).
- memory_limit (with --eyas-plain): plain decoding's bound, `bytes` of weights a one-token step reads over the
  `bandwidth` this machine reads memory at (`kernel`: the fastest of a few streaming reads of 1 GiB), read before,
  between and after the questions: the upper median of those `samples`, their range `low` to `high`
  (memory_limit.ReadRate), as `tokens_per_s`; the table says what share of it each plain runtime reached.
- chain_vs_engine: where eyas-chain-k and an engine that recorded its proposals (vLLM) first gain a different
  number of tokens on the same step of the same question (the last step of each question, which the token cap
  may cut, is not compared); None where they agree on every step compared.
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
    overall = _summary(rows, sampling, positions)
    overall["chain_vs_engine"] = chain_vs_engine(rows)
    return {
        "overall": overall,
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
        s["runtimes"] = _runtimes(rows, sampling, positions)
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


# row prefix -> how tables and plots name the runtime, in the order they list them
RUNTIMES = {"baseline": "generate", "spec": "eyas", "eyas_chain": "eyas chain-{k}", "eyas_plain": "eyas plain",
            "prompt_lookup": "prompt lookup", "vllm_plain": "vLLM plain", "vllm": "vLLM + head",
            "sglang_plain": "SGLang plain", "sglang": "SGLang + head"}
PLAIN_OF = {"spec": "eyas_plain", "eyas_chain": "eyas_plain", "vllm": "vllm_plain", "sglang": "sglang_plain"}


def _runtimes(rows: Sequence[dict[str, Any]], sampling: bool, positions: int) -> dict[str, dict[str, Any]]:
    """Every runtime in the rows: speed, ratios against the reference and its own plain decoding (each with
    whether the A/A spread covers it), exactness, and for one that drafts its counters, tau and acceptance."""
    names = [n for n in RUNTIMES if all(f"{n}_time_s" in r for r in rows)]
    ref = "baseline" if "baseline" in names else "eyas_plain"
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        tokens, time = _total(rows, f"{name}_tokens"), _total(rows, f"{name}_time_s")
        k = max((r.get(f"{name}_draft_tokens", 0) for r in rows), default=0)
        exact = "exact" if name == "spec" else f"{name}_exact"
        s: dict[str, Any] = {"label": RUNTIMES[name].format(k=k), "tokens": tokens, "time_s": time,
                             "tokens_per_s": _ratio(tokens, time), "aa_spread": aa_spread(rows, name),
                             "aa_worst_run": reference_vs_itself(rows, name),
                             "exact_match_fraction": None if sampling or not all(exact in r for r in rows)
                             else sum(bool(r[exact]) for r in rows) / len(rows)}
        for key, base in (("speedup", ref), ("speedup_over_plain", PLAIN_OF.get(name))):
            if base in names and base != name:
                s[key], s[f"{key}_within_noise"] = compare(rows, base, name)
        if all(f"{name}_counters" in r for r in rows):
            s.update(_drafting(rows, name, positions, k))
        out[name] = s
    return out


def aa_spread(rows: Sequence[dict[str, Any]], name: str) -> float | None:
    """A runtime against itself, as it typically differs: per question the worst ratio between two of its repeats
    (<= 1), the median over questions; None without repeats. The times compared are medians over the repeats,
    which drop a repeat that another program on the machine slowed down; the worst question's ratio (reference_vs_
    itself) is what such a slowdown makes of the spread, and would call every ratio noise."""
    ratios = [min(a / b for a in t for b in t) for r in rows if len(t := r.get(f"{name}_times_s", ())) > 1]
    return _quantile(ratios, 0.5) if ratios else None


def compare(rows: Sequence[dict[str, Any]], base: str, name: str) -> tuple[float, bool | None]:
    """`name`'s speedup over `base` (a time ratio when both produced the same tokens for every question, else a
    tokens/s ratio), and whether it lies within the A/A spread of either: 1/n <= ratio <= n, n the larger of
    their aa_spread (None without repeats to tell)."""
    same = all(r[f"{base}_tokens"] == r[f"{name}_tokens"] for r in rows)
    ratio = _speedup(_total(rows, f"{base}_tokens"), _total(rows, f"{base}_time_s"), _total(rows, f"{name}_tokens"),
                     _total(rows, f"{name}_time_s"), same)
    spreads = [aa_spread(rows, n) for n in (base, name)]
    if None in spreads:
        return ratio, None
    noise = 1 / min(spreads)
    return ratio, 1 / noise <= ratio <= noise


def _drafting(rows: Sequence[dict[str, Any]], name: str, positions: int, k: int) -> dict[str, Any]:
    """Summed counters, tau = tokens per verify forward, and acceptance per position: from the counters for a
    chain (every step drafts k), from the cycles and their depths for eyas's planned trees."""
    total: dict[str, Any] = {key: sum(r[f"{name}_counters"][key] for r in rows)
                             for key in ("steps", "drafts", "draft_tokens", "accepted_tokens")}
    per_position = [r[f"{name}_counters"]["accepted_per_position"] for r in rows]
    total["accepted_per_position"] = [sum(p[j] for p in per_position if j < len(p))
                                      for j in range(max(map(len, per_position), default=0))]
    if name == "spec":
        rates = accept_rate_per_position([a for r in rows for a in r["accepted"]], positions,
                                          [d for r in rows for d in r.get("depths", [positions] * len(r["accepted"]))])
    else:
        reached = [total["drafts"], *total["accepted_per_position"]]
        rates = [reached[j + 1] / reached[j] if j + 1 < len(reached) and reached[j] else None for j in range(k)]
    return {"counters": total, "tau": _ratio(total["steps"] + total["accepted_tokens"], total["steps"]),
            "accept_rate_per_position": rates}


def chain_vs_engine(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Where eyas-chain-k and an engine whose steps are known in order (vLLM, from its proposals) first gain a
    different number of tokens on the same step; None when no such pair ran."""
    engine = next((e for e in ("vllm", "sglang") if rows and all(r.get(f"{e}_ordered") and "eyas_chain_accepted" in r
                                                                   for r in rows)), None)
    if engine is None:
        return None
    steps = 0
    for r in rows:
        mine, theirs = r["eyas_chain_accepted"], r[f"{engine}_accepted"]
        for j in range(min(len(mine), len(theirs)) - 1):  # the last step may be cut by the token cap
            if mine[j] != theirs[j]:
                return {"engine": engine, "steps_agreed": steps, "first": {
                    "question": r.get("question_id"), "step": j, "token": 1 + sum(mine[:j]),
                    "eyas_chain": mine[j], engine: theirs[j]}}
            steps += 1
    return {"engine": engine, "steps_agreed": steps, "first": None}


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
    exactness; then every runtime that ran side by side (format_runtimes)."""
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
    out = _aligned(lines, total=True)
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
    if o.get("runtimes"):
        out += ["", *format_runtimes(report)]
    return "\n".join(out)


def format_runtimes(report: dict[str, Any]) -> list[str]:
    """Every runtime that ran, one line each: speed, its ratios over the reference and over its own plain
    decoding ("within noise" inside the A/A spread), its A/A spread, and for one that drafts tau, acceptance per
    position and its counters; then which runtimes ran or did not, and where eyas-chain-k and the engine first
    disagree."""
    o, st = report["overall"], report.get("settings", {})
    runtimes = o["runtimes"]
    ref = "generate" if "baseline" in runtimes else "eyas plain"
    lines = [("runtime", "tok/s", f"vs {ref}", "vs own plain", "A/A", "A/A worst", "tau", "acceptance per position",
              "steps", "drafts", "draft tok", "accepted", "exact")]
    for s in runtimes.values():
        c, exact = s.get("counters"), s["exact_match_fraction"]
        rates = s.get("accept_rate_per_position")
        lines.append((s["label"], f"{s['tokens_per_s']:.1f}", _versus(s, "speedup"), _versus(s, "speedup_over_plain"),
                      _plus_minus(s.get("aa_spread")), _plus_minus(s["aa_worst_run"]),
                      "-" if c is None else f"{s['tau']:.2f}",
                      "-" if rates is None else " ".join("-" if r is None else f"{r:.2f}" for r in rates[:8]),
                      *(("-",) * 4 if c is None else (str(c["steps"]), str(c["drafts"]), str(c["draft_tokens"]),
                                                      str(c["accepted_tokens"]))),
                      "-" if exact is None else f"{exact:.2f}"))
    out = _aligned(lines)
    out.append("ran: " + ", ".join(s["label"] for s in runtimes.values()))
    if (memory := report.get("memory_limit")) is not None:
        out.append(memory_line(memory, runtimes))
    for engine, why in ((st.get("engines") or {}).get("not_run") or {}).items():
        out.append(f"not run: {engine}: {why}")
    if st.get("repeats", 1) > 1:
        out.append("A/A: a runtime against itself, per question the worst ratio between two of its repeats, the "
                   "median over questions (A/A worst: the worst question); a ratio inside the A/A of either runtime it "
                   "compares is within noise")
    else:
        out.append("one repeat: no A/A spread to judge the ratios by (--repeats 2 or more)")
    if (chain := o.get("chain_vs_engine")) is not None:
        names = runtimes["eyas_chain"]["label"], runtimes[chain["engine"]]["label"]
        first = chain["first"]
        out.append(f"{names[0]} and {names[1]}: the same tokens gained at all {chain['steps_agreed']} steps compared"
                   if first is None else
                   f"{names[0]} and {names[1]} first disagree at question {first['question']}, step {first['step']} "
                   f"(output token {first['token']}): {names[0]} gained {first['eyas_chain']}, {names[1]} "
                   f"{first[chain['engine']]} (after {chain['steps_agreed']} steps that agreed)")
    return out


def memory_line(memory: dict[str, Any], runtimes: dict[str, dict[str, Any]]) -> str:
    """Plain decoding's memory limit and how close each plain runtime (generate, eyas plain, an engine plain) came."""
    plain = [s for name, s in runtimes.items() if name == "baseline" or name.endswith("_plain")]
    return (f"memory limit of plain decoding: {memory['tokens_per_s']:.1f} tok/s ({memory['bytes'] / 1e6:.0f} MB of "
            f"weights a step at {memory['bandwidth'] / 1e9:.1f} GB/s, the upper median of {memory['samples']} reads "
            f"of 1 GiB through this run ({memory['low'] / 1e9:.1f}-{memory['high'] / 1e9:.1f}), {memory['kernel']}; "
            "the cache's reads not counted): "
            + ", ".join(f"{s['label']} {100 * s['tokens_per_s'] / memory['tokens_per_s']:.0f} %" for s in plain))


def _plus_minus(aa: float | None) -> str:
    return "-" if aa is None else f"±{100 * (1 / aa - 1):.0f}%"


def _versus(s: dict[str, Any], key: str) -> str:
    if key not in s:
        return "-"
    return "within noise" if s[f"{key}_within_noise"] else f"{s[key]:.2f}x"


def _aligned(lines: list[tuple[str, ...]], total: bool = False) -> list[str]:
    """Columns padded to their widest cell (the first left-aligned), a rule under the header (and above a
    closing total line)."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
           for line in lines]
    out.insert(1, "-" * len(out[0]))
    if total:
        out.insert(len(out) - 1, "-" * len(out[0]))
    return out


def write_plot(report: dict[str, Any], path: str | os.PathLike) -> None:
    """Three panels: acceptance per draft position of every runtime that drafts; every runtime's speedup over
    the reference, with the A/A spread around it; and every question's speedup over the per-question
    reference."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_speed, ax_q) = plt.subplots(1, 3, figsize=(17, 4.6), gridspec_kw={"width_ratios": [1, 1.1, 1.2]})
    o = report["overall"]
    runtimes = o.get("runtimes") or {}
    # lines, not bars: four runtimes' values side by side at each position would print over each other
    drafting = {s["label"]: (s["accept_rate_per_position"], s["tau"]) for s in runtimes.values()
                if s.get("accept_rate_per_position") is not None} or {"eyas": (o["accept_rate_per_position"], o["tau"])}
    for j, ((label, (rates, tau)), marker) in enumerate(zip(drafting.items(), "osD^v<>")):
        # each runtime's markers smaller than the one before: equal values (a chain and the engine that should
        # draft alike) stay visible one inside the other
        ax_acc.plot(range(1, len(rates) + 1), [float("nan") if r is None else r for r in rates], marker=marker,
                    markersize=10 - 2 * j, label=f"{label} (tau {tau:.2f})")
    ax_acc.set(xlabel="draft position", ylabel="acceptance rate (given previous accepted)", ylim=(-0.04, 1.05),
               title="acceptance per position")
    ax_acc.xaxis.get_major_locator().set_params(integer=True)
    ax_acc.legend(fontsize=8, loc="best")

    generate = "baseline" in runtimes or "speedup" in o
    compared = [(s["label"], s["speedup"], s["speedup_within_noise"], _spread(runtimes, name))
                for name, s in runtimes.items() if "speedup" in s]
    if not compared:  # a report from before the runtimes were summarised: eyas alone
        compared = [("eyas", o.get("speedup", o.get("speedup_over_eyas_plain")), None, None)]
    y = list(range(len(compared)))[::-1]  # listed top to bottom in the table's order
    colors = ["lightgray" if within else "tab:blue" for _, _, within, _ in compared]
    ax_speed.barh(y, [v for _, v, _, _ in compared], color=colors, height=0.6)
    for (_, v, _, noise), yy in zip(compared, y):
        if noise is not None:
            ax_speed.errorbar(v, yy, xerr=[[v - v / noise], [v * noise - v]], color="black", capsize=3, linewidth=1)
    # the values go with the names, left of the axis, where no bar or spread can run over them
    ax_speed.set_yticks(y, [f"{label}\n{v:.2f}x" + (", within noise" if within else "")
                            for label, v, within, _ in compared], fontsize=8)
    ax_speed.axvline(1.0, color="black", linewidth=0.8)
    ax_speed.set_xlim(0, max(1.0, *(v for _, v, _, _ in compared)) * 1.5)  # a wider spread runs off the edge
    ax_speed.set(xlabel=f"speedup over {'transformers generate' if generate else 'eyas plain decoding'} (bars: the "
                        "A/A spread)", title="every runtime, overall")

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
             ylabel=f"eyas's speedup over {'eyas plain decoding' if ref == 'eyas_plain' else 'transformers generate'}",
             title=f"per question: worst {o['worst_question_speedup']:.2f}x, p10 {o['p10_question_speedup']:.2f}x, "
                   f"{100 * o['slower_question_fraction']:.0f}% below 1x")
    ax_q.legend(fontsize=7, ncol=2, loc="best")  # where it covers the fewest questions
    st = report.get("settings", {})
    note = f"\n{st['note']}" if st.get("note") else ""
    fig.suptitle(f"{st.get('target', '')}  {st.get('dtype', '')}  T={st.get('temperature', '')}  "
                 f"{st.get('max_new_tokens', '')} new tokens{note}", fontsize=9)
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)


def _spread(runtimes: dict[str, dict[str, Any]], name: str) -> float | None:
    """The noise factor around `name`'s speedup over the reference: the larger A/A spread of the two (None
    without repeats)."""
    ref = "baseline" if "baseline" in runtimes else "eyas_plain"
    spreads = [runtimes[n].get("aa_spread") for n in (ref, name)]
    return None if None in spreads else 1 / min(spreads)
