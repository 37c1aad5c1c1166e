"""Driving `eyas` as a user would: commands in their own processes (tests/cli/forkserver.py), and snapshots of
the user's files to check that a failed command left everything as it was."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEBRIS = (".eyas-tmp-", ".eyas-old-")


@dataclass
class Result:
    status: int  # exit code, or -SIGNAL
    stdout: str
    stderr: str


class EyasProcesses:
    """A warm interpreter that forks one child per `eyas` command."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.count = logs, 0
        logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli.forkserver"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the eyas fork server died")
        return json.loads(line)

    def start(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[int, Path, Path]:
        """Start `eyas ARGV` in `cwd`; returns (pid, stdout file, stderr file)."""
        self.count += 1
        out, err = self.logs / f"{self.count}.out", self.logs / f"{self.count}.err"
        pid = self._ask(op="run", argv=[str(a) for a in argv], cwd=str(cwd), env=env or {}, stdout=str(out),
                        stderr=str(err))["pid"]
        return pid, out, err

    def wait(self, pid: int) -> int:
        return self._ask(op="wait", pid=pid)["status"]

    def run(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> Result:
        pid, out, err = self.start(argv, cwd, env)
        status = self.wait(pid)
        return Result(status, out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (relative path -> content digest) and every folder (-> "dir")."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink() or path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "link"
        elif path.is_dir():
            found[rel] = "dir"
    return found


def debris(root: Path) -> list[str]:
    """Temporaries an interrupted or failed write left behind."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if any(m in p.name for m in DEBRIS) or (p.name.startswith(".step-") and p.name.endswith(".tmp")))
