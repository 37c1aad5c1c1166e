"""Attention masks at the model boundary.

Everywhere in eyas a mask is boolean `allowed` [B, T, S]: row t may attend to key s. Only
here is it turned into the additive float form transformers and SDPA consume, so the
convention lives in one place.
"""

from __future__ import annotations

import torch


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """allowed [B, T, S] bool -> [B, 1, T, S] float with 0 where allowed and dtype-min elsewhere."""
    if allowed.dtype != torch.bool or allowed.dim() != 3:
        raise ValueError(f"expected a bool mask [B, T, S], got {tuple(allowed.shape)} {allowed.dtype}")
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    out.masked_fill_(~allowed, torch.finfo(dtype).min)
    return out[:, None]


def causal_allowed(batch: int, new: int, past: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, new, past+new]: every new token sees the whole past and the new tokens up to itself."""
    allowed = torch.ones(new, past + new, dtype=torch.bool, device=device)
    allowed[:, past:] = torch.tril(allowed[:, past:])
    return allowed.expand(batch, -1, -1)
