"""`total_tokens="auto"`: pick the draft tree size from what a target forward costs on this machine.

Model: a cycle costs draft + target(n + 1 tokens) and gains 1 + Σ P(node accepted) tokens. As in
EAGLE-2, a node's draft confidence (exp of its cumulative log-prob) stands in for its acceptance
probability, so the best n nodes of a large dynamic tree give the expected gain of every smaller tree.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

from eyas.models import Target

from .tree import tree_attention

SIZES = (1, 8, 16, 32, 64)


@torch.no_grad()
def measure_target_cost(target: Target, cache, valid: torch.Tensor, next_pos: torch.Tensor,
                        sizes: Sequence[int] = SIZES, repeats: int = 2) -> dict[int, float]:
    """Seconds for one target forward over n + 1 tokens at the current cache length, for n in sizes."""
    b, past = valid.shape
    dev = valid.device
    costs = {}
    keep = torch.arange(past, device=dev).expand(b, -1)
    for n in sizes:
        k = n + 1
        ids = torch.zeros(b, k, dtype=torch.long, device=dev)
        mask = tree_attention(valid, torch.ones(k, k, dtype=torch.bool, device=dev).tril().expand(b, k, k))
        pos = next_pos[:, None] + torch.arange(k, device=dev)
        best = float("inf")
        for _ in range(repeats):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            target(ids, pos, mask, cache)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
            Target.keep_cache(cache, keep)
        costs[n] = best
    return costs


def pick_total_tokens(costs: dict[int, float], scores: torch.Tensor, draft_s: float = 0.0) -> int:
    """Tree size maximising (1 + Σ confidences of the best n nodes) / (draft_s + cost(n)).

    costs {n: seconds} (interpolated in between); scores [B, M] cumulative draft log-probs of a tree's nodes.
    """
    conf = scores.float().exp().mean(0).sort(descending=True).values.cpu().numpy()
    sizes = np.arange(1, min(max(costs), len(conf)) + 1)
    gain = 1 + np.cumsum(conf)[sizes - 1]
    known = sorted(costs)
    cost = draft_s + np.interp(sizes, known, [costs[n] for n in known])
    return int(sizes[np.argmax(gain / cost)])
