"""Where regeneration's results go: a resumable JSONL of conversations and, optionally, the hidden-state cache.

Finished conversations are appended to a JSONL file ({"id", "messages"}), flushed and fsynced; a rerun
skips ids already written and drops a half-written last line. With cache_hidden, the states go straight
into an offline hidden-state cache (hidden_cache.py), which is then the source of truth: each shard holds
its conversations' JSONL lines, and the JSONL gets them only once the shard is written.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from eyas.data.chat_template import TemplateError, render_with_mask
from eyas.data.hidden_cache import CacheWriter, stored_shards
from eyas.data.regenerate import Job, RegenConfig, RegenStats, regenerate
from eyas.models.atomic import make_folder, writable_file
from eyas.models.config import default_fused_layer_ids
from eyas.models.errors import InputError
from eyas.models.signals import GracefulStop
from eyas.models.target import Target

logger = logging.getLogger(__name__)


def written_ids(path: Path) -> set[int]:
    """Ids already in the output. A half-written last line (a kill mid-write) is cut off; any other line that is
    not a conversation eyas wrote is refused naming its line, so no valid row after it is ever dropped."""
    if not path.is_file():
        return set()
    ids, good = set(), 0
    with open(path, "rb") as f:
        lines = f.readlines()
    for lineno, line in enumerate(lines, 1):
        if not line.endswith(b"\n") and lineno == len(lines):
            break  # the one line a kill can leave half-written
        try:
            ids.add(int(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{path}:{lineno}: not a conversation line eyas wrote ({type(e).__name__}); fix or "
                             "remove that line (or choose another --out), then rerun to continue") from None
        good += len(line)
    if good < path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good)
    return ids


def training_example(job: Job, tokenizer, eos_ids: Sequence[int] | None) -> tuple[list[int], list[int], bool]:
    """(input_ids, loss_mask, rendered) of a finished job: exactly the tokens its states were captured for.

    The mask comes from rendering the regenerated conversation with the chat template (every
    assistant turn, as `eyas data prepare` masks it) when that rendering starts with exactly these
    ids; otherwise (rendered False: decoding and re-tokenizing changed a token) only the final
    generated answer is masked.
    """
    ids = job.prompt + job.generated
    try:
        r = render_with_mask(tokenizer, job.out, eos_ids=eos_ids)
        if r.input_ids[: len(ids)] == ids:
            return ids, r.loss_mask[: len(ids)], True
    except TemplateError:
        pass
    return ids, [0] * len(job.prompt) + [1] * len(job.generated), False


# Generates (id, messages) conversations, calling on_done(job) for each finished one and checking stop between
# steps: `regenerate` over a Target, or a serving engine (regen_server.ServerEngine).
Engine = Callable[[list[tuple[int, list[dict]]], Callable[[Job], None], GracefulStop], RegenStats]


def regenerate_jsonl(target: Target | None, conversations, out: str | Path, cfg: RegenConfig, batch_size: int = 8,
                     layer_ids: Sequence[int] | None = None, on_done: Callable[[Job], None] = lambda job: None,
                     eos_ids: Sequence[int] | None = None, progress: bool = True,
                     cache_hidden: str | Path | None = None, cache_dtype: str = "bf16", shard_examples: int = 128,
                     engine: Engine | None = None, part: tuple[int, int] | None = None,
                     keep_in_flight: bool = False) -> RegenStats:
    """Regenerate a canonical conversations dataset (see sources.py) into `out` (JSONL), resumably.

    Row ids are the dataset's row indices, so rerunning on the same source continues where a
    killed run stopped. Rows flagged as bad by the source are not regenerated.

    cache_hidden: also store the captured target states as an offline hidden-state cache in this
    folder (the format HiddenStateDataset and `data.hidden_states: offline` read), so no second
    target pass is needed. layer_ids then are the cached EAGLE-3 layers (None: the head's default
    fused layers; () for EAGLE-1). The cache is the source of truth: every `shard_examples`
    finished conversations are written as one shard (atomically, with their JSONL lines in its
    header), listed in index.json, and only then appended to the JSONL. A resumed run first
    appends the lines of stored shards the JSONL lacks; conversations finished after the last
    shard are regenerated.

    The first SIGINT/SIGTERM stops the run at the next step: in-flight conversations are dropped,
    the finished ones written (a last, smaller shard), the cache marked readable, and the returned
    stats say stopped_by; rerunning continues with the missing ids. A second signal aborts at once
    (exit status 130 / 143; what is on disk stays consistent). The previous handlers are restored.
    keep_in_flight: the first signal keeps the in-flight conversations too, each answer cut where it stands
    (regenerate's keep_in_flight; a serving engine's requests in flight are dropped all the same).

    engine: generate with it instead of `target` (None then); it captures no states, so no cache_hidden.

    part (k, n): this process regenerates only the ids i with i % n == k, into its own part beside `out` (and
    `cache_hidden`), resumable as a whole run is; once every part is finished, the one that finishes last merges
    them all into `out` and `cache_hidden` (see merge_parts). n processes (GPUs, machines sharing the disk) with
    k = 0..n-1 thus regenerate the source once between them.
    """
    out, skip, residue, modulus = Path(out), frozenset(), 0, 1
    final, final_cache = out, cache_hidden
    if part is not None:
        residue, modulus = part
        if not 0 <= residue < modulus:
            raise InputError(f"part {residue}/{modulus}: the part must be in 0..{modulus - 1}")
        parts = parts_folder(out)
        make_folder(parts)
        skip = frozenset(written_ids(out))  # merged already (by an earlier split or whole run)
        out = parts / f"{residue}-of-{modulus}.jsonl"
        cache_hidden = None if cache_hidden is None else parts / f"{residue}-of-{modulus}.hidden"
    stats = _regenerate(target, conversations, out, cfg, batch_size, layer_ids, on_done, eos_ids, progress,
                        cache_hidden, cache_dtype, shard_examples, engine, residue, modulus, skip, keep_in_flight)
    if part is not None and stats.stopped_by is None:
        (parts / f"{residue}-of-{modulus}.done").touch()
        if merge_parts(final, final_cache, modulus):
            stats.stored = len(written_ids(final))
    return stats


def _regenerate(target, conversations, out: Path, cfg: RegenConfig, batch_size, layer_ids, on_done, eos_ids,
                progress, cache_hidden, cache_dtype, shard_examples, engine, residue: int, modulus: int,
                skip: frozenset[int], keep_in_flight: bool) -> RegenStats:
    """regenerate_jsonl's work for the ids i % modulus == residue that are not in `skip`."""
    if engine is not None and cache_hidden is not None:
        raise InputError("a serving engine returns text, not target states: regenerate without --cache-hidden, "
                         "then run `eyas data cache-hidden` (or train with online hidden states)")
    out = writable_file(out)
    done = written_ids(out)
    writer = None
    if cache_hidden is not None:
        if layer_ids is None:
            layer_ids = default_fused_layer_ids(target.num_layers)
        writer = CacheWriter(cache_hidden, target, layer_ids, cache_dtype, {"data": "regenerate",
                                                                            "generation": asdict(cfg)})
        cached: set[int] = set()
        with open(out, "a", encoding="utf-8") as f:
            for ids, meta in stored_shards(writer.folder):
                cached.update(ids)
                lines = [line for line in json.loads(meta["lines"]) if json.loads(line)["id"] not in done]
                f.writelines(line + "\n" for line in lines)  # killed after a shard, before its JSONL lines
                done.update(json.loads(line)["id"] for line in lines)
            f.flush()
            os.fsync(f.fileno())
        if done - cached:
            raise InputError(f"{out} holds {len(done - cached)} conversations that are not in the hidden-state cache "
                             f"{writer.folder} (written without --cache-hidden?): use another output file, or "
                             "regenerate without --cache-hidden and run `eyas data cache-hidden` afterwards")
    todo = [(i, r["messages"]) for i, r in enumerate(conversations) if not r["problem"] and i not in done
            and i % modulus == residue and i not in skip]
    if done:
        logger.info("%s: %d conversations already written, %d to go", out, len(done), len(todo))
    buffer: list[tuple[str, Job, tuple[list[int], list[int], bool]]] = []
    fallbacks = 0

    with open(out, "a", encoding="utf-8") as f:
        def append(lines: list[str]) -> None:
            done.update(json.loads(line)["id"] for line in lines)
            f.writelines(line + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())  # a kill after this loses nothing already reported done

        def flush_shard() -> None:
            buffer.sort(key=lambda x: x[1].id)
            lines = [line for line, _, _ in buffer]
            writer.write([e[0] for _, _, e in buffer], [e[1] for _, _, e in buffer],
                         [torch.cat([h.reshape(-1, h.shape[-1]) for h, _ in j.states]) for _, j, _ in buffer],
                         [None if not layer_ids else torch.cat([x.reshape(-1, x.shape[-1]) for _, x in j.states])
                          for _, j, _ in buffer],
                         ids=[j.id for _, j, _ in buffer], metadata={"lines": json.dumps(lines, ensure_ascii=False)})
            append(lines)
            buffer.clear()

        def write(job: Job) -> None:
            nonlocal fallbacks
            if job.out:
                line = json.dumps({"id": job.id, "messages": job.out}, ensure_ascii=False)
                if writer is None:
                    append([line])
                else:
                    example = training_example(job, target.tokenizer, eos_ids)
                    fallbacks += not example[2]
                    # Keep only the stored dtype: a shard's worth of fp32 states would be 2x the memory.
                    job.states = [(h.to(writer.dtype), None if x is None else x.to(writer.dtype))
                                  for h, x in job.states]
                    buffer.append((line, job, example))
                    if len(buffer) >= shard_examples:
                        flush_shard()
            on_done(job)

        action = ("keeping the answers in flight cut where they stand" if keep_in_flight and engine is None
                  else "dropping the answers in flight") + ", writing the finished conversations, then stopping"
        with GracefulStop(tqdm.write, action) as stop:
            if engine is not None:
                stats = engine(todo, write, stop)
            else:
                stats = regenerate(target, todo, cfg, batch_size, layer_ids, write, eos_ids, progress, stop=stop,
                                   keep_in_flight=keep_in_flight)
            if writer is not None:
                if buffer:
                    flush_shard()
                writer.finish()
    stats.mask_fallbacks, stats.stored = fallbacks, len(done)
    return stats


def parts_folder(out: Path) -> Path:
    """Where the parts of a split regeneration into `out` are written until they are merged."""
    return out.with_name(out.name + ".parts")


def merge_parts(out: str | Path, cache_hidden: str | Path | None, n: int) -> bool:
    """If all n parts of a split regeneration into `out` are finished, append them to `out` (and their caches to
    `cache_hidden`: the cache first, it is the source of truth) and remove them; True if merged here. Safe to run
    from several processes at once (one merges, under a lock) and to rerun after a kill (it adds only what `out`
    and the cache lack)."""
    from eyas.data.hidden_cache import append_cache

    out = Path(out)
    parts = parts_folder(out)
    names = [f"{k}-of-{n}" for k in range(n)]
    if not all((parts / f"{name}.done").is_file() for name in names):
        return False
    try:
        lock = open(parts / "merge.lock", "a")
    except FileNotFoundError:  # merged (and removed) by another process meanwhile
        return False
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # another process is merging
        if not all((parts / f"{name}.done").is_file() for name in names):
            return False
        if cache_hidden is not None:
            for name in names:
                append_cache(cache_hidden, parts / f"{name}.hidden")
        done = written_ids(out)
        with open(out, "a", encoding="utf-8") as f:
            for name in names:
                for line in (parts / f"{name}.jsonl").read_text(encoding="utf-8").splitlines():
                    if json.loads(line)["id"] not in done:
                        f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(parts)
    logger.info("merged %d parts into %s", n, out)
    return True
