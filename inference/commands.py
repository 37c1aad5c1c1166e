"""`eyas generate`, `eyas chat`, `eyas bench`, `eyas check-served` and `eyas demo`."""

from __future__ import annotations

import argparse

from eyas.models.arguments import (
    add_compile_option,
    int_or_auto,
    non_negative,
    non_negative_float,
    nucleus,
    positive,
    positive_float,
    probability,
    tree_paths,
)

from .main_job import FULL, QUICK  # light: the main job imports torch only when it runs


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="speculative generation from a prompt with a trained head",
                       description="Generate text from --prompt with the target, accelerated by the draft head. "
                       "Greedy output is token-identical to the target's own; sampling keeps its distribution.",
                       epilog="examples:\n"
                       "  eyas generate --target smollm2-135m --head heads/smollm2-135m-eagle3 "
                       "--prompt \"Name three uses of copper.\" --stats\n"
                       "  eyas generate --target smollm2-135m --head heads/smollm2-135m-eagle3 "
                       "--prompt \"def fib(n):\" --raw --temperature 0.7 --seed 1")
    p.add_argument("--prompt", required=True, help="the prompt; sent as a user message through the chat template "
                   "when the tokenizer has one (see --raw)")
    p.add_argument("--raw", action="store_true", help="tokenize --prompt as is, without the chat template")
    p.add_argument("--stats", action="store_true", help="print acceptance and timing stats to stderr at the end")
    _add_generation_options(p)
    p.set_defaults(func=_generate)
    p = sub.add_parser("chat", help="interactive chat with streaming speculative generation",
                       description="Chat with the target through its chat template; replies stream as tokens are "
                       "accepted. Type /reset to forget the conversation, /exit (or Ctrl-D) to quit.",
                       epilog="example:\n  eyas chat --target smollm2-135m --head heads/smollm2-135m-eagle3 "
                       "--system \"You answer in one sentence.\" --stats")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--stats", action="store_true", help="print acceptance and timing stats after each reply")
    _add_generation_options(p)
    p.set_defaults(func=_chat)
    p = sub.add_parser("bench", help="benchmark a head against plain generate on MT-bench style questions",
                       description="Measure acceptance length, per-position acceptance and end-to-end speedup "
                       "against plain transformers generate, and beside them every runtime asked for (eyas plain, "
                       "eyas verifying chains, prompt lookup, vLLM and SGLang plain and with the head), alternated "
                       "question by question; serving engines are started once and kept warm. With --repeats, "
                       "each runtime's A/A spread says which ratios are beyond noise.",
                       epilog="Questions: one JSON object per line, MT-bench / Spec-Bench rows "
                       "({question_id, category, turns}: the first turn goes through the target's chat template) "
                       "or HumanEval-style rows ({prompt}: used raw). Writes REPORT.json and REPORT.png beside it. "
                       "Ctrl-C stops after the question in hand and reports the questions done (a second Ctrl-C "
                       "exits at once).\n\n"
                       "examples:\n"
                       "  eyas bench --target smollm2-135m --head heads/smollm2-135m-eagle3 --per-category 1 "
                       "--prompt-lookup --out runs/bench/report.json\n"
                       "  eyas bench --target smollm2-135m --head heads/smollm2-135m-eagle3 --questions my.jsonl "
                       "--eyas-plain --repeats 3 --out runs/bench/mine.json\n"
                       "  EYAS_VLLM_PYTHON=~/vllm-venv/bin/python eyas bench --target smollm2-135m --head "
                       "heads/smollm2-135m-eagle3 --vllm --eyas-plain --per-category 1 --repeats 2 "
                       "--out runs/serve/report.json")
    _add_model_options(p)
    p.add_argument("--questions", default="mt-bench",
                   help="questions: `mt-bench` (the 80 MT-bench questions, shipped with eyas; default) or a .jsonl "
                   "file")
    p.add_argument("--out", required=True, help="report .json path; the plot goes beside it as .png")
    _add_sampling_options(p)
    p.add_argument("--seed", type=int, default=0, help="sampling seed; question i uses seed+i on both sides")
    p.add_argument("--limit", type=non_negative, default=None, help="only the first N questions")
    p.add_argument("--per-category", type=positive, default=None, metavar="N",
                   help="only the first N questions of each category (MT-bench: --per-category 1 = 8 questions)")
    p.add_argument("--threads", type=positive, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--prompt-lookup", type=positive, nargs="?", const=10, default=None, metavar="N",
                   help="also run transformers prompt-lookup decoding with N candidate tokens (default N=10)")
    p.add_argument("--eyas-plain", action="store_true",
                   help="also time plain one-token decoding through eyas's Target: separates what its faster "
                   "logits give from what speculation gives, and is the reference of the per-question speedups "
                   "(worst, p10, share slower); the report then gives plain decoding's memory limit (the weights' "
                   "bytes over this machine's read rate, measured in the run) and the share of it each plain "
                   "runtime reached")
    p.add_argument("--repeats", type=positive, default=1, metavar="N",
                   help="run every question N times, the runtimes in alternating order each time; per question the "
                   "median time counts, and the worst single run is reported too (default 1)")
    p.add_argument("--no-generate", action="store_true",
                   help="skip transformers generate (needs --eyas-plain, then the only reference): saves a third of "
                   "the time when only speculation against plain decoding matters")
    p.add_argument("--eyas-chain", action="store_true",
                   help="also run eyas verifying a chain of --draft-tokens drafts at every step, no planner, no "
                   "lookup: what vLLM and SGLang verify (on by itself with --vllm or --sglang)")
    p.add_argument("--draft-tokens", type=positive, default=5, metavar="K",
                   help="the chain length per step of vLLM, SGLang and --eyas-chain (default: 5)")
    p.add_argument("--vllm", action="store_true",
                   help="also run vLLM plain and with the head (exported to the speculators layout), installed in its "
                   "own environment (docs/runtimes.md), each engine started once and alternated with eyas per "
                   "question; its tau, acceptance, counters and tok/s join the report")
    p.add_argument("--vllm-python", default=None, metavar="PYTHON",
                   help="python of the environment vLLM is installed in (default: $EYAS_VLLM_PYTHON)")
    p.add_argument("--sglang", action="store_true",
                   help="also run SGLang plain and with the head (sglang layout) where it is installed "
                   "($EYAS_SGLANG_PYTHON); where it is not, the report says why in one line")
    p.add_argument("--eager", action="store_true",
                   help="engines without graph compilation: vLLM starts in seconds instead of minutes, decodes slower")
    p.add_argument("--no-engine-plain", action="store_true",
                   help="skip the engines' plain decoding (one engine start less each)")
    p.add_argument("--note", default=None, metavar="TEXT",
                   help="a line saying what this run is, kept in the report and shown above the table and on the plot")
    p.set_defaults(func=_bench)
    p = sub.add_parser("check-served", help="check that a serving engine drafts what eyas's head drafts, and renders "
                       "prompts as eyas does",
                       description="Export the head for vLLM (or take an export with --served), run questions through "
                       "vLLM greedily with every proposal recorded, and compare, token by token, each proposal with "
                       "the chain eyas's own head drafts from the same context (the engine's prompt + the tokens it "
                       "had decided), and the prompt ids the engine rendered from the chat messages with eyas's "
                       "rendering. Where they differ, the likely causes are tried in eyas and the one that reproduces "
                       "the engine is named: fused layer ids shifted by one, the draft vocab map off by one, a norm "
                       "flag flipped, another rope theta; for the rendering, another chat template in the engine's "
                       "model folder, a BOS token added or dropped, special tokens, no generation prompt. Greedy, "
                       "fp32 on both sides. Exit status 0: the check passed; 1: it failed.",
                       epilog="examples:\n"
                       "  EYAS_VLLM_PYTHON=~/vllm-venv/bin/python eyas check-served --target smollm2-135m "
                       "--head heads/smollm2-135m-eagle3\n"
                       "  eyas check-served --target smollm2-135m --head heads/smollm2-135m-eagle3 --served "
                       "heads/smollm2-135m-eagle3-vllm --engine-model /srv/models/smollm2 --limit 8 --out check.json")
    p.add_argument("--target", required=True, help="the target as eyas runs it: model folder, hub id or `smollm2-135m`")
    p.add_argument("--head", required=True,
                   help="eyas's head (any layout, or a training checkpoint): the drafts the engine's must equal")
    p.add_argument("--served", default=None, metavar="DIR",
                   help="the speculators folder the engine loads (default: --head exported now)")
    p.add_argument("--engine-model", default=None, metavar="DIR",
                   help="the model folder the engine serves, when it is not --target's (its tokenizer and chat "
                   "template are the engine's)")
    p.add_argument("--questions", default="mt-bench",
                   help="questions: `mt-bench` (shipped with eyas; default) or a .jsonl file of MT-bench or "
                   "HumanEval-style rows")
    p.add_argument("--limit", type=positive, default=4, help="the first N questions")
    p.add_argument("--max-new-tokens", type=positive, default=48, help="new tokens per question")
    p.add_argument("--draft-tokens", type=positive, default=5, metavar="K",
                   help="the engine drafts a chain of K per step")
    p.add_argument("--tolerance", type=probability, default=0.02,
                   help="the share of proposals that may differ (engines round otherwise than eyas: near-ties)")
    p.add_argument("--vllm-python", default=None, metavar="PYTHON",
                   help="python of the environment vLLM is installed in (default: $EYAS_VLLM_PYTHON)")
    p.add_argument("--engine-compile", action="store_true",
                   help="let vLLM compile its graphs (minutes at start on a CPU); without it the engine runs eager")
    p.add_argument("--out", default=None, metavar="JSON", help="also write the result as JSON")
    p.set_defaults(func=_check_served)
    p = sub.add_parser("demo", help="the main job: self-distil data, train the demo head, export it, benchmark it "
                       "(--quick: a smoke run of it in minutes)",
                       description="Have the target answer ShareGPT prompts itself (self-distillation, with the "
                       "hidden states captured while generating), train the demo EAGLE-3 head for "
                       "SmolLM2-135M-Instruct on them (configs/smollm2-135m-eagle3.yaml), export it, run `eyas bench` "
                       "on MT-bench and print the table and where the plot is. Each step is the real command (printed "
                       "as it runs, with its time); rerunning resumes every step. The main job takes hours on a CPU; "
                       "--quick runs the same steps at smoke-test sizes (~10 minutes on 2 CPU cores, in its own "
                       "-quick folders) and says, in its output and its report, that it measures nothing.\n\n"
                       "Stopping: Ctrl-C stops the running step at its next safe point and says how much work it "
                       "dropped (a second Ctrl-C exits at once); rerun the same command to continue. During "
                       "regeneration the main job drops the answers in flight (the rerun regenerates them in full); "
                       "--quick keeps them, cut where they stand, so a stop throws no work away.",
                       epilog="examples:\n"
                       "  eyas demo --quick                        # the whole pipeline as a smoke run\n"
                       "  eyas demo --quick --out /tmp/eyas-quick  # everything it writes under one folder\n"
                       "  eyas demo --per-category 1               # the main job, one MT-bench question per category\n"
                       "  eyas demo --distill-conversations 2000 schedule.epochs=3")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run of the same steps: {QUICK.sizes()}, the draft vocab counted on the "
                   "training data; the flags below and KEY=VALUE overrides still apply")
    p.add_argument("--questions", default="mt-bench",
                   help="bench questions: `mt-bench` (shipped with eyas; default) or a .jsonl file")
    p.add_argument("--config", default="configs/smollm2-135m-eagle3.yaml", help="training run YAML")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="run folder: self-distilled data, training run, bench report (default: the config's "
                   "output_dir, + -quick with --quick)")
    p.add_argument("--head-out", default=None, help="where the exported head goes (default: heads/<config name>, "
                   "+ -quick with --quick; with --out: DIR/export)")
    p.add_argument("--report", default=None, help="bench report path (default: <run folder>/bench/report.json)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="the target's dtype in every step (default auto: bf16 on a GPU and on a CPU with native bf16 "
                   "(AMX, AVX512-BF16), else fp32; fp32 for greedy outputs token-identical to generate)")
    p.add_argument("--limit", type=non_negative, default=None,
                   help=f"bench only the first N questions (default: all; --quick: {QUICK.limit})")
    p.add_argument("--per-category", type=positive, default=None, metavar="N",
                   help=f"bench only the first N questions of each category (default: all; --quick: "
                   f"{QUICK.per_category})")
    p.add_argument("--max-new-tokens", type=positive, default=None,
                   help=f"new tokens per question (default: {FULL.max_new_tokens}; --quick: {QUICK.max_new_tokens})")
    d, q = FULL.distill, QUICK.distill
    p.add_argument("--distill-source", default=None, help=f"prompts to self-distil (default: {d.source})")
    p.add_argument("--distill-conversations", type=non_negative, default=None, metavar="N",
                   help=f"answer the first user turn of the first N conversations (default: {d.conversations}; "
                   f"--quick: {q.conversations}); 0 trains on the config's data.source as it is")
    p.add_argument("--distill-max-new-tokens", type=positive, default=None, metavar="N",
                   help=f"longest self-distilled answer (default: {d.max_new_tokens}; --quick: {q.max_new_tokens})")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="training config overrides, e.g. schedule.total_steps=50 (after --quick's own)")
    p.set_defaults(func=_demo)


def _add_generation_options(p: argparse.ArgumentParser) -> None:
    _add_model_options(p)
    _add_sampling_options(p)
    p.add_argument("--min-p", type=probability, default=None,
                   help="sampling min-p, 0 = off (default: generation_config)")
    p.add_argument("--repetition-penalty", type=positive_float, default=None,
                   help="1 = off, > 1 discourages repeats (default: generation_config, which some models set)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: not seeded)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True,
                   help="target model: local HF folder, .gguf file, hub id or `smollm2-135m`")
    p.add_argument("--head", required=True, help="draft head folder (eyas, SGLang, speculators or EAGLE-1 layout)")
    p.add_argument("--device", default=None, help="where target and head run: cpu, cuda, cuda:N, or auto (the target "
                   "split over every visible GPU); default cuda when a GPU is visible, else cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="target and head dtype (default auto: bf16 on a GPU and on a CPU with native bf16 "
                   "(AMX, AVX512-BF16), else fp32; fp32 for greedy output token-identical to generate)")
    add_compile_option(p)
    add_tree_options(p)


def _placement(args: argparse.Namespace) -> None:
    """Fill in --device and --dtype defaults (the dtype follows the device and what its CPU computes natively) and
    say which dtype runs and why, on stderr."""
    import sys

    from eyas.models.loading import dtype_note, placement

    requested = args.dtype
    args.device, args.dtype = placement(args.device, args.dtype)
    args.dtype_note = dtype_note(args.device, requested, args.dtype)
    print(f"eyas {args.command}: {args.dtype_note}", file=sys.stderr)


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=positive, default=256, help="new tokens per reply (default 256)")
    p.add_argument("--temperature", type=non_negative_float, default=None,
                   help="0 = greedy, >0 samples (default: the target's generation_config, as `model.generate` uses it)")
    p.add_argument("--top-p", type=nucleus, default=None,
                   help="nucleus sampling threshold (default: generation_config)")
    p.add_argument("--top-k", type=non_negative, default=None,
                   help="sampling top-k, 0 = off (default: generation_config)")


def _load_generator(args: argparse.Namespace):
    from eyas.inference import SpeculativeGenerator

    _placement(args)
    return SpeculativeGenerator.from_pretrained(args.target, args.head, dtype=args.dtype, device=args.device,
                                                compile=args.compile, **tree_options(args))


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                stop=args.stop)


def format_stats(stats) -> str:
    """One line: τ, throughput, and where the time went."""
    n = stats.prefill_tokens + sum(stats.accepted)
    overhead = stats.total_time_s - stats.draft_time_s - stats.target_time_s
    return (f"tau {stats.mean_accepted:.2f} tokens/forward over {len(stats.accepted)} cycles | {n} tokens in "
            f"{stats.total_time_s:.2f}s ({n / max(stats.total_time_s, 1e-9):.1f} tok/s) | "
            f"draft {stats.draft_time_s:.2f}s "
            f"target {stats.target_time_s:.2f}s (prefill {stats.prefill_time_s:.2f}s) overhead {overhead:.2f}s")


def _stream(gen, prompt, args: argparse.Namespace) -> str:
    """Print the reply as it is accepted (stats to stderr with --stats); return its text."""
    import sys

    from eyas.inference import GenerationStats

    stats, pieces = GenerationStats(), []
    for piece in gen.stream(prompt, stats=stats, **_sampling_kwargs(args)):
        pieces.append(piece)
        print(piece, end="", flush=True)
    print()
    if args.stats:
        print(format_stats(stats), file=sys.stderr)
    return "".join(pieces)


def _generate(args: argparse.Namespace) -> int:
    gen = _load_generator(args)
    raw = args.raw or not getattr(gen.target.tokenizer, "chat_template", None)
    _stream(gen, args.prompt if raw else [{"role": "user", "content": args.prompt}], args)
    return 0


def _chat(args: argparse.Namespace) -> int:
    gen = _load_generator(args)
    if not getattr(gen.target.tokenizer, "chat_template", None):
        from eyas.models.errors import InputError

        raise InputError(f"target {args.target!r} has no chat template; use `eyas generate --raw` instead")
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line == "/exit":
            return 0
        if line == "/reset":
            messages = list(start)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": _stream(gen, messages, args)})


def add_tree_options(p: argparse.ArgumentParser) -> None:
    """Draft tree flags, passed to SpeculativeGenerator; unset flags keep TreeOptions' defaults."""
    g = p.add_argument_group("draft tree")
    g.add_argument("--tree", dest="tree_kind", choices=["dynamic", "static", "chain"], default=None,
                   help="tree shape: dynamic (expand the likeliest nodes), static (fixed --paths) or chain")
    g.add_argument("--depth", type=positive, default=None,
                   help="draft steps per cycle; with --total-tokens auto the most the tuner may pick (default 6)")
    g.add_argument("--tree-top-k", type=positive, default=None, help="children considered per node (dynamic tree)")
    g.add_argument("--total-tokens", type=int_or_auto, default=None,
                   help="draft tokens verified per cycle (dynamic tree), or `auto` (default): time this machine's "
                   "target forwards and one draft, then pick the depth and size with the most expected tokens/s")
    g.add_argument("--paths", type=tree_paths, default=None, help='static tree as JSON paths, e.g. "[[0],[1],[0,0]]"')
    g.add_argument("--lookup", type=non_negative, default=None, metavar="N",
                   help="graft up to N n-gram lookup tokens (text repeated from the prompt or output) onto each "
                   "tree as one more branch; with --total-tokens auto fewer when they are not being accepted "
                   "(default 8, 0 = off)")


def tree_options(args: argparse.Namespace) -> dict:
    opts = {"kind": args.tree_kind, "depth": args.depth, "top_k": args.tree_top_k,
            "total_tokens": args.total_tokens, "paths": args.paths, "lookup": args.lookup}
    return {k: v for k, v in opts.items() if v is not None}


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eyas.models.errors import MissingInput

    from .bench import format_table, run_bench
    from .runtimes_vllm import ENGINES, EngineOptions, engine_python

    _placement(args)
    engines, pythons, not_run = None, {}, {}
    if args.vllm:
        pythons["vllm"] = engine_python("vllm", args.vllm_python)
        if pythons["vllm"] is None:
            raise MissingInput("--vllm needs vLLM's interpreter: pass --vllm-python or set EYAS_VLLM_PYTHON "
                               "(docs/runtimes.md: installing vLLM beside eyas)")
    if args.sglang:
        if (python := engine_python("sglang")) is not None:
            pythons["sglang"] = python
        else:  # where SGLang is not installed the run goes on without it and says so
            not_run[ENGINES["sglang"].label] = ENGINES["sglang"].missing
    if pythons or not_run:
        engines = EngineOptions(pythons, args.draft_tokens, args.eager, not args.no_engine_plain,
                                not_run=not_run)
    report = run_bench(args.target, args.head, args.questions, max_new_tokens=args.max_new_tokens,
                       # the bench states its settings for every side: greedy unless asked (not generation_config)
                       temperature=args.temperature or 0.0, top_p=args.top_p or 1.0, top_k=args.top_k or 0,
                       seed=args.seed,
                       dtype=args.dtype, device=args.device, limit=args.limit, per_category=args.per_category,
                       threads=args.threads,
                       prompt_lookup=args.prompt_lookup, eyas_plain=args.eyas_plain,
                       eyas_chain=args.draft_tokens if args.eyas_chain or pythons else None, out=args.out,
                       engines=engines,
                       repeats=args.repeats, generate=not args.no_generate, note=args.note,
                       dtype_note=args.dtype_note, compile=args.compile, **tree_options(args))
    print(format_table(report))
    print(f"report: {args.out}\nplot:   {Path(args.out).with_suffix('.png')}")
    if stopped := report["settings"].get("stopped"):
        import sys

        print(f"eyas bench: stopped after {stopped['questions_done']} questions; the report covers those, the "
              f"{stopped['questions_left']} left were not run", file=sys.stderr)
        return 128 + stopped["signal"]
    return 0


def _check_served(args: argparse.Namespace) -> int:
    import json
    import sys
    import tempfile
    from pathlib import Path

    import torch
    from transformers import AutoTokenizer

    from eyas.models import Target, load_head
    from eyas.models.atomic import atomic_file
    from eyas.models.errors import MissingInput
    from eyas.models.layouts import head_folder

    from .bench import load_questions, prompt_ids
    from .check_served import check_served
    from .runtimes_vllm import EngineSettings, engine_python, export_for, max_model_len, run_engine, vllm_model

    python = engine_python("vllm", args.vllm_python)
    if python is None:
        raise MissingInput("check-served needs vLLM's interpreter: pass --vllm-python or set EYAS_VLLM_PYTHON "
                           "(docs/runtimes.md: installing vLLM beside eyas)")
    target = Target.load(args.target, dtype="fp32", device="cpu")
    head = load_head(head_folder(Path(args.head)), target, dtype="fp32")
    questions = load_questions(args.questions, args.limit)
    prompts = [[{"role": "user", "content": q.prompt}] if q.chat else prompt_ids(target, q) for q in questions]
    model = vllm_model(args.engine_model or args.target)
    settings = EngineSettings(eos_token_ids=tuple(target.eos_ids()), num_speculative_tokens=args.draft_tokens,
                              threads=torch.get_num_threads(), max_model_len=max_model_len(target),
                              enforce_eager=not args.engine_compile, kv_cache_gib=1)
    with tempfile.TemporaryDirectory(prefix="eyas-check-served-") as tmp:
        served = args.served or export_for("vllm", args.head, Path(tmp) / "served", target)
        print(f"eyas check-served: {len(prompts)} questions through vLLM serving {model} with {served}",
              file=sys.stderr)
        result = check_served(
            target, head, prompts,
            lambda batch: run_engine(python, model, batch, settings, args.max_new_tokens, served).rows,
            args.draft_tokens, args.tolerance, AutoTokenizer.from_pretrained(model) if args.engine_model else None)
    print("\n".join(result.lines()))
    if args.out:
        with atomic_file(Path(args.out)) as f:
            json.dump(result.to_dict(), f, indent=2)
    return 0 if result.passed else 1


def _demo(args: argparse.Namespace) -> int:
    from .main_job import plan_with, run_main_job

    plan = plan_with(QUICK if args.quick else FULL, limit=args.limit, per_category=args.per_category,
                     max_new_tokens=args.max_new_tokens,
                     distill=dict(source=args.distill_source, conversations=args.distill_conversations,
                                  max_new_tokens=args.distill_max_new_tokens))
    return run_main_job(args.config, args.questions, plan, head_out=args.head_out, out=args.out, report=args.report,
                        dtype=args.dtype, overrides=args.overrides)
