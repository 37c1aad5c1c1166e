"""`total_tokens="auto"`: pick the draft tree's depth and size from what a cycle costs on this machine.

EAGLE-2's argument: a cycle drafting to depth d and verifying n draft nodes costs
draft(d) + verify(n + 1 tokens) and gains tau = 1 + Σ P(node accepted). A node's draft confidence
(exp of its cumulative log-prob) stands in for its acceptance probability, so the best n nodes
(depth <= d) of one large probe tree give the expected gain of every smaller tree, and the plan
is the (d, n) maximising tau / cost. On a CPU a forward's cost grows with its tokens (there is no
idle parallel hardware to fill), so the best tree is small; on a GPU it is flat up to tens of tokens.

The verify cost is fitted as a + b * tokens to timings at a few sizes: measured costs on a busy
machine are noisy, and a two-parameter fit cannot reward a size for a lucky timing. One-token
forwards are timed apart (CPU kernels for one row differ), because plain decoding is a candidate too:
when no tree is expected to beat it, a cycle verifies the root alone and runs no draft.

Confidences are only a prior. A weak head is overconfident, and acceptance moves with the text, so
the Planner re-plans every cycle from the acceptance it observes (per-depth calibration, below).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from eyas.models import Target

from .lookup import MAX_NGRAM
from .tree import tree_attention

SIZES = (1, 2, 4, 8, 16, 32)  # tokens per target forward that are timed: 1 = plain decoding, a tree verify >= 2


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
    depth: int  # draft steps per cycle; 0 = plain decoding (verify the root alone, no draft)
    total_tokens: int  # draft nodes verified per cycle
    expected_tokens: float  # tau: 1 + the summed acceptance probability of those nodes
    cycle_s: float  # draft(depth) + verify(total_tokens + 1)

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.cycle_s

    @property
    def plain(self) -> bool:
        return self.depth == 0


def plan_tree(accept_prob: np.ndarray, node_depth: np.ndarray, verify_cost: tuple[float, float],
              step_s: float, max_depth: int, max_nodes: int | None = None, plain_s: float | None = None) -> TreePlan:
    """The (depth, node budget) with the most expected tokens per second.

    accept_prob [M]: each candidate node's probability of being accepted (its path's), node_depth [M] (1 = a
    child of the root); verify_cost (a, b): a forward over k tokens costs a + b k seconds; step_s: one draft
    step (the drafter runs `depth` head forwards per cycle, the first one the catch-up on accepted tokens).
    plain_s: seconds of a one-token forward; when given, plain decoding (depth 0: one token per forward,
    no draft) competes too.
    """
    a, b = verify_cost
    best = TreePlan(0, 0, 1.0, plain_s) if plain_s is not None else None
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


class Planner:
    """Each cycle's tree, re-planned from the acceptance observed while generating.

    The prior is one probe tree's confidences: conf [M] (path probability of each candidate node) at
    node_depth [M]. Per depth d the planner keeps decayed sums of what was predicted (the verified nodes'
    confidences at depth d: the modelled chance that the accepted path reaches d) and what happened (it
    did or not), and scales the probe's depth-d confidences by calibration c_d = (obs_d + w c_{d-1}) /
    (pred_d + w) -- a depth not yet observed inherits its parent's c, so deeper trees get tried.
    Decay lets the plan follow the text (code, lists and prose accept differently).

    Plain decoding wins when no tree pays for its draft and wider verify; then the cycle verifies the root
    alone. Every `probe` plain cycles the best tree is verified once anyway, to keep measuring; the
    interval doubles (to `max_probe`) while plain keeps winning.

    N-gram lookup branches (lookup.py) get their own per-position acceptance for each match length n
    (decayed, prior `lookup_prior`): in prose a one-token match is mostly noise while a three-token one
    is often copied text, and one shared rate would cut the long branches short or pay for the noise.
    lookup_tokens() sizes the branch to what it is expected to earn.
    """

    def __init__(self, conf: np.ndarray, node_depth: np.ndarray, verify_cost: tuple[float, float], step_s: float,
                 plain_s: float, max_depth: int, decay: float = 0.9, weight: float = 1.0, max_probe: int = 64,
                 lookup_max: int = 8, lookup_prior: float = 0.5, max_ngram: int = MAX_NGRAM) -> None:
        self.conf, self.node_depth = np.asarray(conf, dtype=float), np.asarray(node_depth)
        self.verify_cost, self.step_s, self.plain_s, self.max_depth = verify_cost, step_s, plain_s, max_depth
        self.decay, self.weight, self.max_probe = decay, weight, max_probe
        self.pred = np.zeros(max_depth)  # decayed sums per depth (index d-1)
        self.obs = np.zeros(max_depth)
        self.probe, self.since_probe = 2, 0
        self.lookup_prior = lookup_prior
        self.lookup_reached = np.zeros((max_ngram, lookup_max))  # decayed counts per (match length n-1, position)
        self.lookup_passed = np.zeros((max_ngram, lookup_max))
        self.plan = self._plan(plain=True)

    def calibration(self) -> np.ndarray:
        """c [max_depth]: observed / predicted acceptance per depth, shrunk toward the depth above."""
        c, above = np.ones(self.max_depth), 1.0
        for d in range(self.max_depth):
            c[d] = above = (self.obs[d] + self.weight * above) / (self.pred[d] + self.weight)
        return c

    def _plan(self, plain: bool) -> TreePlan:
        p = np.minimum(1.0, self.conf * self.calibration()[self.node_depth - 1])
        return plan_tree(p, self.node_depth, self.verify_cost, self.step_s, self.max_depth,
                         plain_s=self.plain_s if plain else None)

    def next(self) -> TreePlan:
        """The plan for the coming cycle: the current one, or a probe tree when plain decoding has run a while."""
        if not self.plan.plain:
            return self.plan
        self.since_probe += 1
        if self.since_probe < self.probe:
            return self.plan
        self.since_probe = 0
        return self._plan(plain=False)

    def observe(self, node_conf: np.ndarray, node_depth: np.ndarray, accepted: np.ndarray) -> None:
        """One verified cycle: node_conf [B, N] draft path probabilities of its draft nodes at node_depth
        [B, N] (1 = child of the root), accepted [B] draft tokens accepted per row."""
        depth = int(node_depth.max(initial=0))
        if depth == 0:
            return  # plain cycle: nothing about the draft to learn
        d = np.arange(1, depth + 1)
        pred = np.stack([(node_conf * (node_depth == k)).sum(1) for k in d], 1).mean(0)  # [depth]
        obs = (accepted[:, None] >= d).mean(0)
        self.pred *= self.decay
        self.obs *= self.decay
        self.pred[:depth] += pred
        self.obs[:depth] += obs
        was_plain = self.plan.plain
        self.plan = self._plan(plain=True)
        if self.plan.plain and was_plain:
            self.probe = min(2 * self.probe, self.max_probe)  # the probe confirmed plain: look less often
        elif not self.plan.plain:
            self.probe = 2

    def lookup_tokens(self, plan: TreePlan, ngram: int) -> int:
        """How many tokens of a lookup branch from an `ngram`-token match to graft onto `plan`'s tree:
        the most expected tokens per second (0: the branch does not pay)."""
        if self.lookup_reached.shape[1] == 0 or ngram <= 0:
            return 0
        a, b = self.verify_cost
        w = self.weight
        i = min(ngram, len(self.lookup_reached)) - 1
        rate = (self.lookup_passed[i] + w * self.lookup_prior) / (self.lookup_reached[i] + w)  # P(j+1 | j) per position
        gain = np.concatenate([[0.0], np.cumsum(np.cumprod(rate))])  # [L+1] expected extra tokens
        n = np.arange(len(gain))
        cost = plan.cycle_s + b * n if not plan.plain else np.where(n == 0, self.plain_s, a + b * (n + 1))
        return int(np.argmax((plan.expected_tokens + gain) / cost))

    def observe_lookup(self, proposed: Sequence[int], accepted: Sequence[int], ngrams: Sequence[int]) -> None:
        """Per row with a lookup branch: its length, how many of its leading tokens were accepted, and the
        length of the match it came from."""
        rows = [(p, a, min(n, len(self.lookup_reached)) - 1) for p, a, n in zip(proposed, accepted, ngrams) if p > 0]
        per_length = Counter(i for *_, i in rows)
        for i in per_length:
            self.lookup_reached[i] *= self.decay
            self.lookup_passed[i] *= self.decay
        for p, a, i in rows:
            self.lookup_reached[i, : min(p, a + 1)] += 1 / per_length[i]
            self.lookup_passed[i, : a] += 1 / per_length[i]
