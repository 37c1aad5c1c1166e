"""Training-time test (EAGLE-3) attention: step 0 batched at every sequence index, then steps i >= 1 packed.

A step-i query at index t sees the step-0 keys at indices <= t of its own batch element and its own
chain's keys of steps 1..i, all at index t. As a dense mask [T, (i+1)T] = [causal | eye | ...] the eye
blocks cost O(T^2) each for O(T) useful entries, so here the chain's keys are kept per query row,
[kv_heads, P, i, D], scored elementwise and merged with the causal step-0 block in one softmax. Steps
i >= 1 run as one packed sequence [1, P] of rows ordered by batch element, so no compute goes to padding
when batch elements keep different numbers of rows.

Memory grows linearly in T: a step's scores against the step-0 keys are [heads, rows, T], so its rows
go in chunks of at most `rows_per_chunk(T)` (a fixed memory budget), each recomputed in the backward
(activation checkpointing) when there is more than one; step 0 is one causal SDPA call.

Step 0 needs every index's keys/values but only some indices' outputs (those the loss or a later step
reads): `step0_rows` [P0] (flat indices b * T + t, ascending) makes the last layer drop the others
before its MLP, so step 0 returns hidden [1, P0, H] instead of [B, T, H]. None: all rows.

The same attention serves every drafter trained this way: EAGLE-3 (step i >= 1 feeds the next teacher-forced token
and the head's own previous state) and P-EAGLE (depth d >= 1 feeds a mask token and a learned state, and samples a
shrinking share of the rows per depth). `TTTPlan` says which rows run at each step, `unroll` runs them.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

# Bytes a chunk's scores (and their softmax) may take: [heads, rows, T] fp32, a few copies in flight.
SCORE_BUDGET = 256 << 20


class TTTAttention:
    """The head's attention context during training; `DecoderLayer` calls `update` at step 0, `attend` after."""

    def __init__(self, num_layers: int, step0_rows: torch.Tensor | None = None, window: int | None = None) -> None:
        self.num_layers = num_layers
        self.step0_rows = step0_rows
        self.window = window  # the head's sliding window (None: the whole context)
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # step 0: [B, kv, T, D]
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.chain_keys: list[torch.Tensor | None] = [None] * num_layers
        self.chain_values: list[torch.Tensor | None] = [None] * num_layers
        self.query_index: torch.Tensor | None = None  # [P] sequence index t of each packed row; None at step 0
        self.batch_sizes: list[int] = []  # packed rows per batch element, in order
        self.step = 0

    @property
    def packed(self) -> bool:
        """Steps >= 1 (packed rows, `attend`); step 0 is plain causal attention over every index."""
        return self.query_index is not None

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 0: keep this layer's keys/values [B, kv, T, D] for the later steps; attention over them is causal."""
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def next_step(self, query_index: torch.Tensor, batch_sizes: list[int], keep: torch.Tensor) -> None:
        """The next step runs at packed rows with index query_index [P], batch_sizes[b] of them in batch
        element b; keep: which rows of the previous step continue, in order ([P_prev] bool or [P] indices)."""
        self.query_index, self.batch_sizes = query_index, batch_sizes
        self.step += 1
        for i, k in enumerate(self.chain_keys):
            if k is not None:
                self.chain_keys[i], self.chain_values[i] = k[:, keep], self.chain_values[i][:, keep]

    def outputs(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The rows of layer `layer`'s residual stream x [B, T, H] that go on through its MLP."""
        if self.packed or self.step0_rows is None or layer < self.num_layers - 1:
            return x  # earlier layers: every index's output feeds the next layer's keys/values
        return x.flatten(0, 1).index_select(0, self.step0_rows)[None]  # [1, P0, H]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A packed step: q, k, v [1, heads or kv, P, D] -> [1, heads, P, D]."""
        # q [1, heads, P, D] -> [kv, rep, P, D]: GQA by broadcasting instead of repeating keys
        _, heads, p, d = q.shape
        kv = k.shape[1]
        q = q.reshape(kv, heads // kv, p, d) * d ** -0.5
        new_k, new_v = k[0, :, :, None], v[0, :, :, None]  # [kv, P, 1, D]
        old_k, old_v = self.chain_keys[layer], self.chain_values[layer]
        chain_k = new_k if old_k is None else torch.cat([old_k, new_k], dim=2)  # [kv, P, i, D]
        chain_v = new_v if old_v is None else torch.cat([old_v, new_v], dim=2)
        self.chain_keys[layer], self.chain_values[layer] = chain_k, chain_v
        keys, values = self.keys[layer], self.values[layer]  # step 0: [B, kv, T, D]
        chunk = rows_per_chunk(heads, keys.shape[2])
        recompute = torch.is_grad_enabled() and p > chunk
        parts, start = [], 0
        for b, size in enumerate(self.batch_sizes):
            for lo in range(start, start + size, chunk):
                hi = min(lo + chunk, start + size)
                args = (q[:, :, lo:hi], keys[b], values[b], self.query_index[lo:hi], chain_k[:, lo:hi],
                        chain_v[:, lo:hi], self.step, self.window)
                parts.append(checkpoint(_packed_rows, *args, use_reentrant=False) if recompute else _packed_rows(*args))
            start += size
        out = torch.cat(parts, dim=2) if parts else q.new_zeros(kv, heads // kv, 0, d)  # [kv, rep, P, D]
        return out.reshape(1, heads, p, d)


def rows_per_chunk(heads: int, length: int) -> int:
    """Packed rows whose scores against `length` step-0 keys fit SCORE_BUDGET."""
    return max(1, SCORE_BUDGET // (12 * heads * max(length, 1)))


def _packed_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, chain_k: torch.Tensor,
                 chain_v: torch.Tensor, step: int, window: int | None) -> torch.Tensor:
    """Rows of one batch element: q [kv, rep, c, D] (scaled), its step-0 keys/values [kv, T, D], their indices [c],
    their chains' keys/values [kv, c, i, D] -> [kv, rep, c, D]."""
    t = keys.shape[1]
    scores = q @ keys[:, None].transpose(-1, -2)  # [kv, rep, c, T]
    col = torch.arange(t, device=q.device)
    visible = col <= index[:, None]  # [c, T]: causal
    if window is not None:  # the query sits at position index + step
        visible &= col > index[:, None] + step - window
    scores = scores.masked_fill(~visible, float("-inf"))
    chain = torch.einsum("krpd,kpid->krpi", q, chain_k)  # [kv, rep, c, i]
    if window is not None and step >= window:  # chain key j (steps 1..i) sits step - j positions back
        behind = step - torch.arange(1, chain.shape[-1] + 1, device=q.device)
        chain = chain.masked_fill(behind >= window, float("-inf"))
    probs = torch.softmax(torch.cat([scores, chain], dim=-1), dim=-1)
    return probs[..., :t] @ values[:, None] + torch.einsum("krpi,kpid->krpd", probs[..., t:], chain_v)


class TTTPlan:
    """Host-side row bookkeeping of the TTT unroll, from valid [B, T] (CPU): which flat rows b * n + t run at each
    step, which of them carry loss, and the teacher row (flat b * T + u) each of those learns from. Which rows run
    at which step depends only on `valid`, so the unroll launches device work without waiting on it."""

    def __init__(self, valid: torch.Tensor, steps: int, shares: Callable[[int], float] | None = None,
                 generators: list[torch.Generator | None] | None = None) -> None:
        """shares: None runs every row that still leads to a loss (EAGLE-3); else step i >= 1 runs, in each sequence,
        a random share shares(i) (of that sequence's loss rows at step 0) of its rows of step i - 1 that carry loss
        at step i (P-EAGLE), drawn with that sequence's generator (generators[b]; None: the global one)."""
        b, t = valid.shape
        n = t - 1
        self.steps = steps
        flat = torch.arange(b * t).view(b, t)  # the flat [B, T] row of (b, u): what the teacher is indexed by
        # carries[i][:, t]: step i at index t learns the distribution at t+1+i, which carries loss
        shifted = torch.cat([valid[:, 1:], valid.new_zeros(b, steps)], dim=1)  # [B, n + steps]
        carries = torch.stack([shifted[:, i:i + n] for i in range(steps)])  # [K, B, n]
        needed = carries.flip(0).cumsum(0, dtype=torch.int32).flip(0) > 0  # step i still leads to a loss
        last = needed[0].any(0).nonzero()  # [L, 1] indices that lead to a loss in some batch element
        n = self.n = int(last.max()) + 1 if len(last) else 1
        carries, needed = carries[..., :n], needed[..., :n]
        t_of = torch.arange(n).repeat(b)  # [B*n] index t of each flat row
        b_of = torch.arange(b).repeat_interleave(n)  # [B*n] its batch element
        self.rows, self.keep, self.at, self.batch, self.batch_sizes = [], [], [], [], []
        self.selected, self.teacher = [], []
        if shares is not None:  # a later step's rows are drawn from those that carry loss there
            needed = carries.clone()
        rows = needed[0].flatten().nonzero().squeeze(1)  # [P_0] flat rows of step 0, ascending
        for i in range(steps):
            keep = needed[i].flatten()[rows].nonzero().squeeze(1)  # [P_i] which of step i-1's rows go on
            if shares is not None and i > 0:
                keep = self._draw(keep, b_of[rows[keep]], b_of[self.rows[0]], shares(i), generators)
            rows = rows if i == 0 else rows[keep]
            at, bat = t_of[rows], b_of[rows]
            self.rows.append(rows)
            self.keep.append(keep)
            self.at.append(at)
            self.batch.append(bat)
            self.batch_sizes.append(bat.bincount(minlength=b).tolist())
            sel = carries[i].flatten()[rows].nonzero().squeeze(1)  # [P'_i] rows with loss at this step
            self.selected.append(sel)
            self.teacher.append(flat[bat[sel], at[sel] + 1 + i])

    @staticmethod
    def _draw(keep: torch.Tensor, batch: torch.Tensor, first: torch.Tensor, share: float,
              generators: list[torch.Generator | None] | None) -> torch.Tensor:
        """Of the candidates keep [C] (in sequences batch [C]), each sequence's random share of its step-0 loss rows
        (first [P_0]: their sequences), in order."""
        chosen = []
        for b in batch.unique().tolist():
            mine = keep[batch == b]
            size = min(len(mine), round(share * int((first == b).sum())))
            gen = generators[b] if generators is not None else None
            chosen.append(mine[torch.randperm(len(mine), generator=gen)[:size]])
        return torch.cat(chosen).sort().values if chosen else keep


# Inputs of step i >= 1 at its rows: (step, sequence index t [P], batch element [P], the previous step's states at
# those rows [P, H]) -> (token ids [1, P], states [1, P, H]).
StepInputs = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def unroll(head, input_ids: torch.Tensor, hidden: torch.Tensor, plan: TTTPlan, later: StepInputs,
           step0_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Run the plan: step 0 at every index [B, n] (token ids[t+1], state hidden[t], position t), then step i at its
    packed rows (position t + i, inputs from `later`). hidden [B, n, H] is step 0's input state; step0_mask [B, n, n]
    (a window) or None (causal). Returns per step the head's states [P'_i, H] at the rows that carry loss there."""
    b = input_ids.shape[0]
    n, dev = plan.n, input_ids.device
    cache = TTTAttention(head.config.num_layers, step0_rows=to_device(plan.rows[0], dev),
                         window=head.config.sliding_window)
    ids, positions = input_ids[:, 1:n + 1], torch.arange(n, device=dev).expand(b, n)
    picked = []
    for i in range(plan.steps):
        if i > 0:  # step i's rows are a subset of step i-1's: keep those
            keep, at, bat = (to_device(x, dev) for x in (plan.keep[i], plan.at[i], plan.batch[i]))
            cache.next_step(at, plan.batch_sizes[i], keep)
            ids, hidden = later(i, at, bat, hidden.index_select(0, keep))
            positions = (at + i)[None]
        hidden = head(ids, hidden, positions, step0_mask if i == 0 else None, cache, logits=False).hidden.flatten(0, 1)
        picked.append(hidden.index_select(0, to_device(plan.selected[i], dev)))
    return picked


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device (pinned, asynchronous copy on CUDA)."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)
