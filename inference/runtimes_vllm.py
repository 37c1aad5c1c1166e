"""vLLM as a runtime beside eyas: the same questions, the same head (exported to the speculators layout vLLM
loads), per-question rows of tokens, time, drafts and acceptance per position.

vLLM lives in its own virtualenv (it pins its own torch build; docs/runtimes.md says how to install it for
CPU), so eyas never imports it: `run_vllm` writes a job file, starts inference/vllm_worker.py with that
environment's interpreter (`--vllm-python`, or $EYAS_VLLM_PYTHON) and reads the rows back. One engine per
call: a CPU engine compiles its graphs at start for minutes (`enforce_eager` skips that and decodes slower).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from eyas.models.errors import EyasError, InputError, MissingInput

VLLM_PYTHON_ENV = "EYAS_VLLM_PYTHON"
WORKER = Path(__file__).resolve().with_name("vllm_worker.py")


class VllmError(EyasError):
    """vLLM could not run the job (it failed to start, load the head, or generate)."""


@dataclass(frozen=True)
class VllmSettings:
    """What the worker runs: sampling as eyas bench states it, and the engine's own knobs."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()
    num_speculative_tokens: int = 5  # vLLM drafts a chain of this many tokens per step
    dtype: str = "float32"
    threads: int | None = None  # OpenMP threads, bound to cores 0..threads-1 (vLLM's CPU backend binds its own)
    max_model_len: int = 4096
    enforce_eager: bool = False  # no torch.compile: the engine starts in seconds instead of minutes, decodes slower
    kv_cache_gib: int = 2  # the CPU KV cache (VLLM_CPU_KVCACHE_SPACE)
    record_drafts: bool = False  # keep every proposal's draft ids (tests compare them with eyas's)
    timeout_s: float = 3600.0


@dataclass
class VllmRow:
    """One question through vLLM."""

    tokens: list[int]
    time_s: float
    drafts: int = 0  # verify steps that carried drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0  # accepted draft tokens, bonus tokens not counted
    accepted_per_position: list[int] = field(default_factory=list)  # steps that accepted position k (k = 0, 1, ..)
    proposals: list[list[int]] | None = None

    @property
    def accepted(self) -> list[int]:
        """Tokens gained per drafting step (accepted drafts + the bonus), eyas bench's convention: step counts
        by accepted length follow from the per-position counts (accepting position k implies all before it)."""
        counts = [self.drafts, *self.accepted_per_position, 0]
        return [j + 1 for j in range(len(counts) - 1) for _ in range(counts[j] - counts[j + 1])]

    @property
    def tau(self) -> float:
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 1.0


@dataclass
class VllmRun:
    rows: list[VllmRow]
    engine_start_s: float
    version: str


def vllm_python(python: str | None = None) -> str | None:
    """The interpreter vLLM is installed in: `python`, else $EYAS_VLLM_PYTHON, else None."""
    python = python or os.environ.get(VLLM_PYTHON_ENV)
    if python and not Path(python).is_file():
        raise MissingInput(f"vLLM interpreter {python} does not exist (set {VLLM_PYTHON_ENV} or --vllm-python to the "
                           "python of the environment vLLM is installed in)")
    return python or None  # an empty EYAS_VLLM_PYTHON is unset


def vllm_model(spec: str) -> str:
    """A target spec as vLLM loads it: a model folder or hub id (an eyas alias becomes its converted folder)."""
    from eyas.models.loading import resolve_spec

    where, gguf_file, _ = resolve_spec(spec)
    if gguf_file:
        raise InputError(f"target {spec!r} is a GGUF file; give vLLM a transformers folder or hub id")
    return str(Path(where).resolve()) if Path(where).exists() else str(where)


def export_for_vllm(head_folder: str | os.PathLike, out: str | os.PathLike, target=None) -> Path:
    """The head (any layout, or a training checkpoint) in the speculators layout vLLM loads; refuses, naming why,
    a head vLLM would not compute as trained (models/layouts)."""
    from eyas.models.layouts import export_head

    return export_head(head_folder, out, "speculators", target)


def run_vllm(python: str, model: str, prompts: Sequence[Sequence[int]], settings: VllmSettings,
             head: str | os.PathLike | None = None) -> VllmRun:
    """Each prompt (token ids) through one vLLM engine, speculative with `head` (a speculators folder) or plain."""
    with tempfile.TemporaryDirectory(prefix="eyas-vllm-") as tmp:
        job, out, log = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "vllm.log"
        spec = asdict(settings)
        timeout = spec.pop("timeout_s")
        spec["eos_token_ids"] = list(settings.eos_token_ids)
        job.write_text(json.dumps({**spec, "model": model, "head": None if head is None else str(head),
                                   "prompts": [list(map(int, p)) for p in prompts]}))
        with open(log, "w") as f:
            try:
                rc = subprocess.run([python, str(WORKER), str(job), str(out)], stdout=f, stderr=subprocess.STDOUT,
                                    timeout=timeout, cwd=tmp).returncode
            except subprocess.TimeoutExpired:
                rc = None
        if rc != 0 or not out.is_file():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
            why = f"timed out after {timeout:.0f} s" if rc is None else f"exited with {rc}"
            raise VllmError(f"vLLM ({python}) {why} running {model}{f' with head {head}' if head else ''}; "
                            f"its last output:\n{tail}")
        result = json.loads(out.read_text())
    return VllmRun([VllmRow(**r) for r in result["rows"]], result["engine_start_s"], result["vllm_version"])


@dataclass(frozen=True)
class VllmOptions:
    """`eyas bench --vllm`: which vLLM, how it drafts, and whether its plain decoding runs too."""

    python: str
    draft_tokens: int = 5  # vLLM's num_speculative_tokens: a chain this long per step
    eager: bool = False
    plain: bool = True
    max_model_len: int = 4096

    def bench(self, target, head, prompts: Sequence[Sequence[int]], sampling: dict, eos: Sequence[int], dtype: str,
              reference: Sequence[Sequence[int]] | None = None) -> tuple[list[dict], dict]:
        """`eyas bench`'s vLLM fields for each prompt, and the run's description.

        The head (a folder in any layout, or a DraftHead) is exported for vLLM and run speculatively and, with
        `plain`, plain decoding, each in one engine; `sampling` holds max_new_tokens, temperature, top_p, top_k
        and seed (question i gets seed + i, as eyas's side does). Fields: vllm_tokens, vllm_time_s,
        vllm_accepted (tokens gained per drafting step), vllm_draft_tokens, vllm_exact (output == `reference`,
        the baseline's tokens; None without one), and vllm_plain_tokens, vllm_plain_time_s, vllm_plain_exact."""
        import torch

        from eyas.models import DraftHead, save_head

        settings = VllmSettings(**sampling, eos_token_ids=tuple(eos), num_speculative_tokens=self.draft_tokens,
                                dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype),
                                threads=torch.get_num_threads(), max_model_len=self.max_model_len,
                                enforce_eager=self.eager)
        model = vllm_model(target.name_or_path)
        with tempfile.TemporaryDirectory(prefix="eyas-vllm-head-") as tmp:
            if isinstance(head, DraftHead):
                save_head(head, Path(tmp) / "eyas")
                head = Path(tmp) / "eyas"
            exported = export_for_vllm(head, Path(tmp) / "speculators", target)
            spec = run_vllm(self.python, model, prompts, settings, exported)
        base = run_vllm(self.python, model, prompts, settings) if self.plain else None

        def same(tokens: list[int], i: int) -> bool | None:
            return None if reference is None else tokens == list(reference[i])

        rows = []
        for i, s in enumerate(spec.rows):
            row = {"vllm_tokens": len(s.tokens), "vllm_time_s": s.time_s, "vllm_accepted": s.accepted,
                   "vllm_draft_tokens": self.draft_tokens, "vllm_exact": same(s.tokens, i)}
            if base is not None:
                b = base.rows[i]
                row.update(vllm_plain_tokens=len(b.tokens), vllm_plain_time_s=b.time_s,
                           vllm_plain_exact=same(b.tokens, i))
            rows.append(row)
        info = {"version": spec.version, "draft_tokens": self.draft_tokens, "eager": self.eager,
                "engine_start_s": spec.engine_start_s, "plain": base is not None, "python": self.python}
        return rows, info
