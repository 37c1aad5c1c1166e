"""Benchmark: the cost of eyas's decoding loop itself, plain and speculative, and how it compares with another revision.

    python benchmarks/bench_cycle.py [--target smollm2-135m] [--tokens 96] [--repeats 3]
    python benchmarks/bench_cycle.py --compare-with bf46f06      # this checkout vs that revision, alternated

Per prompt (the first user turns of a few ShareGPT conversations), greedy, fp32, after one warm-up:
- plain: one token per target forward through eyas's Target (`bench.plain_decode`): what a cycle costs
  when it verifies the root alone, without the engine around it;
- spec: speculative generation with a fixed tree (a random head, --total-tokens nodes, no lookup): the
  whole cycle, head, verify, acceptance and bookkeeping; its tokens per target forward are ~1 with a
  random head, so its time per token is the cycle's cost.
Printed per variant: ms per generated token, prefill included (median of --repeats), in wall time and in
the process's CPU time (`_cpu`: with one thread, the time the process computed, not the time it waited for
the machine's cores). With --compare-with, the other revision is checked out into a temporary folder and
both run in turns (A B A B ...), each in its own process, so drift in machine speed hits both alike; the
last lines are the ratios new / old.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from eyas.data.sources import load_conversations
    from eyas.inference import SpeculativeGenerator, TreeOptions
    from eyas.inference.bench import plain_decode
    from eyas.models import DraftHead, Target, head_config_for

    try:
        from eyas.models.sampling import Sampling
    except ImportError:  # older revisions kept it beside the acceptance rule
        from eyas.inference.acceptance import Sampling
    if args.threads:
        torch.set_num_threads(args.threads)
    target = Target.load(args.target, dtype="fp32")  # both revisions in the same dtype, whatever `auto` means
    torch.manual_seed(0)
    head = DraftHead(head_config_for(target, "eagle3", draft_vocab_size=8192), target)
    gen = SpeculativeGenerator(target, head, TreeOptions(total_tokens=args.total_tokens, depth=3, lookup=0))
    convs, _ = load_conversations("sharegpt")
    prompts = []
    for row in convs:
        m = row["messages"]
        if not row["problem"] and m[0]["role"] == "user" and 20 < len(m[0]["content"]) < 600:
            prompts.append(gen.encode(m[:1]))
        if len(prompts) == args.prompts:
            break
    plain_decode(target, prompts[0], 8, [], Sampling(), 0)  # warm-up
    gen.generate(prompts[0], max_new_tokens=8, eos_token_id=[])
    runs = {"plain": lambda ids: plain_decode(target, ids, args.tokens, [], Sampling(), 0),
            "spec": lambda ids: gen.generate(ids, max_new_tokens=args.tokens, eos_token_id=[]).tokens}
    times: dict[str, list[float]] = {f"{k}{unit}": [] for k in runs for unit in ("", "_cpu")}
    for _ in range(args.repeats):
        for ids in prompts:
            for name, run in runs.items():
                t0, c0 = time.perf_counter(), time.process_time()
                n = len(run(ids))
                times[name].append((time.perf_counter() - t0) / n)
                times[f"{name}_cpu"].append((time.process_time() - c0) / n)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def checkout(rev: str, folder: Path) -> Path:
    """`rev` as an importable `eyas` package under folder (the source tree maps its four folders into eyas.*)."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(folder / "src"), rev], check=True,
                   capture_output=True)
    pkg = folder / "pkg" / "eyas"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name in ("models", "data", "train", "inference"):
        (pkg / name).symlink_to(folder / "src" / name)
    return folder / "pkg"


def compare(args: argparse.Namespace) -> None:
    own = [sys.executable, __file__, "--json", *sys.argv[1:]]
    own = [a for a in own if a not in ("--compare-with", args.compare_with)]
    with tempfile.TemporaryDirectory() as tmp:
        path = checkout(args.compare_with, Path(tmp))
        try:
            runs: dict[str, list[dict]] = {"new": [], "old": []}
            for _ in range(args.rounds):
                for name, env in (("new", {}), ("old", {"PYTHONPATH": str(path)})):
                    out = subprocess.run(own, env={**os.environ, **env}, check=True, capture_output=True, text=True)
                    runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                    print(name, runs[name][-1], flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(Path(tmp) / "src")])
    for key in runs["new"][0]:
        new, old = (statistics.median(r[key] for r in runs[n]) for n in ("new", "old"))
        print(f"{key}: {new:.1f} ms per token now, {old:.1f} ms at {args.compare_with}: {new / old:.3f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=96, help="new tokens per generation")
    p.add_argument("--total-tokens", type=int, default=4, help="draft nodes verified per speculative cycle")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compare-with", default=None, metavar="REV", help="also run git revision REV, alternated")
    p.add_argument("--rounds", type=int, default=3, help="with --compare-with: processes per side")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.compare_with:
        compare(args)
        return
    result = measure(args)
    print(json.dumps(result) if args.json else "  ".join(f"{k} {v:.1f} ms/token" for k, v in result.items()))


if __name__ == "__main__":
    main()
