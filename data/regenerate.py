"""Self-distillation: rewrite every assistant turn with the target itself, wasting no batch slot.

Continuous batching. Each of `batch_size` slots holds one generation; the moment it ends (eos or
max_new_tokens) its slot is refilled with the next prompt, so no row decodes padding after its
answer is done. All slots share one KV cache [B, heads, L, d] whose rows are right-aligned: row
b's tokens occupy its last lens[b] columns, a 2D padding mask hides the columns to their left,
and explicit position ids give every row its own positions. A new prompt is prefilled on its own
and spliced into its row; columns no row needs any more are sliced off the left.

Hidden states come for free: every forward also returns the EAGLE features of the chosen layers
and the final normed hidden state, so the states of the finished example (prompt prefill +
every generated token, the last one fed once more when its row ends) need no second target pass.

Resumable: finished conversations are appended to a JSONL file ({"id", "messages"}), flushed
and fsynced; a rerun skips ids already written and drops a half-written last line.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from tqdm.auto import tqdm

from eyas.models.target import Target


@dataclass
class GenerationConfig:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    max_length: int = 2048  # prompt + answer; longer conversations stop at the last turn that fits
    max_turns: int | None = None  # regenerate at most this many assistant turns per conversation


@dataclass
class Job:
    """One conversation being regenerated, turn by turn."""

    id: int
    messages: list[dict]  # source messages; assistant turns are replaced as they are generated
    out: list[dict] = field(default_factory=list)  # regenerated conversation so far
    turn: int = 0  # index into messages of the next assistant turn to generate
    turns_done: int = 0
    prompt: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    states: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)  # (hidden, features)
    generator: torch.Generator | None = None


@dataclass
class RegenStats:
    conversations: int = 0
    useful_tokens: int = 0  # generated tokens kept in the output
    state_tokens: int = 0  # tokens whose target states were captured
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds if self.seconds else 0.0


class SlotBatch:
    """The shared right-aligned KV cache of the live slots and the per-row lengths."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.cache = target.new_cache()
        self.lens: list[int] = []  # tokens of each row held in the cache

    @property
    def width(self) -> int:
        return self.cache.get_seq_length()

    def _layers(self):
        return [l for l in self.cache.layers if getattr(l, "keys", None) is not None and l.keys.numel()]

    def add_row(self) -> int:
        for l in self._layers():
            l.keys = torch.cat([l.keys, l.keys.new_zeros(1, *l.keys.shape[1:])])
            l.values = torch.cat([l.values, l.values.new_zeros(1, *l.values.shape[1:])])
        self.lens.append(0)
        return len(self.lens) - 1

    def drop_rows(self, keep: list[int]) -> None:
        for l in self._layers():
            l.keys, l.values = l.keys[keep], l.values[keep]
        self.lens = [self.lens[i] for i in keep]

    def prefill(self, row: int, ids: list[int], layer_ids: Sequence[int]):
        """Run `ids` alone and splice its cache into `row`; returns the TargetOutput of the prompt."""
        own = self.target.new_cache()
        out = self.target(torch.tensor([ids], device=self.target.device), cache=own, layer_ids=layer_ids,
                          logits_to_keep=torch.tensor([[len(ids) - 1]], device=self.target.device))
        p, w = len(ids), self.width
        if not self._layers():  # first prompt: the batch cache takes its shape from this one
            for l, o in zip(self.cache.layers, own.layers):
                l.lazy_initialization(o.keys, o.values)
                b = len(self.lens)
                l.keys = o.keys.new_zeros(b, *o.keys.shape[1:])
                l.values = o.values.new_zeros(b, *o.values.shape[1:])
            w = p
        elif p > w:  # widen every row on the left
            for l in self._layers():
                pad = l.keys.new_zeros(l.keys.shape[0], l.keys.shape[1], p - w, l.keys.shape[3])
                l.keys, l.values = torch.cat([pad, l.keys], 2), torch.cat([pad.clone(), l.values], 2)
            w = p
        for l, o in zip(self._layers(), own.layers):
            l.keys[row, :, w - p:] = o.keys[0]
            l.values[row, :, w - p:] = o.values[0]
        self.lens[row] = p
        return out

    def step(self, tokens: list[int], layer_ids: Sequence[int]):
        """Feed one token per row (each at its own next position); returns TargetOutput [B, 1, ...]."""
        w, dev = self.width, self.target.device
        lens = torch.tensor(self.lens, device=dev)
        cols = torch.arange(w + 1, device=dev)
        mask = (cols[None, :] >= w - lens[:, None])  # [B, w+1]: the row's own columns and the new one
        out = self.target(torch.tensor(tokens, device=dev)[:, None], position_ids=lens[:, None],
                          attention_mask=mask, cache=self.cache, layer_ids=layer_ids)
        self.lens = [n + 1 for n in self.lens]
        drop = self.width - max(self.lens)
        if drop > 0:  # columns to the left of every row are dead weight
            for l in self._layers():
                l.keys, l.values = l.keys[:, :, drop:], l.values[:, :, drop:]
        return out


def _pick(logits: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator | None) -> int:
    """logits [V] → next token (greedy, or temperature + top-p sampling)."""
    if cfg.temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / cfg.temperature, -1)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < cfg.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def _next_prompt(job: Job, tokenizer, cfg: GenerationConfig) -> list[int] | None:
    """Token ids for the job's next assistant turn, or None when the conversation is finished."""
    if cfg.max_turns is not None and job.turns_done >= cfg.max_turns:
        return None
    while job.turn < len(job.messages) and (job.messages[job.turn]["role"] != "assistant"
                                            or not any(m["role"] == "user" for m in job.out)):
        if job.messages[job.turn]["role"] != "assistant":  # an answer with no question before it is dropped
            job.out.append(job.messages[job.turn])
        job.turn += 1
    if job.turn >= len(job.messages):
        return None
    text = tokenizer.apply_chat_template(job.out, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids if len(ids) < cfg.max_length else None


def regenerate(
    target: Target,
    conversations: Iterable[tuple[int, list[dict]]],
    cfg: GenerationConfig,
    batch_size: int = 8,
    layer_ids: Sequence[int] | None = None,
    on_done: Callable[[Job], None] = lambda job: None,
    eos_ids: Sequence[int] | None = None,
    progress: bool = True,
) -> RegenStats:
    """Regenerate the assistant turns of (id, messages) conversations; `on_done(job)` gets each.

    layer_ids: capture target states while generating (None: capture nothing). job.states then
    holds the final turn's (hidden [T, H], features [T, F]) chunks for job.prompt + job.generated.
    A conversation ends early (keeping the turns done) when a prompt would not fit max_length
    or an answer hits max_new_tokens without eos, since a cut answer cannot be continued.
    """
    tok = target.tokenizer
    eos = set(eos_ids if eos_ids is not None else [tok.eos_token_id])
    capture = layer_ids is not None
    lids = tuple(layer_ids or ())
    queue = deque(Job(i, list(m)) for i, m in conversations)
    batch = SlotBatch(target)
    slots: list[Job | None] = []  # job per row
    pending: list[int] = []  # per row: the last token, generated but not yet fed
    flushing: list[bool] = []  # per row: the answer ended; its last token is fed once for its states
    stats = RegenStats()
    bar = tqdm(total=len(queue), unit="conv", desc="regenerating", disable=not progress)
    start = time.perf_counter()

    def ended(job: Job) -> bool:
        return (job.generated[-1] in eos or len(job.generated) >= cfg.max_new_tokens
                or len(job.prompt) + len(job.generated) >= cfg.max_length)

    def choose(row: int, job: Job, logits: torch.Tensor) -> None:
        pending[row] = _pick(logits, cfg, job.generator)
        job.generated.append(pending[row])
        # With capture, the answer's last token is fed once more (next step) for its states.
        flushing[row] = ended(job)

    def start_turn(row: int, job: Job) -> bool:
        """Prefill the job's next prompt into `row`; False if the conversation is finished."""
        ids = _next_prompt(job, tok, cfg)
        if ids is None:
            return False
        if job.generator is None and cfg.temperature > 0:
            job.generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + job.id)
        job.prompt, job.generated, job.states = ids, [], []
        out = batch.prefill(row, ids, lids)
        if capture:
            job.states.append((out.hidden[0], None if out.features is None else out.features[0]))
        choose(row, job, out.logits[0, -1])
        return True

    def finish_turn(job: Job) -> None:
        job.out.append({"role": "assistant", "content": tok.decode(job.generated, skip_special_tokens=True)})
        job.turn += 1
        job.turns_done += 1
        stats.useful_tokens += len(job.generated)
        stats.state_tokens += len(job.prompt) + len(job.generated) if capture else 0
        if job.generated[-1] not in eos:
            job.turn = len(job.messages)  # a cut answer cannot be continued: the conversation ends here

    def fill(row: int) -> None:
        """Give `row` work: the next turn of its conversation, else the next conversation."""
        job = slots[row]
        while True:
            if job is not None and flushing[row]:
                finish_turn(job)
                flushing[row] = False
            if job is not None and start_turn(row, job):
                slots[row] = job
                return
            if job is not None:
                while job.out and job.out[-1]["role"] != "assistant":
                    job.out.pop()  # user turns whose answer was not generated
                stats.conversations += 1
                bar.update(1)
                on_done(job)
            if not queue:
                slots[row] = None
                return
            job = queue.popleft()

    for _ in range(min(batch_size, len(queue))):
        row = batch.add_row()
        slots.append(None)
        pending.append(0)
        flushing.append(False)
        fill(row)
    while True:
        if not capture:  # nothing to capture: a finished row is refilled without one more step
            for row in range(len(slots)):
                while slots[row] is not None and flushing[row]:
                    fill(row)
        live = [i for i, s in enumerate(slots) if s is not None]
        if not live:
            break
        if len(live) < len(slots):  # the queue ran dry: stop computing finished rows
            batch.drop_rows(live)
            slots, pending, flushing = [slots[i] for i in live], [pending[i] for i in live], [flushing[i] for i in live]
        out = batch.step(pending, lids)
        for row, job in enumerate(slots):
            if capture:
                job.states.append((out.hidden[row], None if out.features is None else out.features[row]))
            if flushing[row]:
                fill(row)
            else:
                choose(row, job, out.logits[row, -1])
    stats.seconds = time.perf_counter() - start
    bar.close()
    return stats


# ---- resumable JSONL output ---------------------------------------------------------------------
def written_ids(path: Path) -> set[int]:
    """Ids already in the output; a half-written last line (killed mid-write) is cut off."""
    if not path.is_file():
        return set()
    ids, good = set(), 0
    with open(path, "rb") as f:
        for line in f:
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("unterminated")
                ids.add(int(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError):
                break
            good += len(line)
    if good < path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good)
    return ids


def regenerate_jsonl(target: Target, conversations, out: str | Path, cfg: GenerationConfig, batch_size: int = 8,
                     layer_ids: Sequence[int] | None = None, on_done: Callable[[Job], None] = lambda job: None,
                     eos_ids: Sequence[int] | None = None, progress: bool = True) -> RegenStats:
    """Regenerate a canonical conversations dataset (see sources.py) into `out` (JSONL), resumably.

    Row ids are the dataset's row indices, so rerunning on the same source continues where a
    killed run stopped. Rows flagged as bad by the source are not regenerated.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = written_ids(out)
    todo = [(i, r["messages"]) for i, r in enumerate(conversations) if not r["problem"] and i not in done]
    if done:
        print(f"{out}: {len(done)} conversations already written, {len(todo)} to go")
    with open(out, "a", encoding="utf-8") as f:
        def write(job: Job) -> None:
            if job.out:
                f.write(json.dumps({"id": job.id, "messages": job.out}, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())  # a kill after this line loses nothing already reported done
            on_done(job)

        return regenerate(target, todo, cfg, batch_size, layer_ids, write, eos_ids, progress)
