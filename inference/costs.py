"""What a cycle costs on this machine: a target forward over k tokens, a plain one-token forward, a draft step.

`calibrate` measures them once, on a scratch cache filled with a real prompt (never the live one), and
returns a CostModel; the planner starts from it. Target forwards over k >= 2 tokens are fitted as
a + b * k: measured costs on a busy machine are noisy, and a two-parameter fit cannot reward a size for
a lucky timing. One-token forwards are timed apart (CPU kernels for one row differ). On a GPU the cost is
flat up to tens of tokens, so trees are large; on a CPU a few nodes.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch

from eyas.models import Target
from eyas.models.masks import after_history, causal

from .timing import Stopwatch, synchronize

logger = logging.getLogger(__name__)

SIZES = (1, 2, 4, 8, 16, 32)  # tokens per target forward that are timed: 1 = plain decoding, a tree verify >= 2


@dataclass(frozen=True)
class CostModel:
    verify_s: float  # a: fixed seconds of a verify forward over k >= 2 tokens ...
    verify_s_per_token: float  # b: ... plus this per token
    plain_s: float  # a one-token forward (plain decoding)
    draft_step_s: float  # one head forward (catch-up or one draft level)

    def verify(self, nodes: int) -> float:
        """Seconds of the target forward of a cycle that verifies `nodes` draft nodes (0: plain decoding)."""
        return self.plain_s if nodes == 0 else self.verify_s + self.verify_s_per_token * (nodes + 1)

    def describe(self) -> dict[str, float]:
        return asdict(self)


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
            allowed = None if k == 1 else after_history(cache.lengths, causal(k, dev)[None], cache.width + k)
            synchronize(dev)
            start = clock.mark()
            target(ids, pos, cache, allowed)
            end = clock.mark()
            best[k] = min(best[k], clock.between(start, end))
            cache.rollback()
    return best


def calibrate(target: Target, drafter, prompt: Sequence[int], depth: int) -> CostModel:
    """The cost model of a cycle on this machine, measured on scratch caches filled with `prompt`."""
    from .drafter import DraftContext

    costs = measure_target(target, prompt)
    plain_s = costs.pop(1)
    a, b = fit_cost(costs)
    dev = target.device
    # a cycle's draft: the catch-up over one accepted token, then depth - 1 levels
    ids = torch.tensor([list(prompt)], device=dev)
    out = target(ids[:, :-1], logits=False, layer_ids=drafter.head.config.fused_layer_ids)
    features = out.features if drafter.head.config.fused_layer_ids else out.hidden
    n = ids.shape[1] - 1
    drafter.reset(1, len(prompt) + 2 * depth + 4)
    drafter.draft(DraftContext(ids[:, 1:], features, torch.arange(n, device=dev)[None], [n]), depth)  # untimed: the prompt
    last = DraftContext(ids[:, -1:], features[:, -1:], torch.tensor([[n]], device=dev), [1])
    clock = Stopwatch(dev)
    synchronize(dev)
    start = clock.mark()
    drafter.draft(last, depth)
    end = clock.mark()
    model = CostModel(a, b, plain_s, clock.between(start, end) / depth)
    logger.info("cycle costs on this machine: plain forward %.1f ms, verify %.1f ms + %.2f ms/token, draft step %.1f ms",
                1e3 * plain_s, 1e3 * a, 1e3 * b, 1e3 * model.draft_step_s)
    return model
