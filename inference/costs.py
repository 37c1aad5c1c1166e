"""What a cycle costs on this machine, re-measured as it runs.

A cycle is the head's draft (a catch-up over the tokens accepted since the head last ran, then one head
forward per level below the first), then the rest: the lookup branch, one target forward over the tree's
k = nodes + 1 tokens (k = 1 is plain decoding, a cheaper forward without a mask), acceptance and
bookkeeping. Each part is a small linear model in what it scales with, L being the context length in
thousands of tokens:
- plain cycle:       p0 + p1 * L
- speculative rest:  a + b * k + c * L + d * k * L
- draft:             s0 + s1 * (levels - 1) + s2 * (catch-up tokens - 1)
Every cycle's measured times refit them (`CostModel.observe`): least squares with coefficients >= 0 (a
lucky timing must not make bigger trees look cheaper), older cycles forgotten geometrically (costs move
with the context), one outlier clipped (a stall elsewhere on the machine is not the cycle's cost), shrunk
toward the starting point where the cycles have not shown otherwise, all scaled by one factor for the
machine's current pace (whatever else it runs slows every part alike). `calibrate` measures the starting
point once, on a scratch cache filled with a real prompt. On a GPU the verify is flat up to tens of
tokens, so trees are large; on a CPU a few nodes.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch

from eyas.models import Target
from eyas.models.masks import after_history, causal

from .timing import Stopwatch, synchronize

logger = logging.getLogger(__name__)

SIZES = (1, 2, 4, 8, 16, 32)  # tokens per target forward that are timed: 1 = plain decoding, a tree verify >= 2
PER_TOKEN = 1e-3  # context lengths enter the fits in thousands of tokens


class LinearFit:
    """y ~ x . theta with theta >= 0: geometrically forgotten least squares, shrunk toward a prior.

    prior: the starting coefficients; scale: each feature's typical magnitude, so that the prior weighs as
    much as `strength` observations in every direction at first; decay: the weight an observation keeps per
    later one. The prior is forgotten like an observation down to `floor` of its weight: enough to hold the
    directions the observations never vary in (the context length, within a few cycles), too little to
    bias the ones they do. A few features, refit every observation: plain Python, cheaper than numpy's
    per-call cost at this size (it runs in every cycle, plain ones included)."""

    def __init__(self, prior: Sequence[float], scale: Sequence[float], strength: float = 3.0,
                 decay: float = 0.97, clip: float = 4.0, floor: float = 0.02) -> None:
        n = len(prior)
        self.prior = [float(p) for p in prior]
        self._precision = [float(v) ** 2 for v in scale]  # the prior's precision, a diagonal
        self._weight, self._floor = strength, floor * strength
        self._xx = [[0.0] * n for _ in range(n)]
        self._xy = [0.0] * n
        self.decay, self.clip = decay, clip
        self.theta = list(self.prior)
        self.seen = 0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Predictions for features x [..., F] (never negative)."""
        return np.maximum(np.asarray(x, dtype=float) @ np.array(self.theta), 0.0)

    def at(self, *x: float) -> float:
        """The prediction for one feature vector (never negative)."""
        return max(sum(t * v for t, v in zip(self.theta, x)), 0.0)

    def observe(self, x: Sequence[float], y: float) -> None:
        y = min(float(y), self.clip * self.at(*x) + 1e-6) if self.seen else float(y)
        d = self.decay
        for i, xi in enumerate(x):
            row = self._xx[i]
            for j, xj in enumerate(x):
                row[j] = d * row[j] + xi * xj
            self._xy[i] = d * self._xy[i] + xi * y
        self._weight = w = max(d * self._weight, self._floor)
        self.seen += 1
        n = len(x)
        a = [[self._xx[i][j] + (w * self._precision[i] if i == j else 0.0) for j in range(n)] for i in range(n)]
        b = [self._xy[i] + w * self._precision[i] * self.prior[i] for i in range(n)]
        self.theta = _nonnegative_solve(a, b)


def _nonnegative_solve(a: list[list[float]], b: list[float]) -> list[float]:
    """argmin of x'Ax/2 - b'x over x >= 0 (A positive definite, a few unknowns): active set, one variable at a time."""
    free = list(range(len(b)))
    while True:
        x = [0.0] * len(b)
        for i, v in zip(free, _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])):
            x[i] = v
        if min(x) >= 0.0:
            return x
        free.remove(min(free, key=lambda i: x[i]))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b by Gaussian elimination (a positive definite: no pivoting needed)."""
    n = len(b)
    a = [row[:] + [v] for row, v in zip(a, b)]
    for c in range(n):
        for r in range(c + 1, n):
            f = a[r][c] / a[c][c]
            for k in range(c, n + 1):
                a[r][k] -= f * a[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


class CostModel:
    """Seconds of the parts of a cycle at a context length, starting from one calibration, refit by every cycle.

    The four numbers are the starting point: a target forward over k >= 2 tokens costs verify_s +
    verify_s_per_token * k, a plain cycle plain_s, a draft of one level after one new token draft_step_s,
    and every further level as much again. Context lengths start without a cost of their own.

    One factor, `speed`, scales every part: how much slower the machine runs now than the fits say (another
    process on the same cores slows plain and tree forwards and drafts alike). Plain cycles set it, quickly
    (`speed_rate`, in log space): they are the yardstick the planner's guard measures speculation against,
    and a tree verify that costs more than its fit says may be the tree, not the machine. The fits learn
    the shape of the costs from measurements divided by it, slowly, so a part the cycles have not run for a
    while (tree verifies while the head does not pay) is still priced at the machine's current pace.
    `observe` returns how far the measurement was from the prediction, so the planner can re-measure plain
    decoding soon when the machine seems to have changed.
    learn=False keeps everything as given (a fixed machine: tests, and replays under one cost model)."""

    def __init__(self, verify_s: float, verify_s_per_token: float, plain_s: float, draft_step_s: float,
                 decay: float = 0.98, strength: float = 3.0, speed_rate: float = 0.3, learn: bool = True) -> None:
        self.start = dict(verify_s=verify_s, verify_s_per_token=verify_s_per_token, plain_s=plain_s,
                          draft_step_s=draft_step_s)
        self.learn, self.speed, self.speed_rate = learn, 1.0, speed_rate
        fit = dict(decay=decay, strength=strength)
        self._plain = LinearFit([plain_s, 0.0], [1.0, 0.5], **fit)
        self._verify = LinearFit([verify_s, verify_s_per_token, 0.0, 0.0], [1.0, 8.0, 0.5, 4.0], **fit)
        # a catch-up token costs a head forward's share of a wider batch: 1/8 of a step to start with
        self._draft = LinearFit([draft_step_s, draft_step_s, draft_step_s / 8], [1.0, 3.0, 4.0], **fit)

    # ---- what a cycle costs ---------------------------------------------------------------------
    def verify(self, nodes: int | np.ndarray, context: int) -> np.ndarray | float:
        """Seconds of a cycle but its draft when it verifies `nodes` draft nodes (0: a plain cycle) after
        `context` tokens. nodes may be an array."""
        L = context * PER_TOKEN
        if isinstance(nodes, (int, np.integer)):
            k = nodes + 1
            return self.speed * (self._plain.at(1.0, L) if nodes == 0 else self._verify.at(1.0, k, L, k * L))
        k = np.asarray(nodes, dtype=float) + 1
        spec = self._verify(np.stack([np.ones_like(k), k, np.full_like(k, L), k * L], -1))
        return self.speed * np.where(k == 1, self._plain.at(1.0, L), spec)

    def draft(self, levels: int, catchup: int) -> float:
        """Seconds of a draft of `levels` levels after `catchup` tokens the head has not seen (0 levels: none)."""
        return self.speed * self._draft.at(1.0, levels - 1, max(catchup - 1, 0)) if levels > 0 else 0.0

    def cycle(self, nodes: int, levels: int, catchup: int, context: int) -> float:
        return self.draft(levels, catchup) + self.verify(nodes, context)

    # ---- learning -----------------------------------------------------------------------------
    def observe(self, nodes: int, levels: int, catchup: int, context: int, draft_s: float, rest_s: float) -> float:
        """One cycle's measured seconds: its draft (levels > 0) and the rest of it. Returns the measured cycle's
        cost over the predicted one, minus 1 (before learning from it)."""
        predicted = self.cycle(nodes, levels, catchup, context)
        if not self.learn:
            return (draft_s + rest_s) / max(predicted, 1e-12) - 1.0
        L = context * PER_TOKEN
        if levels > 0:
            self._learn(self._draft, [1.0, levels - 1, max(catchup - 1, 0)], draft_s)
        if nodes == 0:
            if levels == 0:  # a draft that verified nothing still did a drafted cycle's bookkeeping: not plain
                self._learn(self._plain, [1.0, L], rest_s, pace=True)
        else:
            k = nodes + 1
            self._learn(self._verify, [1.0, k, L, k * L], rest_s)
        return (draft_s + rest_s) / max(predicted, 1e-12) - 1.0

    def _learn(self, fit: LinearFit, x: list[float], seconds: float, pace: bool = False) -> None:
        shape = fit.at(*x)
        if pace and shape > 0:  # the pace first (one stall moves it at most 2 ** speed_rate), then the shape
            ratio = min(max(seconds / shape, self.speed / 2), self.speed * 2)
            self.speed *= (ratio / self.speed) ** self.speed_rate
        fit.observe(x, seconds / self.speed)

    def describe(self) -> dict[str, float]:
        """The starting point and the current fits, for reports."""
        p, v, d = ([self.speed * t for t in f.theta] for f in (self._plain, self._verify, self._draft))
        return {**self.start, "speed": self.speed, "plain_s_now": p[0], "plain_s_per_1k_context": p[1],
                "verify_s_now": v[0], "verify_s_per_token_now": v[1], "verify_s_per_1k_context": v[2],
                "verify_s_per_token_1k_context": v[3], "draft_step_s_now": d[0], "draft_level_s_now": d[1],
                "draft_catchup_s_per_token_now": d[2]}


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


@torch.no_grad()
def measure_target(target: Target, prompt: Sequence[int], sizes: Sequence[int] = SIZES,
                   repeats: int = 2) -> dict[int, float]:
    """Seconds for one target forward over k tokens after `prompt`, for k in sizes: {k: seconds}.

    Sizes are timed in interleaved rounds (best of `repeats`), so drift in machine speed hits all alike.
    The forwards are chains with eyas's mask, as a verify makes them; each is rolled back after timing."""
    dev = target.device
    cache = target.new_cache(1, len(prompt) + max(sizes))
    target(torch.tensor([list(prompt)], device=dev), cache=cache, logits=False)
    cache.commit([len(prompt)])
    clock = Stopwatch(dev)
    best = {k: float("inf") for k in sizes}
    for _ in range(repeats):
        for k in sizes:
            ids = torch.zeros(1, k, dtype=torch.long, device=dev)
            pos = cache.lengths[:, None] + torch.arange(k, device=dev)
            # a target that verifies chains only does so with its own masks (allowed None), as the generator does
            chain = k == 1 or target.verify_mode() == "chain"
            allowed = None if chain else after_history(cache.lengths, causal(k, dev)[None], cache.width + k)
            synchronize(dev)
            start = clock.mark()
            target(ids, pos, cache, allowed)
            end = clock.mark()
            best[k] = min(best[k], clock.between(start, end))
            cache.rollback()
    return best


def calibrate(target: Target, drafter, prompt: Sequence[int], depth: int) -> CostModel:
    """The starting cost model of a cycle on this machine, measured on scratch caches filled with `prompt`."""
    from .drafter import DraftContext

    # the draft's catch-up needs one token before the root: a one-token prompt is timed as two of it (the costs
    # are refit from the real cycles as they run)
    prompt = list(prompt) * (2 if len(prompt) < 2 else 1)
    costs = measure_target(target, prompt)
    plain_s = costs.pop(1)
    a, b = fit_cost(costs)
    dev = target.device
    # a cycle's draft: the catch-up over one accepted token, then the rest of the draft (depth - 1 levels of a tree,
    # or one forward over the block)
    ids = torch.tensor([list(prompt)], device=dev)
    features = target(ids[:, :-1], logits=False, layer_ids=drafter.head.reads(target.num_layers)).features
    n = ids.shape[1] - 1
    drafter.reset(1, len(prompt) + 2 * depth + 4)
    # untimed: the prompt
    drafter.draft(DraftContext(ids[:, 1:], features, torch.arange(n, device=dev)[None], [n]), depth)
    last = DraftContext(ids[:, -1:], features[:, -1:], torch.tensor([[n]], device=dev), [1])
    clock = Stopwatch(dev)
    synchronize(dev)
    start = clock.mark()
    drafted = drafter.draft(last, depth)
    end = clock.mark()
    model = CostModel(a, b, plain_s, clock.between(start, end) / drafted.forwards)
    logger.info("cycle costs on this machine to start from: plain forward %.1f ms, verify %.1f ms + %.2f ms/token, "
                "draft step %.1f ms", 1e3 * plain_s, 1e3 * a, 1e3 * b, 1e3 * model.start["draft_step_s"])
    return model
