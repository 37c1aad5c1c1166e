"""`total_tokens="auto"`: pick the draft tree's depth and size from what a cycle costs on this machine.

EAGLE-2's argument: a cycle drafting to depth d and verifying n draft nodes costs
draft(d) + verify(n + 1 tokens) and gains tau = 1 + Σ P(node accepted). A node's draft confidence
(exp of its cumulative log-prob) stands in for its acceptance probability, so the best n nodes
(depth <= d) of one large probe tree give the expected gain of every smaller tree, and the plan
is the (d, n) maximising tau / cost. On a CPU a forward's cost grows with its tokens (there is no
idle parallel hardware to fill), so the best tree is small; on a GPU it is flat up to tens of tokens.

The verify cost is fitted as a + b * tokens to timings at a few sizes: measured costs on a busy
machine are noisy, and a two-parameter fit cannot reward a size for a lucky timing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from eyas.models import Target

from .tree import tree_attention

SIZES = (2, 4, 8, 16, 32)  # tokens per verify forward that are timed; a verify has at least 2


@torch.no_grad()
def measure_target_cost(target: Target, cache, valid: torch.Tensor, next_pos: torch.Tensor,
                        sizes: Sequence[int] = SIZES, repeats: int = 2) -> dict[int, float]:
    """Seconds for one target forward over k tokens at the current cache length, for k in sizes.

    Sizes are timed in interleaved rounds (best of `repeats`), so drift in machine speed hits all alike.
    """
    b, past = valid.shape
    dev = valid.device
    keep = torch.arange(past, device=dev).expand(b, -1)
    best = {k: float("inf") for k in sizes}
    for _ in range(repeats):
        for k in sizes:
            ids = torch.zeros(b, k, dtype=torch.long, device=dev)
            mask = tree_attention(valid, torch.ones(k, k, dtype=torch.bool, device=dev).tril().expand(b, k, k))
            pos = next_pos[:, None] + torch.arange(k, device=dev)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            target(ids, pos, mask, cache)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best[k] = min(best[k], time.perf_counter() - t0)
            Target.keep_cache(cache, keep)
    return best


def fit_cost(costs: dict[int, float]) -> tuple[float, float]:
    """Least-squares (a, b) with cost(k) ~ a + b * k, b >= 0 and a > 0. costs {tokens: seconds}."""
    k = np.array(sorted(costs), dtype=float)
    y = np.array([costs[int(x)] for x in k])
    if len(k) == 1:
        return float(y[0]), 0.0
    b, a = np.polyfit(k, y, 1)
    if b < 0:  # noise made bigger forwards look cheaper: treat the cost as flat
        return float(y.mean()), 0.0
    return max(float(a), 1e-6), float(b)


@dataclass(frozen=True)
class TreePlan:
    depth: int  # draft steps per cycle
    total_tokens: int  # draft nodes verified per cycle
    expected_tokens: float  # tau: 1 + the summed acceptance probability of those nodes
    cycle_s: float  # draft(depth) + verify(total_tokens + 1)

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.cycle_s


def plan_tree(accept_prob: np.ndarray, node_depth: np.ndarray, verify_cost: tuple[float, float],
              step_s: float, max_depth: int, max_nodes: int | None = None) -> TreePlan:
    """The (depth, node budget) with the most expected tokens per second.

    accept_prob [M]: each candidate node's probability of being accepted (its path's), node_depth [M] (1 = a
    child of the root); verify_cost (a, b): a forward over k tokens costs a + b k seconds; step_s: one draft
    step (the drafter runs `depth` head forwards per cycle, the first one the catch-up on accepted tokens).
    """
    a, b = verify_cost
    best: TreePlan | None = None
    for d in range(1, max_depth + 1):
        p = np.sort(accept_prob[node_depth <= d])[::-1][:max_nodes]
        if len(p) == 0:
            continue
        n = np.arange(1, len(p) + 1)
        gain = 1 + np.cumsum(p)
        cost = d * step_s + a + b * (n + 1)
        i = int(np.argmax(gain / cost))
        plan = TreePlan(d, int(n[i]), float(gain[i]), float(cost[i]))
        if best is None or plan.tokens_per_s > best.tokens_per_s:
            best = plan
    if best is None:
        raise ValueError("plan_tree needs at least one candidate node")
    return best


def chain_candidates(rates: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """A chain from per-position acceptance rates (P(draft j accepted | j-1 were)): (accept_prob, depth)."""
    p = np.cumprod(np.asarray(rates, dtype=float))
    return p, np.arange(1, len(p) + 1)
