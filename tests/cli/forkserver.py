"""Runs `eyas` commands as child processes of one warm interpreter (torch, transformers, datasets imported once).

Each command is its own process, forked from this server and running the real entry point
(`eyas.inference.cli.main`) with its own argv, working folder, environment and stdio files, so exit status,
stderr and signals are exactly a separate `eyas` process's; only the ~10 s of imports are shared. The test
process (tests/cli/harness.py) talks to it over stdin/stdout, one JSON request per line:

    {"op": "run", "argv": [...], "cwd": DIR, "env": {...}, "stdout": FILE, "stderr": FILE}  -> {"pid": PID}
    {"op": "wait", "pid": PID}                                                             -> {"status": N}

`status` is the exit code, or -SIGNAL for a child killed by a signal.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import eyas.inference.cli

# what the commands import when they run (~10 s together on a busy 2-core machine), imported once for all children
for _module in ("torch", "transformers", "datasets", "safetensors.torch", "accelerate",
                "transformers.models.llama.modeling_llama", "eyas.models.target", "eyas.models.layouts",
                "eyas.train.trainer", "eyas.data.regen_store", "eyas.data.hidden_cache", "eyas.data.examples",
                "eyas.data.vocab", "eyas.inference.generator", "eyas.inference.bench"):
    importlib.import_module(_module)


def _child(req: dict) -> None:
    os.chdir(req["cwd"])
    os.environ.update(req.get("env", {}))
    for fd, name in ((0, os.devnull), (1, req["stdout"]), (2, req["stderr"])):
        f = os.open(name, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin, sys.stdout, sys.stderr = (open(0, closefd=False), open(1, "w", closefd=False),
                                         open(2, "w", closefd=False))
    sys.argv = ["eyas", *req["argv"]]
    code = 1
    try:
        code = eyas.inference.cli.main(req["argv"])
    except SystemExit as e:  # what the interpreter does with an uncaught SystemExit / exception
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a real bug: print its traceback as the interpreter would
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(int(code or 0))


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "run":
            pid = os.fork()
            if pid == 0:
                _child(req)
            reply = {"pid": pid}
        else:
            _, status = os.waitpid(req["pid"], 0)
            reply = {"status": os.waitstatus_to_exitcode(status)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
