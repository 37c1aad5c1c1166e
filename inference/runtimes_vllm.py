"""Serving engines as runtimes beside eyas: vLLM and SGLang on the same questions, with the same head (exported to
the layout each engine loads) or plain, one row per prompt of tokens, time, and the engine's own spec-decode
counters.

An engine lives in its own virtualenv (it pins its own torch build; docs/runtimes.md says how to install each
for CPU), so eyas never imports it: an `EngineWorker` starts inference/vllm_worker.py (or sglang_worker.py)
with that environment's interpreter (`--vllm-python` or $EYAS_VLLM_PYTHON; $EYAS_SGLANG_PYTHON), which starts
the engine once and answers prompts one at a time over a pipe (engine_worker.py), so `eyas bench` can alternate
warm engines with eyas question by question. One engine per worker: plain and speculative decoding are two
workers, each idle while another runtime runs. A CPU vLLM engine compiles its graphs at start for minutes
(`enforce_eager` skips that and decodes slower).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from eyas.models.errors import EyasError, InputError, MissingInput

HERE = Path(__file__).resolve().parent


class EngineError(EyasError):
    """An engine could not run (it failed to start, load the head, or generate)."""


@dataclass(frozen=True)
class Engine:
    """One serving engine: how eyas finds it, runs it, and hands it a head."""

    label: str
    python_env: str  # the environment variable naming its interpreter
    worker: Path  # the script its interpreter runs (engine_worker.py's protocol)
    layout: str  # the head layout it loads (models/layouts)
    missing: str  # one line: why it does not run when its interpreter is not set, and what to do


ENGINES = {
    "vllm": Engine("vLLM", "EYAS_VLLM_PYTHON", HERE / "vllm_worker.py", "speculators",
                   "EYAS_VLLM_PYTHON is not set (docs/runtimes.md installs vLLM for CPU in its own venv)"),
    "sglang": Engine("SGLang", "EYAS_SGLANG_PYTHON", HERE / "sglang_worker.py", "sglang",
                     "EYAS_SGLANG_PYTHON is not set: SGLang for CPU needs its kernels built from its repository "
                     "(PyPI's sglang and sglang-kernel are CUDA builds; docs/runtimes.md)"),
}


@dataclass(frozen=True)
class EngineSettings:
    """What a worker runs: sampling as eyas bench states it, and the engine's own knobs."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()
    num_speculative_tokens: int = 5  # the engine drafts a chain of this many tokens per step
    dtype: str = "float32"
    threads: int | None = None  # OpenMP threads, bound to cores 0..threads-1 (vLLM's CPU backend binds its own)
    max_model_len: int = 4096
    enforce_eager: bool = False  # no torch.compile: the engine starts in seconds instead of minutes, decodes slower
    kv_cache_gib: int = 2  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)
    timeout_s: float = 3600.0  # for the engine's start, and for each prompt


@dataclass
class EngineRow:
    """One prompt through an engine."""

    tokens: list[int]
    time_s: float
    prompt_token_ids: list[int] = field(default_factory=list)  # what the engine decoded from (its rendering)
    drafts: int = 0  # verify steps that carried drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0  # accepted draft tokens, bonus tokens not counted
    accepted_per_position: list[int] = field(default_factory=list)  # steps that accepted position k (k = 0, 1, ..)
    proposals: list[list[int]] | None = None  # every proposal's draft ids, in order (vLLM with a head)

    @property
    def accepted(self) -> list[int]:
        """Tokens gained per drafting step (accepted drafts + the bonus), eyas bench's convention: step counts
        by accepted length follow from the per-position counts (accepting position k implies all before it).
        In no particular order: `steps` has the order where proposals were recorded."""
        counts = [self.drafts, *self.accepted_per_position, 0]
        return [j + 1 for j in range(len(counts) - 1) for _ in range(counts[j] - counts[j + 1])]

    @property
    def tau(self) -> float:
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def counters(self) -> dict[str, Any]:
        """The engine's own counters; every step it decodes verifies a draft, so its steps are its drafts."""
        return {"steps": self.drafts, "drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "accepted_per_position": list(self.accepted_per_position)}

    @property
    def steps(self) -> list[int] | None:
        """Tokens gained per step in order, from the proposals (None without them): see `steps_from_proposals`."""
        return None if self.proposals is None else [len(s.accepted) + 1 for s in
                                                    steps_from_proposals(self.tokens, self.proposals)]


@dataclass(frozen=True)
class Step:
    """One drafting step of an engine, rebuilt from its output and its proposals."""

    done: int  # output tokens decided before it: it drafted after prompt + output[:done]
    proposal: list[int]
    accepted: list[int]  # the proposal's prefix the output kept


def steps_from_proposals(tokens: Sequence[int], proposals: Sequence[Sequence[int]]) -> list[Step]:
    """The steps behind an output. The prefill decides the first token, so step 0 drafts after output[:1]; a
    step keeps the drafts that match the output and gains one token more (the target's own). Proposals made
    after the last token was decided were never verified and are left out."""
    steps, done = [], 1
    for proposal in proposals:
        if done >= len(tokens):
            break
        n = next((j for j in range(len(proposal)) if done + j >= len(tokens) or proposal[j] != tokens[done + j]),
                 len(proposal))
        steps.append(Step(done, list(proposal), list(proposal[:n])))
        done += n + 1
    return steps


def engine_python(engine: str, python: str | None = None) -> str | None:
    """The interpreter `engine` is installed in: `python`, else its environment variable, else None."""
    env = ENGINES[engine].python_env
    python = python or os.environ.get(env)
    if python and not Path(python).is_file():
        raise MissingInput(f"{ENGINES[engine].label} interpreter {python} does not exist (set {env} to the python "
                           f"of the environment {ENGINES[engine].label} is installed in)")
    return python or None  # an empty variable is unset


def vllm_model(spec: str) -> str:
    """A target spec as an engine loads it: a model folder or hub id (an eyas alias becomes its converted folder)."""
    from eyas.models.loading import resolve_spec

    where, gguf_file, _ = resolve_spec(spec)
    if gguf_file:
        raise InputError(f"target {spec!r} is a GGUF file; give the engine a transformers folder or hub id")
    return str(Path(where).resolve()) if Path(where).exists() else str(where)


def max_model_len(target, cap: int = 4096) -> int:
    """The longest context to give an engine for `target`: `cap`, or less where the model's config says so (vLLM
    refuses a longer max_model_len than its max_position_embeddings)."""
    longest = getattr(target.model.config.get_text_config(), "max_position_embeddings", None)
    return min(cap, longest or cap)


def export_for(engine: str, head_folder: str | os.PathLike, out: str | os.PathLike, target=None) -> Path:
    """The head (any layout, or a training checkpoint) in the layout `engine` loads; refuses, naming why, a head
    the engine would not compute as trained (models/layouts)."""
    from eyas.models.layouts import export_head

    return export_head(head_folder, out, ENGINES[engine].layout, target)


class EngineWorker:
    """One engine, started once in its own interpreter, answering requests one at a time (engine_worker.py).

    A request is {"ids": prompt token ids} or {"messages": a chat the engine renders}, with max_new_tokens and
    seed. The worker runs in a session of its own, so a Ctrl-C meant for eyas (which finishes the question in
    hand) does not stop it; it ends when its input closes (`close`, or eyas exiting by any means)."""

    def __init__(self, python: str, engine: str, model: str, settings: EngineSettings,
                 head: str | os.PathLike | None, log: Path) -> None:
        spec = ENGINES[engine]
        self.what = f"{spec.label} ({python}) running {model}" + (f" with head {head}" if head else "")
        self.timeout_s, self.log = settings.timeout_s, log
        job = {**asdict(settings), "eos_token_ids": list(settings.eos_token_ids), "model": model,
               "head": None if head is None else str(head)}
        self._log = open(log, "w")
        self._proc = subprocess.Popen([python, str(spec.worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, text=True, cwd=log.parent, start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            ready = self._ask(job, "starting")
        except BaseException:
            self.close()
            raise
        self.version, self.engine_start_s = ready["ready"]["version"], ready["ready"]["engine_start_s"]

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _ask(self, message: dict, doing: str) -> dict:
        try:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
            line = self._lines.get(timeout=self.timeout_s)
        except BrokenPipeError:
            line = None
        except queue.Empty:
            self.close()
            raise EngineError(f"{self.what} timed out after {self.timeout_s:.0f} s {doing}; its last output:\n"
                              f"{self.tail()}") from None
        if line is None:
            self.close()
            raise EngineError(f"{self.what} exited with {self._proc.returncode} {doing}; its last output:\n"
                              f"{self.tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise EngineError(f"{self.what} failed {doing}: {reply['error']}; its last output:\n{self.tail()}")
        return reply

    def generate(self, request: dict) -> EngineRow:
        return EngineRow(**self._ask(request, "generating"))

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        """End the worker: its input closes and it exits (killed if it has not within a minute)."""
        if self._proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> "EngineWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class EngineRun:
    rows: list[EngineRow]
    engine_start_s: float
    version: str


def run_engine(python: str, model: str, prompts: Sequence[Sequence[int] | Sequence[dict]], settings: EngineSettings,
               max_new_tokens: int, head: str | os.PathLike | None = None, engine: str = "vllm") -> EngineRun:
    """Each prompt (token ids, or chat messages the engine renders) through one engine, speculative with `head`
    (a folder in the engine's layout) or plain; prompt i is seeded with settings.seed + i, after one short
    warm-up."""
    with tempfile.TemporaryDirectory(prefix=f"eyas-{engine}-") as tmp, \
            EngineWorker(python, engine, model, settings, head, Path(tmp) / "engine.log") as worker:
        def request(prompt, n: int, seed: int) -> dict:
            chat = len(prompt) > 0 and isinstance(prompt[0], dict)
            return {("messages" if chat else "ids"): list(prompt), "max_new_tokens": n, "seed": seed}

        if prompts:
            worker.generate(request(prompts[0], 8, settings.seed))  # first-call costs stay out of the rows
        rows = [worker.generate(request(p, max_new_tokens, settings.seed + i)) for i, p in enumerate(prompts)]
        return EngineRun(rows, worker.engine_start_s, worker.version)


# a bench runtime: (prompt ids, new tokens at most, seed) -> (its result, seconds)
Runtime = Callable[[list[int], int, int], tuple[Any, float]]


@dataclass(frozen=True)
class EngineOptions:
    """`eyas bench --vllm` / `--sglang`: which engines run (name -> interpreter), how they draft, whether their
    plain decoding runs too, and which engines were asked for but cannot run here (name -> why, one line)."""

    pythons: dict[str, str]
    draft_tokens: int = 5  # the engines' num_speculative_tokens: a chain this long per step
    eager: bool = False
    plain: bool = True
    max_model_len: int = 4096
    not_run: dict[str, str] = field(default_factory=dict)

    def start(self, stack: contextlib.ExitStack, target, head, sampling: dict, eos: Sequence[int], dtype: str
              ) -> tuple[dict[str, Runtime], dict[str, Any]]:
        """Start every engine's workers, closed with `stack`: ({runtime name: Runtime}, the run's description).

        The head (a folder in any layout, or a DraftHead) is exported for each engine into a folder that lives
        as long as `stack`. Runtime names: `vllm` (with the head) and `vllm_plain`, likewise `sglang`; results are
        EngineRows. `sampling` holds temperature, top_p, top_k and seed (the bench seeds question i with
        seed + i on every side)."""
        import torch

        from eyas.models import DraftHead, save_head

        settings = EngineSettings(**sampling, eos_token_ids=tuple(eos), num_speculative_tokens=self.draft_tokens,
                                  dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype),
                                  threads=torch.get_num_threads(),
                                  max_model_len=max_model_len(target, self.max_model_len), enforce_eager=self.eager)
        model = vllm_model(target.name_or_path)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="eyas-engines-")))
        if isinstance(head, DraftHead):
            save_head(head, tmp / "eyas")
            head = tmp / "eyas"
        runtimes: dict[str, Runtime] = {}
        info: dict[str, Any] = {"draft_tokens": self.draft_tokens, "eager": self.eager, "not_run": dict(self.not_run)}
        for engine, python in self.pythons.items():
            exported = export_for(engine, head, tmp / engine, target)
            starts, workers = {}, [(f"{engine}_plain", None)] if self.plain else []
            for name, with_head in [*workers, (engine, exported)]:
                worker = stack.enter_context(EngineWorker(python, engine, model, settings, with_head,
                                                          tmp / f"{name}.log"))
                runtimes[name] = _runtime(worker)
                starts[name] = worker.engine_start_s
            info[engine] = {"version": worker.version, "python": python, "engine_start_s": starts}
        return runtimes, info


def _runtime(worker: EngineWorker) -> Runtime:
    def run(ids: list[int], n: int, seed: int) -> tuple[EngineRow, float]:
        row = worker.generate({"ids": ids, "max_new_tokens": n, "seed": seed})
        return row, row.time_s

    return run
