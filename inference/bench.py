"""`eyas bench`: a head against plain transformers `generate` and every other runtime asked for, question by
question, in one run.

Every runtime gets the same prompt ids, dtype, threads, max_new_tokens, eos ids and sampling settings: eyas
speculative (its planned trees), eyas verifying a chain of k as serving engines do (`eyas_chain`), eyas plain,
prompt lookup, and vLLM / SGLang plain and with the head. Engines run in their own interpreters, started once
and kept warm (runtimes_vllm.py); eyas and `generate` run in this process. Runs are interleaved per question
(alternating which goes first) after one short warm-up each, so drift in machine speed hits every runtime alike.
What is measured, and how it is summarised, lives in `bench_report.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from eyas.data.chat_template import encode_prompt
from eyas.models import DraftHead, Target
from eyas.models.atomic import atomic_file
from eyas.models.errors import InputError, MissingInput
from eyas.models.sampling import Sampling, choose
from eyas.models.signals import GracefulStop

from .bench_report import format_table, summarize, write_plot
from .memory_limit import ReadRate, weight_bytes
from .runtimes_vllm import EngineOptions, EngineRow
from .timing import synchronize

WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Question:
    question_id: str | int
    category: str
    prompt: str  # the first turn (chat) or the raw prompt (HumanEval-style)
    chat: bool  # True: render through the target's chat template with add_generation_prompt


BUILTIN_QUESTIONS = {"mt-bench": "mt-bench.jsonl"}  # name -> file in inference/questions/ (FastChat, Apache-2.0)


def builtin_questions(name: str | os.PathLike) -> Path | None:
    """The file of a question set shipped with eyas, or None if `name` is not one."""
    if str(name) not in BUILTIN_QUESTIONS:
        return None
    return Path(__file__).resolve().parent / "questions" / BUILTIN_QUESTIONS[str(name)]


def load_questions(path: str | os.PathLike, limit: int | None = None,
                   per_category: int | None = None) -> list[Question]:
    """MT-bench / Spec-Bench rows (`question_id`, `category`, `turns`) or HumanEval-style rows (`prompt`).

    `path` is a .jsonl file or the name of a question set shipped with eyas (BUILTIN_QUESTIONS: `mt-bench`, the 80
    MT-bench questions). Only the first turn of a multi-turn question is used; per_category keeps the first N of
    each category (a quick run that still covers every category), limit the first N kept. Raises InputError
    naming the line.
    """
    path = builtin_questions(path) or Path(path)
    if not path.is_file():
        raise MissingInput(f"questions file {path} does not exist "
                           f"(or use a built-in set: {', '.join(BUILTIN_QUESTIONS)})")
    from eyas.data.sources import check_text_file

    check_text_file(path)  # empty, UTF-16/32 or binary: named before reading
    questions: list[Question] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{where}: not UTF-8 text; re-save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: not valid JSON ({e.msg})") from None
            question = _question(row, where, len(questions))
            if per_category is None or sum(q.category == question.category for q in questions) < per_category:
                questions.append(question)
            if limit is not None and len(questions) >= limit:
                break
    if not questions:
        raise InputError(f"questions file {path} has no questions")
    return questions


def _question(row: Any, where: str, index: int) -> Question:
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(row).__name__}")
    qid = row.get("question_id", row.get("task_id", index))
    category = row.get("category", "all")
    if not isinstance(category, str) or not category:
        raise InputError(f"{where}: `category` must be a non-empty string, got {category!r}")
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
            raise InputError(f"{where}: `turns` must be a non-empty list of strings")
        return Question(qid, category, turns[0], chat=True)
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise InputError(f"{where}: `prompt` must be a non-empty string")
        return Question(qid, category, row["prompt"], chat=False)
    raise InputError(f"{where}: a question needs `turns` (MT-bench / Spec-Bench) or `prompt` (HumanEval-style); "
                     f"got keys {sorted(row)}")


def prompt_ids(target: Target, question: Question) -> list[int]:
    """The question's first turn through the chat template, or its raw prompt tokenized as is."""
    return encode_prompt(target.tokenizer, [{"role": "user", "content": question.prompt}] if question.chat
                         else question.prompt)


def run_bench(
    target: str | Target,
    head: str | os.PathLike | DraftHead,
    questions: str | os.PathLike | Sequence[Question],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    dtype: str = "fp32",
    device: str = "cpu",
    threads: int | None = None,
    limit: int | None = None,
    per_category: int | None = None,
    prompt_lookup: int | None = None,
    eyas_plain: bool = False,
    eyas_chain: int | None = None,
    seed: int = 0,
    out: str | os.PathLike | None = None,
    progress: bool = True,
    engines: EngineOptions | None = None,
    repeats: int = 1,
    generate: bool = True,
    note: str | None = None,
    dtype_note: str | None = None,
    compile: bool = False,
    **tree_options: Any,
) -> dict[str, Any]:
    """Benchmark `head` on `target` over `questions`; returns the report (see bench_report.summarize).

    prompt_lookup: if set, also run transformers prompt-lookup decoding with that many
    candidate tokens. eyas_plain: also time plain one-token decoding through eyas's own Target (same kernels
    as the verify, no drafting), to separate the speculation's gain from the Target's faster logits; the report
    then holds plain decoding's memory limit measured in the same run (`memory_limit`: memory_limit.py).
    eyas_chain: also run eyas verifying a chain of this many drafts at every step, no planner and no lookup
    (TreeOptions(kind="chain", depth=k, lookup=0)): what vLLM and SGLang verify, so acceptance per position
    compares step for step. Default: the engines' chain length when engines run, else off.
    out: if set, write the report there atomically and a PNG beside it.
    engines: also run the head (exported to each engine's layout) and plain decoding through vLLM / SGLang
    (runtimes_vllm.py), each engine started once and kept warm, alternated with eyas's runtimes per question.
    repeats: run every question this many times, each runtime once per repeat in alternating order; a row keeps
    every repeat's time and reports the median. generate=False skips transformers generate (then eyas plain
    decoding, which needs eyas_plain, is the reference for exactness).
    note: a line saying what the run is (a smoke run, say), kept in the settings, shown with the table and plot.
    dtype_note: which dtype runs and why (`auto` resolved on this machine), kept in the settings and shown.
    compile: the target's decode steps (eyas speculative, chain and plain) through torch.compile (Target), warmed
    up before the first question so no runtime's time holds the compilation; `generate` runs transformers as it is.
    A first SIGINT/SIGTERM ends the run after the question in hand: the report covers the questions done and its
    settings say `stopped` (the signal, the questions done and left).
    tree_options go to SpeculativeGenerator.from_pretrained (kind, depth, top_k, total_tokens, paths).
    A Target passed in is used where it is (device) and must already be in `dtype`.
    """
    if repeats < 1:
        raise InputError(f"repeats must be >= 1, got {repeats}")
    if not generate and not eyas_plain:
        raise InputError("without transformers generate the bench needs a reference: pass eyas_plain (--eyas-plain)")
    if eyas_chain is None and engines is not None and engines.pythons:
        eyas_chain = engines.draft_tokens
    if eyas_chain is not None and eyas_chain < 1:
        raise InputError(f"eyas_chain (the chain's drafts per step) must be >= 1, got {eyas_chain}")
    if isinstance(questions, (str, os.PathLike)):
        questions = load_questions(questions, limit, per_category)
    elif not (questions := list(questions)[:limit]):
        raise InputError("no questions to benchmark")
    threads_before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        report = _run(target, head, questions, max_new_tokens, temperature, top_p, top_k, dtype, device,
                      prompt_lookup, eyas_plain, eyas_chain, seed, progress, tree_options, engines, repeats, generate,
                      compile)
    finally:
        torch.set_num_threads(threads_before)
    if note:
        report["settings"]["note"] = note
    if dtype_note:
        report["settings"]["dtype_note"] = dtype_note
    if out is not None:
        write_report(report, out)
    return report


def _run(target, head, questions: list[Question], max_new_tokens: int, temperature: float, top_p: float, top_k: int,
         dtype: str, device: str, prompt_lookup: int | None, eyas_plain: bool, eyas_chain: int | None, seed: int,
         progress: bool, tree_options: dict[str, Any], engines: EngineOptions | None = None, repeats: int = 1,
         generate: bool = True, compile: bool = False) -> dict:
    from eyas.inference import SpeculativeGenerator, TreeOptions

    target, gen = load_generator(target, head, dtype, device, tree_options, compile)
    compile = target.compiled  # a Target passed in is used as it is
    eos = target.eos_ids()
    sampling = temperature > 0
    settings_ = Sampling(temperature, top_p, top_k)  # the same explicit settings on every side

    def config(n: int, lookup: bool = False):
        extra = dict(prompt_lookup_num_tokens=prompt_lookup) if lookup else {}
        return _generation_config(target, n, temperature, top_p, top_k, eos, **extra)

    def sync() -> None:
        synchronize(target.device)

    def plain(ids: list[int], config, seed_: int) -> tuple[list[int], float]:
        torch.manual_seed(seed_)
        x = torch.tensor([ids], device=target.device)
        sync()
        t0 = time.perf_counter()
        y = target.model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=config)
        sync()
        return y[0, len(ids):].tolist(), time.perf_counter() - t0

    def speculative(g):
        def run(ids: list[int], n: int, seed_: int):
            sync()
            t0 = time.perf_counter()
            res = g.generate(ids, max_new_tokens=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=0.0,
                             repetition_penalty=1.0, eos_token_id=eos, seed=seed_)
            sync()
            return res, time.perf_counter() - t0
        return run

    def one_token(ids: list[int], n: int, seed_: int) -> tuple[list[int], float]:
        sync()
        t0 = time.perf_counter()
        tokens = plain_decode(target, ids, n, eos, settings_, seed_)
        sync()
        return tokens, time.perf_counter() - t0

    # The runtimes: each decodes a question's prompt ids into (result, seconds), the result its tokens, eyas's
    # GenerationResult (tokens and stats) or an engine's EngineRow (tokens and counters); `n` new tokens at most,
    # `seed_` for sampling. `drafts` says how many drafts a chain runtime verifies per step.
    runtimes: dict[str, Callable[[list[int], int, int], tuple[Any, float]]] = {}
    drafts: dict[str, int] = {}
    if generate:
        runtimes["baseline"] = lambda ids, n, seed_: plain(ids, config(n), seed_)
    runtimes["spec"] = speculative(gen)
    if eyas_chain:
        runtimes["eyas_chain"] = speculative(SpeculativeGenerator(target, gen.head, TreeOptions(
            kind="chain", depth=eyas_chain, lookup=0)))
        drafts["eyas_chain"] = eyas_chain
    if prompt_lookup:
        runtimes["prompt_lookup"] = lambda ids, n, seed_: plain(ids, config(n, lookup=True), seed_)
    if eyas_plain:
        runtimes["eyas_plain"] = one_token

    stop = GracefulStop(tqdm.write, "finishing this question, then reporting the questions done")
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        engine_info = None
        if engines is not None:  # each engine starts once (minutes when it compiles) and stays warm
            started, engine_info = engines.start(
                stack, target, gen.head if isinstance(head, DraftHead) else head,
                dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed), eos, dtype)
            runtimes.update(started)
            drafts.update({name: engines.draft_tokens for name in started if not name.endswith("_plain")})

        # plain decoding's bound, measured in this run (a shared host's rate drifts): read before, between and after
        # the questions (memory_limit.ReadRate)
        reads = ReadRate(target.device) if eyas_plain else None
        if reads is not None:
            reads.sample()

        # One warm-up each: first-call costs (allocations, kernel selection) stay out of the numbers; a compiled
        # target warms up over a whole answer, so the graphs of every kind of step and size are built before.
        warm = prompt_ids(target, questions[0])
        for run in runtimes.values():
            run(warm, max_new_tokens if compile else WARMUP_TOKENS, seed)

        bar = tqdm(questions, desc="bench", unit="q", disable=not progress)
        # A first Ctrl-C ends the run after the question in hand and reports the questions done (a second one
        # aborts at once, writing nothing).
        with stop:
            for i, q in enumerate(bar):
                if stop:
                    break
                ids = prompt_ids(target, q)
                times: dict[str, list[float]] = {name: [] for name in runtimes}
                results: dict[str, list[Any]] = {name: [] for name in runtimes}
                for r in range(repeats):
                    order = list(runtimes) if (i + r) % 2 == 0 else list(reversed(runtimes))  # alternate who's first
                    for name in order:
                        result, seconds = runtimes[name](ids, max_new_tokens, seed + i)
                        results[name].append(result)
                        times[name].append(seconds)
                rows.append(_row(q, ids, results, times, sampling, gen.head, drafts))
                bar.set_postfix_str(_running(rows))
                if reads is not None:
                    reads.sample()
        bar.close()
    memory = reads.limit(weight_bytes(target.model)) if reads is not None else None
    stopped = {"signal": stop.signum, "questions_done": len(rows), "questions_left": len(questions) - len(rows)}

    tree = asdict(gen.options)
    if gen.planner is not None:  # "auto": the cost model it measured on this machine
        tree["cost_model"] = gen.planner.describe()
    report = {"settings": settings(target, head, tree=tree, dtype=dtype, compile=compile, max_new_tokens=max_new_tokens,
                                   temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                   prompt_lookup=prompt_lookup, eyas_plain=eyas_plain, eyas_chain=eyas_chain,
                                   eos_token_ids=eos, questions=len(rows), engines=engine_info, repeats=repeats,
                                   generate=generate, runtimes=list(runtimes),
                                   **({"stopped": stopped} if stop else {})),
              # a static tree's depth is its longest path: leave the positions to the observed cycles
              **summarize(rows, sampling=sampling, depth=tree["depth"] if tree["kind"] != "static" else None)}
    if memory is not None:
        report["memory_limit"] = memory.as_dict()
    return report


def load_generator(target: str | Target, head: str | os.PathLike | DraftHead, dtype: str, device: str,
                   tree_options: dict[str, Any], compile: bool = False):
    """(Target, SpeculativeGenerator): one Target in `dtype` shared by both sides (compile: loaded with its decode
    steps compiled; a Target passed in is used as it is)."""
    from eyas.inference import SpeculativeGenerator
    from eyas.models import load_head
    from eyas.models.target import resolve_dtype

    if isinstance(target, str):
        target = Target.load(target, dtype=dtype, device=device, compile=compile)
    elif target.dtype != resolve_dtype(dtype):
        raise ValueError(f"the target given is {target.dtype}, not the requested dtype {dtype!r}: "
                         "load it in that dtype, or pass its spec")
    if not isinstance(head, DraftHead):
        head = load_head(head, target, dtype=dtype)
    gen = SpeculativeGenerator.from_pretrained(target, head, dtype=dtype, **tree_options)
    return target, gen


@torch.no_grad()
def plain_decode(target: Target, ids: list[int], max_new_tokens: int, eos: list[int], sampling: Sampling,
                 seed: int) -> list[int]:
    """One token per target forward through eyas's Target and KV cache: the reference without speculation."""
    dev = target.device
    gen = torch.Generator(dev).manual_seed(seed)
    cache = target.new_cache(1, len(ids) + max_new_tokens)
    out = target(torch.tensor([ids], device=dev), cache=cache, logits=torch.tensor([[len(ids) - 1]], device=dev))
    cache.commit([len(ids)])
    tokens: list[int] = []
    while True:
        tokens.append(int(choose(out.logits[:, -1], sampling, gen)[0]))
        if tokens[-1] in eos or len(tokens) >= max_new_tokens:
            return tokens
        out = target(torch.tensor([tokens[-1:]], device=dev), cache=cache)
        cache.commit([1])


def _generation_config(target: Target, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                       eos: list[int], **extra):
    """A fresh GenerationConfig: the model's own defaults (sampling, repetition penalty) must not leak in."""
    from transformers import GenerationConfig

    pad = target.tokenizer.pad_token_id
    sample = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if temperature > 0 \
        else dict(do_sample=False)
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos,
                            pad_token_id=pad if pad is not None else eos[0], **sample, **extra)


def _tokens(result: Any) -> list[int]:
    return list(result.tokens) if hasattr(result, "tokens") else list(result)


def _row(q: Question, ids: list[int], results: dict[str, list[Any]], times: dict[str, list[float]], sampling: bool,
         head: DraftHead, drafts: dict[str, int]) -> dict[str, Any]:
    """One question: per runtime its tokens and its median time over the repeats (every repeat's time beside it),
    whether every repeat's output equals the reference's (greedy), and for a runtime that drafts the counters of
    its median run; eyas's own stats (planned trees) as plain fields."""
    median = {name: sorted(range(len(t)), key=t.__getitem__)[(len(t) - 1) // 2] for name, t in times.items()}
    res = results["spec"][median["spec"]]
    stats = res.stats
    reference = _tokens(results["baseline" if "baseline" in results else "eyas_plain"][0])
    row: dict[str, Any] = {"question_id": q.question_id, "category": q.category, "prompt_tokens": len(ids)}
    for name in results:
        row[f"{name}_tokens"] = len(_tokens(results[name][median[name]]))
        row[f"{name}_time_s"] = times[name][median[name]]
        row[f"{name}_times_s"] = list(times[name])
        if name not in ("baseline", "spec"):
            row[f"{name}_exact"] = None if sampling else all(_tokens(r) == reference for r in results[name])
        if name in drafts:  # a chain of drafts[name] per step: tokens gained per step, in order where known
            one = results[name][median[name]]
            engine = isinstance(one, EngineRow)
            row[f"{name}_draft_tokens"] = drafts[name]
            row[f"{name}_accepted"] = (one.steps or one.accepted) if engine else list(one.stats.accepted)
            row[f"{name}_ordered"] = not engine or one.steps is not None
            row[f"{name}_counters"] = one.counters if engine else eyas_counters(one.stats)
    row.update({
        "draft_time_s": stats.draft_time_s, "target_time_s": stats.target_time_s,
        "engine_time_s": stats.total_time_s, "prefill_time_s": stats.prefill_time_s,
        "cycles": len(stats.accepted),
        "tau": sum(stats.accepted) / len(stats.accepted) if stats.accepted else 0.0,
        "accepted": list(stats.accepted),
        "drafted": list(stats.drafted),
        "depths": list(stats.depths),
        "spec_counters": eyas_counters(stats),
        "exact": None if sampling else all(_tokens(r) == reference for r in results["spec"]),
        # output tokens the head could never have proposed: a ceiling on acceptance set by the draft vocab
        "out_of_draft_vocab_tokens": int((~head.can_propose(torch.tensor(res.tokens, dtype=torch.long))).sum()),
    })
    return row


def eyas_counters(stats) -> dict[str, Any]:
    """eyas's counters under the engines' names: verify steps (plain ones included), steps that carried drafts,
    draft tokens verified, drafts accepted, and steps that accepted position k (k = 0, 1, ..)."""
    gained = [a - 1 for a in stats.accepted]
    return {"steps": len(stats.accepted), "drafts": sum(n > 0 for n in stats.drafted),
            "draft_tokens": sum(stats.drafted), "accepted_tokens": sum(gained),
            "accepted_per_position": [sum(g > k for g in gained) for k in range(max(stats.depths, default=0))]}


def _running(rows: list[dict[str, Any]]) -> str:
    ref = "baseline" if "baseline_time_s" in rows[0] else "eyas_plain"
    base = sum(r[f"{ref}_tokens"] for r in rows) / max(sum(r[f"{ref}_time_s"] for r in rows), 1e-9)
    spec = sum(r["spec_tokens"] for r in rows) / max(sum(r["spec_time_s"] for r in rows), 1e-9)
    cycles = sum(r["cycles"] for r in rows)
    tau = sum(sum(r["accepted"]) for r in rows) / max(cycles, 1)
    return f"tau {tau:.2f} speedup {spec / max(base, 1e-9):.2f}x {'generate' if ref == 'baseline' else 'eyas plain'}"


def settings(target: Target, head: Any, **run: Any) -> dict[str, Any]:
    return {
        "target": target.name_or_path,
        "head": str(head) if not isinstance(head, DraftHead) else f"<in-memory {head.config.head_type} head>",
        **run,
        "threads": torch.get_num_threads(),
        "device": str(target.device),
        "versions": {name: _version(name) for name in ("eyas", "torch", "transformers")},
        "machine": machine(),
    }


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu": _cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_report(report: dict[str, Any], out: str | os.PathLike) -> tuple[Path, Path]:
    """report.json (atomic) and report.png beside it; returns both paths."""
    out = Path(out)
    with atomic_file(out) as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    plot = out.with_suffix(".png")
    write_plot(report, plot)
    return out, plot


__all__ = ["Question", "load_questions", "run_bench", "write_report", "format_table"]
