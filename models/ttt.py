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
"""

from __future__ import annotations

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
