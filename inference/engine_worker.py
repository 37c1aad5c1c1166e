"""The protocol of eyas's engine workers (vllm_worker.py, sglang_worker.py). Standalone: it runs under a serving
engine's own interpreter and never imports eyas.

A worker starts its engine once and keeps it warm: `eyas bench` alternates every runtime per question, so an
engine answers a prompt, then waits idle (blocked on its input) while the others run. The parent
(runtimes_vllm.EngineWorker) writes JSON lines to the worker's stdin: first the job (model, head, sampling,
threads), then one request per prompt. The worker answers each line with one JSON line: {"ready": info} once the
engine has started, then one row per request, or {"error": "..."} when the job or a request failed. The end of
its input ends the worker. Engines and the libraries they load print freely, so the protocol gets a stream of
its own (a copy of the original stdout) and everything else printed goes to stderr, the parent's log.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, Callable

# start(job) -> (answer, info): the engine started for the job, a function answering one request with its row,
# and what the parent reports about the engine (its version, how long it took to start)
Start = Callable[[dict], tuple[Callable[[dict], dict], dict]]


def serve(start: Start) -> None:
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def send(message: dict[str, Any]) -> None:
        try:
            protocol.write(json.dumps(message) + "\n")
            protocol.flush()
        except BrokenPipeError:  # the parent is gone
            end(1)

    def failed(e: Exception) -> None:
        traceback.print_exc()
        send({"error": f"{type(e).__name__}: {e}"})

    try:
        answer, info = start(json.loads(sys.stdin.readline()))
    except Exception as e:
        failed(e)
        end(1)
    send({"ready": info})
    for line in sys.stdin:
        try:
            send(answer(json.loads(line)))
        except Exception as e:  # the engine stays up: the parent decides whether the run goes on
            failed(e)
    end(0)


def end(status: int) -> None:
    """Exit at once: an engine's own threads can hold up an orderly interpreter exit for good (vLLM's in-process
    engine does, busy), and a worker keeps nothing that needs saving."""
    sys.stderr.flush()
    os._exit(status)
