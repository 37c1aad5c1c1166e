"""Attention masks: which cache columns each new token may see, and the target's per-layer windows.

Everywhere in eyas a mask is boolean `allowed` [B, T, S]: row t may attend to key column s. The cache
(kv_cache.py) keeps row b's committed tokens in columns [0, lengths[b]) and whatever a cycle writes after
them, so a mask is "the row's history" plus a block over the columns from lengths[b] on (a tree's
ancestors, a catch-up's causal triangle). Windows are applied from the positions the cache records, with
transformers' own overlay functions, so a sliding-window or chunked layer masks exactly as the model
itself does. Only `additive` turns a mask into the float form transformers' attention consumes.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import chunked_overlay, sliding_window_overlay

# An attention kind: ("full", None), ("sliding", window) or ("chunked", chunk size).
Kind = tuple[str, int | None]


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """allowed [B, T, S] bool -> [B, 1, T, S] float, 0 where allowed and dtype-min elsewhere."""
    if allowed.dtype != torch.bool or allowed.dim() != 3:
        raise ValueError(f"expected a bool mask [B, T, S], got {tuple(allowed.shape)} {allowed.dtype}")
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    out.masked_fill_(~allowed, torch.finfo(dtype).min)
    return out[:, None]


def causal(t: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[t, t] bool lower triangle: token i sees tokens 0..i."""
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()


def after_history(lengths: torch.Tensor, block: torch.Tensor, width: int) -> torch.Tensor:
    """Row b sees its history, columns [0, lengths[b]), plus `block` over the columns from lengths[b] on.

    lengths [B]; block [B, T, K] bool over columns lengths[b] .. lengths[b] + K - 1 -> allowed [B, T, width].
    """
    b, t, k = block.shape
    col = torch.arange(width, device=block.device)
    rel = col[None, :] - lengths.to(block.device)[:, None]  # [B, width] column relative to the block
    in_block = (rel >= 0) & (rel < k)
    picked = block.gather(2, rel.clamp(0, max(k - 1, 0))[:, None, :].expand(b, t, width))
    return (rel < 0)[:, None, :] | (in_block[:, None, :] & picked)


def windowed(allowed: torch.Tensor, kind: Kind, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """`allowed` [B, T, S] narrowed to what a layer of `kind` sees; query_pos [B, T], key_pos [B, S] positions."""
    name, size = kind
    if name == "full" or size is None:
        return allowed
    q, k = query_pos[:, :, None], key_pos[:, None, :].to(query_pos.device)
    if name == "sliding":
        return allowed & sliding_window_overlay(size)(None, None, q, k)
    if name == "chunked":
        rows = torch.arange(allowed.shape[0], device=allowed.device)[:, None, None]
        return allowed & chunked_overlay(size, torch.zeros(allowed.shape[0], dtype=torch.long, device=allowed.device))(
            rows, None, q, k)
    raise ValueError(f"unknown attention kind {kind}")
