"""Self-distillation: rewrite every assistant turn with the target itself, wasting no batch slot.

Continuous batching. Each of `batch_size` slots holds one generation; the moment it ends (eos or
max_new_tokens) its slot is refilled with the next prompt, so no row decodes padding after its
answer is done. All slots share one KV cache [B, heads, L, d] whose rows are right-aligned: row
b's tokens occupy its last lens[b] columns, a 2D padding mask hides the columns to their left,
and explicit position ids give every row its own positions. The cache is preallocated with
headroom (a step writes one column in place, no per-step copy of the whole cache); columns no row
needs any more are dropped from the left by moving a start index. Prompts that start in the same
step are prefilled together (packed into bins, each token seeing only its own prompt) and spliced
into their rows, longest first: rows of similar length then sit together, and the target's attention
reads each group of them only as far back as its longest row (models/cpu_kernels.py:ragged_rows).

Hidden states come for free: every forward also returns the EAGLE features of the chosen layers
and the final normed hidden state, so the states of the finished example (prompt prefill +
every generated token, the last one fed once more when its row ends) need no second target pass.

Resumable: finished conversations are appended to a JSONL file ({"id", "messages"}), flushed
and fsynced; a rerun skips ids already written and drops a half-written last line. With
cache_hidden, the states also go straight into an offline hidden-state cache (hidden_cache.py).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import Cache, DynamicLayer

from eyas.data.chat_template import TemplateError, render_with_mask
from eyas.data.hidden_cache import CacheWriter, stored_shards
from eyas.models.config import default_fused_layer_ids
from eyas.models.signals import GracefulStop
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
    conversations: int = 0  # finished with at least one regenerated turn
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> conversations finished with no turn generated
    useful_tokens: int = 0  # generated tokens kept in the output
    state_tokens: int = 0  # tokens whose target states were captured
    mask_fallbacks: int = 0  # cached examples whose loss mask covers only the final answer (see training_example)
    seconds: float = 0.0
    stored: int = 0  # conversations in the output after the run, earlier runs' included (regenerate_jsonl)
    stopped_by: int | None = None  # the signal that stopped the run early (in-flight conversations dropped)

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds if self.seconds else 0.0


class _SlotLayer(DynamicLayer):
    """One layer's keys/values in a preallocated buffer [B, heads, cap, d]; the live columns are [start, end).

    A step writes its column in place instead of concatenating a new copy of the whole cache;
    dropping dead columns on the left only moves `start`. The buffer is reallocated (live columns
    copied once) only when a step or a longer prompt does not fit.
    """

    def __init__(self) -> None:
        super().__init__()
        self.start = self.end = 0
        self.kbuf = self.vbuf = None

    def _refresh(self) -> None:
        self.keys, self.values = self.kbuf[:, :, self.start: self.end], self.vbuf[:, :, self.start: self.end]

    def allocate(self, rows: int, like: torch.Tensor) -> None:
        """Empty buffers for `rows` rows with the heads, head size and dtype of `like` [*, heads, *, d]."""
        self.kbuf = like.new_zeros(rows, like.shape[1], 0, like.shape[3])
        self.vbuf = self.kbuf.clone()
        self.is_initialized, self.device = True, like.device
        self._refresh()

    def reserve(self, left: int, right: int) -> None:
        """Room for `left` more columns before `start` and `right` after `end`."""
        if self.start >= left and self.end + right <= self.kbuf.shape[2]:
            return
        width = self.end - self.start
        cap = max(2 * (width + left + right), 64)  # headroom: the next reallocation is ~width steps away
        # Zeros, not empty(): masked columns get weight 0, and 0 * NaN garbage would still be NaN.
        k = self.kbuf.new_zeros(*self.kbuf.shape[:2], cap, self.kbuf.shape[3])
        v = k.clone()
        k[:, :, left: left + width] = self.keys
        v[:, :, left: left + width] = self.values
        self.kbuf, self.vbuf, self.start, self.end = k, v, left, left + width
        self._refresh()

    def widen(self, width: int) -> None:
        """At least `width` live columns; new ones are added on the left."""
        if width > self.end - self.start:
            self.reserve(width - (self.end - self.start), 0)
            self.start = self.end - width
            self._refresh()

    def drop_left(self, n: int) -> None:
        self.start += n
        self._refresh()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        t = key_states.shape[2]
        self.reserve(0, t)
        self.kbuf[:, :, self.end: self.end + t] = key_states
        self.vbuf[:, :, self.end: self.end + t] = value_states
        self.end += t
        self._refresh()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.end - self.start


PACK_WIDTH = 256  # prefill bin width (tokens): attention span vs padding left in the bins


class SlotBatch:
    """The shared right-aligned KV cache of the live slots and the per-row lengths."""

    def __init__(self, target: Target, rows: int) -> None:
        if any(type(l) is not DynamicLayer for l in target.new_cache().layers):
            raise ValueError(f"regeneration needs full-attention KV caches; {target.name_or_path} has other cache "
                             "layers (sliding window or linear attention)")
        self.target = target
        self.layers = [_SlotLayer() for _ in range(target.num_layers)]
        self.cache = Cache(layers=self.layers)
        self.lens = torch.zeros(rows, dtype=torch.long, device=target.device)  # tokens of each row in the cache

    @property
    def width(self) -> int:
        return self.layers[0].get_seq_length()

    def drop_rows(self, keep: list[int]) -> list[int]:
        """Keep only rows `keep` (ascending); returns the old row now in each row.

        Each kept row beyond len(keep) moves into a dropped row below it (its live columns only) and
        the buffers are narrowed to their first len(keep) rows (a view): no copy of the whole cache.
        """
        n = len(keep)
        order, kept = list(range(n)), set(keep)
        holes = [r for r in range(n) if r not in kept]
        for hole, row in zip(holes, [r for r in keep if r >= n]):
            order[hole] = row
            for l in self.layers:
                if l.kbuf is not None:
                    l.kbuf[hole, :, l.start: l.end] = l.kbuf[row, :, l.start: l.end]
                    l.vbuf[hole, :, l.start: l.end] = l.vbuf[row, :, l.start: l.end]
        for l in self.layers:
            if l.kbuf is not None:
                l.kbuf, l.vbuf = l.kbuf[:n], l.vbuf[:n]
                l._refresh()
        self.lens = self.lens[order]
        return order

    def prefill(self, rows: list[int], prompts: list[list[int]], layer_ids: Sequence[int]):
        """Run `prompts` packed together and splice each into its row.

        Packing, not padding: prompts go (longest first, first fit) into bins of PACK_WIDTH tokens
        (or the longest prompt), each token attending only to its own prompt, positions restarting
        per prompt. Padding prompts to a common length wastes most of a prefill on chat prompts,
        whose lengths vary a lot; a packed bin's extra attention span costs far less.
        Returns (logits [G, V] after each prompt, per prompt (hidden [n, H], features [n, F] | None)).
        """
        dev = self.target.device
        width = max(PACK_WIDTH, max(map(len, prompts)))
        fill: list[int] = []  # tokens in each bin
        place = [(0, 0)] * len(prompts)  # (bin, first column) of each prompt
        for g in sorted(range(len(prompts)), key=lambda g: -len(prompts[g])):
            b = next((b for b, used in enumerate(fill) if used + len(prompts[g]) <= width), len(fill))
            if b == len(fill):
                fill.append(0)
            place[g] = (b, fill[b])
            fill[b] += len(prompts[g])
        t = max(fill)
        ids = torch.zeros(len(fill), t, dtype=torch.long)
        pos = torch.zeros(len(fill), t, dtype=torch.long)
        seg = torch.full((len(fill), t), -1)  # prompt of each token; padding: -1 (sees itself at least)
        for g, ((b, c), x) in enumerate(zip(place, prompts)):
            ids[b, c: c + len(x)], pos[b, c: c + len(x)], seg[b, c: c + len(x)] = torch.tensor(x), torch.arange(len(x)), g
        mask = None  # one prompt, no padding: plain causal (the fastest attention path)
        if len(prompts) > 1 or len(prompts[0]) < t:
            mask = ((seg[:, :, None] == seg[:, None, :]) & torch.ones(t, t, dtype=torch.bool).tril()).to(dev)
        own = self.target.new_cache()
        out = self.target(ids.to(dev), position_ids=pos.to(dev), attention_mask=mask, cache=own, layer_ids=layer_ids,
                          logits=False)
        spans = [(b, c, c + len(x)) for (b, c), x in zip(place, prompts)]
        last = torch.tensor([[b, e - 1] for b, _, e in spans], device=dev)
        logits = self.target.logit_projection(out.hidden[last[:, 0], last[:, 1]])
        for l, o in zip(self.layers, own.layers):
            if l.kbuf is None:
                l.allocate(len(self.lens), o.keys)
            l.widen(max(map(len, prompts)))
            for row, (b, c, e) in zip(rows, spans):
                l.keys[row, :, c - e:] = o.keys[b, :, c:e]
                l.values[row, :, c - e:] = o.values[b, :, c:e]
        self.lens[rows] = torch.tensor([len(x) for x in prompts], device=dev)
        states = [(out.hidden[b, c:e], None if out.features is None else out.features[b, c:e]) for b, c, e in spans]
        return logits, states

    def step(self, tokens: torch.Tensor, layer_ids: Sequence[int]):
        """Feed tokens [B] (each at its row's next position); returns TargetOutput [B, 1, ...]."""
        w = self.width
        cols = torch.arange(w + 1, device=self.lens.device)
        mask = cols[None, :] >= w - self.lens[:, None]  # [B, w+1]: the row's own columns and the new one
        out = self.target(tokens[:, None], position_ids=self.lens[:, None], attention_mask=mask, cache=self.cache,
                          layer_ids=layer_ids)
        self.lens += 1
        drop = self.width - int(self.lens.max())
        if drop > 0:  # columns to the left of every row are dead weight
            for l in self.layers:
                l.drop_left(drop)
        return out


def _pick(logits: torch.Tensor, cfg: GenerationConfig, generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] → next token per row (greedy, or temperature + top-p sampling with the row's generator)."""
    if cfg.temperature <= 0:
        return logits.argmax(-1).tolist()
    probs = torch.softmax(logits.float() / cfg.temperature, -1)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= cfg.top_p, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return [int(torch.multinomial(p, 1, generator=gen)) for p, gen in zip(probs, generators)]


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
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def regenerate(
    target: Target,
    conversations: Iterable[tuple[int, list[dict]]],
    cfg: GenerationConfig,
    batch_size: int = 8,
    layer_ids: Sequence[int] | None = None,
    on_done: Callable[[Job], None] = lambda job: None,
    eos_ids: Sequence[int] | None = None,
    progress: bool = True,
    prefill_tokens: int = 4096,
    stop: GracefulStop | None = None,
) -> RegenStats:
    """Regenerate the assistant turns of (id, messages) conversations; `on_done(job)` gets each.

    layer_ids: capture target states while generating (None: capture nothing). job.states then
    holds the final turn's (hidden [T, H], features [T, F]) chunks for job.prompt + job.generated.
    A conversation ends early (keeping the turns done) when a prompt would not fit max_length
    or an answer hits max_new_tokens without eos, since a cut answer cannot be continued.
    prefill_tokens: prompts that start in the same step are prefilled together, in groups of at
    most this many tokens (a longer prompt goes alone).
    stop: checked before every step; once set, the in-flight conversations are dropped (on_done is
    not called for them) and stats.stopped_by says which signal stopped the run.
    """
    tok = target.tokenizer
    eos = set(eos_ids if eos_ids is not None else [tok.eos_token_id])
    capture = layer_ids is not None
    lids = tuple(layer_ids or ())
    queue = deque(Job(i, list(m)) for i, m in conversations)
    rows = min(batch_size, len(queue))
    batch = SlotBatch(target, rows)
    slots: list[Job | None] = [None] * rows  # job per row
    pending = [0] * rows  # per row: the last token, generated but not yet fed
    flushing = [False] * rows  # per row: the answer ended; its last token is fed once for its states
    stats = RegenStats()
    bar = tqdm(total=len(queue), unit="conv", desc="regenerating", disable=not progress)
    start = time.perf_counter()

    def ended(job: Job) -> bool:
        return (job.generated[-1] in eos or len(job.generated) >= cfg.max_new_tokens
                or len(job.prompt) + len(job.generated) >= cfg.max_length)

    def choose(rows: list[int], logits: torch.Tensor) -> None:
        """logits [len(rows), V]: the next token of each row's answer."""
        for row, t in zip(rows, _pick(logits, cfg, [slots[r].generator for r in rows])):
            job = slots[row]
            pending[row] = t
            job.generated.append(t)
            # With capture, the answer's last token is fed once more (next step) for its states.
            flushing[row] = ended(job)

    def finish_turn(job: Job) -> None:
        job.out.append({"role": "assistant", "content": tok.decode(job.generated, skip_special_tokens=True)})
        job.turn += 1
        job.turns_done += 1
        stats.useful_tokens += len(job.generated)
        stats.state_tokens += len(job.prompt) + len(job.generated) if capture else 0
        if job.generated[-1] not in eos:
            job.turn = len(job.messages)  # a cut answer cannot be continued: the conversation ends here

    def next_prompt(row: int) -> list[int] | None:
        """Move `row` on to its conversation's next turn, else the next conversation; that turn's prompt."""
        job = slots[row]
        while True:
            if job is not None and flushing[row]:
                finish_turn(job)
                flushing[row] = False
            if job is not None:
                ids = _next_prompt(job, tok, cfg)
                too_long = ids is not None and len(ids) >= cfg.max_length
                if ids is not None and not too_long:
                    if job.generator is None and cfg.temperature > 0:
                        job.generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + job.id)
                    job.prompt, job.generated, job.states = ids, [], []
                    slots[row] = job
                    return ids
                while job.out and job.out[-1]["role"] != "assistant":
                    job.out.pop()  # user turns whose answer was not generated
                if job.turns_done:
                    stats.conversations += 1
                else:
                    why = "first prompt reaches max_length" if too_long else "no user turn before an assistant turn"
                    stats.skipped[why] = stats.skipped.get(why, 0) + 1
                bar.update(1)
                on_done(job)
            if not queue:
                slots[row] = None
                return None
            job = queue.popleft()

    def refill(rows: list[int]) -> None:
        """Give each of `rows` its next turn; the new prompts are prefilled in groups of at most prefill_tokens."""
        starting = sorted(r for r in rows if next_prompt(r) is not None)
        # Longest prompt in the lowest row: rows then stay sorted by length as they grow together, so the
        # target's attention can read each group of similar rows only as far back as they need (ragged_rows).
        for r, job in zip(starting, sorted((slots[r] for r in starting), key=lambda j: -len(j.prompt))):
            slots[r] = job
        todo = [(r, slots[r].prompt) for r in starting]
        i = 0
        while i < len(todo):
            j, tokens = i + 1, len(todo[i][1])
            while j < len(todo) and tokens + len(todo[j][1]) <= prefill_tokens:
                tokens += len(todo[j][1])
                j += 1
            group = [r for r, _ in todo[i:j]]
            logits, states = batch.prefill(group, [ids for _, ids in todo[i:j]], lids)
            if capture:
                for row, state in zip(group, states):
                    slots[row].states.append(state)
            choose(group, logits)
            i = j

    refill(list(range(rows)))
    while True:
        if stop:
            stats.stopped_by = stop.signum
            break
        if not capture:  # nothing to capture: a finished row is refilled without one more step
            while ends := [r for r, s in enumerate(slots) if s is not None and flushing[r]]:
                refill(ends)
        live = [r for r, s in enumerate(slots) if s is not None]
        if not live:
            break
        if len(live) < len(slots):  # the queue ran dry: stop computing finished rows
            order = batch.drop_rows(live)
            slots, pending, flushing = [slots[r] for r in order], [pending[r] for r in order], [flushing[r] for r in order]
        out = batch.step(torch.tensor(pending, device=target.device), lids)
        if capture:
            for row, job in enumerate(slots):
                job.states.append((out.hidden[row], None if out.features is None else out.features[row]))
        ends = [r for r in range(len(slots)) if flushing[r]]
        going = [r for r in range(len(slots)) if not flushing[r]]
        if going:
            choose(going, out.logits[going, -1] if ends else out.logits[:, -1])
        refill(ends)
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


def regenerate_jsonl(target: Target, conversations, out: str | Path, cfg: GenerationConfig, batch_size: int = 8,
                     layer_ids: Sequence[int] | None = None, on_done: Callable[[Job], None] = lambda job: None,
                     eos_ids: Sequence[int] | None = None, progress: bool = True, cache_hidden: str | Path | None = None,
                     cache_dtype: str = "bf16", shard_examples: int = 128) -> RegenStats:
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
    (KeyboardInterrupt; what is on disk stays consistent). The previous handlers are restored.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
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
            raise ValueError(f"{out} holds {len(done - cached)} conversations that are not in the hidden-state cache "
                             f"{writer.folder} (written without --cache-hidden?): use another output file, or "
                             "regenerate without --cache-hidden and run `eyas data cache-hidden` afterwards")
    todo = [(i, r["messages"]) for i, r in enumerate(conversations) if not r["problem"] and i not in done]
    if done:
        print(f"{out}: {len(done)} conversations already written, {len(todo)} to go")
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

        with GracefulStop(tqdm.write, "writing the finished conversations, then stopping") as stop:
            stats = regenerate(target, todo, cfg, batch_size, layer_ids, write, eos_ids, progress, stop=stop)
            if writer is not None:
                if buffer:
                    flush_shard()
                writer.finish()
    stats.mask_fallbacks, stats.stored = fallbacks, len(done)
    return stats
