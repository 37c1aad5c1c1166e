"""Benchmark: the path to a trainable dataset through eyas's own regeneration vs a vLLM server.

    python benchmarks/bench_regen_engines.py --vllm-python /work/vllm-venv/bin/python
    python benchmarks/bench_regen_engines.py --vllm-python PY --limit 48 --max-new-tokens 128 --rounds 2

Same prompts (the first --limit conversations of --source, first --max-turns turns), same caps, greedy:
- eyas: `eyas data regenerate --cache-hidden` (continuous batching over eyas's KV cache; the hidden states
  are captured while generating, so the dataset is trainable offline at once);
- vllm: `vllm serve` (started once, its start timed apart), then `eyas data regenerate --server` (the same
  command, answers from the server), then `eyas data prepare` + `eyas data cache-hidden` for the hidden
  states (an online-trained run skips those two and pays the target forward in training instead).
Each command runs in its own process; rounds alternate eyas / vllm so drift in machine speed hits both.
Printed per round: useful (generated) tokens, wall seconds and tokens/s of the generation alone and of the
whole path; CPU seconds (the commands' own, and the server's from /proc while it answers); and how many
regenerated conversations came out identical between the two engines. A JSON report goes to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

EYAS = [sys.executable, "-m", "eyas.inference.cli"]
STATS = re.compile(r"regenerated (\d+) conversations, (\d+) tokens in ([\d.]+) s")


def run(cmd: list[str], log: Path) -> tuple[float, float, str]:
    """(wall s, CPU s of the command and its children, stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}); see {log}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), p.stdout


def proc_cpu(pid: int) -> float:
    """CPU seconds of a process and all its live descendants (vLLM's engine core and worker), from /proc."""
    stats = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        stats[int(stat.parent.name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
    tree = {pid}
    for _ in range(8):  # a few generations deep is all vLLM spawns
        tree |= {p for p, (ppid, _) in stats.items() if ppid in tree}
    total = sum(stats[p][1] for p in tree if p in stats)
    return total / os.sysconf("SC_CLK_TCK")


def start_server(args: argparse.Namespace, folder: str, log: Path) -> tuple[subprocess.Popen, float]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
           "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--dtype", "float32",
           "--max-model-len", str(args.max_length + 8), "--host", "127.0.0.1", "--port", str(args.port),
           "--seed", "0", "--served-model-name", "target"] + (["--enforce-eager"] if args.enforce_eager else [])
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    while True:
        if server.poll() is not None:
            raise SystemExit(f"vllm serve exited with {server.returncode}; see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{args.port}/v1/models", timeout=5)
            return server, time.perf_counter() - t0
        except OSError:
            time.sleep(2)


def answers(path: Path) -> dict[int, list]:
    return {r["id"]: r["messages"] for r in map(json.loads, path.read_text().splitlines())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="python of the environment vLLM is installed in")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--source", default="sharegpt")
    p.add_argument("--limit", type=int, default=48)
    p.add_argument("--max-turns", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-length", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=16, help="eyas's batch and the server's requests in flight")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--kv-cache-gib", type=int, default=4)
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile in vLLM (a quick smoke run)")
    p.add_argument("--out-dir", default="bench-regen-engines")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    from eyas.inference.runtimes_vllm import vllm_model

    caps = ["--target", args.target, "--source", args.source, "--limit", str(args.limit), "--max-turns",
            str(args.max_turns), "--max-new-tokens", str(args.max_new_tokens), "--max-length", str(args.max_length),
            "--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    server, start_s = start_server(args, vllm_model(args.target), out / "vllm-serve.log")
    print(f"vllm serve ready after {start_s:.0f} s (engine start, torch.compile included)", flush=True)
    rounds = []
    try:
        for r in range(args.rounds):
            row: dict = {}
            for engine in (["eyas", "vllm"] if r % 2 == 0 else ["vllm", "eyas"]):
                jsonl = out / f"{engine}-{r}.jsonl"
                for stale in out.glob(f"{engine}-{r}*"):  # a fresh run, not a resumed one
                    shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
                if engine == "eyas":
                    wall, cpu, text = run(EYAS + ["data", "regenerate", *caps, "--out", str(jsonl), "--cache-hidden",
                                                  str(out / f"eyas-{r}-hidden")], out / f"eyas-{r}.log")
                    rest_wall = rest_cpu = 0.0
                else:
                    server_cpu = proc_cpu(server.pid)
                    wall, cpu, text = run(EYAS + ["data", "regenerate", *caps, "--out", str(jsonl), "--server",
                                                  f"http://127.0.0.1:{args.port}/v1"], out / f"vllm-{r}.log")
                    cpu += proc_cpu(server.pid) - server_cpu
                    ex = out / f"vllm-{r}-examples"
                    w1, c1, _ = run(EYAS + ["data", "prepare", "--target", args.target, "--source", str(jsonl),
                                            "--out", str(ex), "--max-length", str(args.max_length), "--held-out", "1"],
                                    out / f"vllm-{r}-prepare.log")
                    w2, c2, _ = run(EYAS + ["data", "cache-hidden", "--target", args.target, "--examples", str(ex),
                                            "--out", str(out / f"vllm-{r}-hidden")], out / f"vllm-{r}-cache.log")
                    rest_wall, rest_cpu = w1 + w2, c1 + c2
                m = STATS.search(text)
                convs, tokens, gen_s = int(m[1]), int(m[2]), float(m[3])
                row[engine] = {"conversations": convs, "useful_tokens": tokens, "generation_s": gen_s,
                               "command_wall_s": wall, "command_cpu_s": cpu, "rest_wall_s": rest_wall,
                               "rest_cpu_s": rest_cpu, "generation_tokens_per_s": tokens / gen_s,
                               "path_tokens_per_s": tokens / (wall + rest_wall)}
                print(f"round {r} {engine}: {tokens} tokens, generation {gen_s:.1f} s ({tokens / gen_s:.1f} tok/s), "
                      f"whole path {wall + rest_wall:.1f} s ({tokens / (wall + rest_wall):.1f} tok/s), "
                      f"CPU {cpu + rest_cpu:.0f} s", flush=True)
            a, b = answers(out / f"eyas-{r}.jsonl"), answers(out / f"vllm-{r}.jsonl")
            row["identical_conversations"] = sum(a[i] == b.get(i) for i in a)
            row["conversations_compared"] = len(a)
            rounds.append(row)
    finally:
        server.terminate()
        server.wait(timeout=60)
    report = {"settings": vars(args), "vllm_serve_start_s": start_s, "rounds": rounds}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    for engine in ("eyas", "vllm"):
        gen = sum(r[engine]["useful_tokens"] for r in rounds) / sum(r[engine]["generation_s"] for r in rounds)
        path = sum(r[engine]["useful_tokens"] for r in rounds) / sum(
            r[engine]["command_wall_s"] + r[engine]["rest_wall_s"] for r in rounds)
        print(f"{engine}: generation {gen:.1f} useful tok/s, whole path to a trainable dataset {path:.1f} tok/s")
    same = sum(r["identical_conversations"] for r in rounds)
    print(f"identical regenerated conversations: {same} of {sum(r['conversations_compared'] for r in rounds)}; "
          f"vllm serve start {start_s:.0f} s (not in the path numbers); report: {out / 'report.json'}")


if __name__ == "__main__":
    main()
