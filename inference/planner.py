"""`total_tokens="auto"`: each cycle's tree chosen from the head's own confidence and what a forward costs here.

EAGLE-2's observation: a draft node's confidence (its path probability under the head) predicts whether
the target will accept it. A cycle that drafts to depth d and verifies n nodes costs d draft steps plus
a verify forward over n + 1 tokens, and gains 1 + Σ P(node accepted) tokens. So, every cycle:
- the head drafts level by level while the next level is expected to pay for its draft step (what a
  level earns, net of its nodes' verify cost, per unit of its frontier's acceptance probability, is
  learned from the levels drafted so far);
- the n candidates with the highest confidence are verified, n chosen to maximise
  gain - λ * cost, where λ is the tokens per second decoding runs at (a cycle is worth running when it
  beats what the same seconds earn on average; policy iteration on this rate maximises tokens/s);
  n = 0 is plain decoding (the root alone, a cheaper forward).
Confidences are calibrated online (a head is over- or underconfident, and acceptance moves with the
text): per confidence bin, the decayed share of candidates that lay on the continuation the target
produced. When drafting itself stops paying (the tree's advantage over plain decoding is worth less
than a draft step), cycles skip the head and verify the root alone, with a probe draft at doubling
intervals to notice when that changes.

What a forward and a draft step cost comes from the CostModel (costs.py). Inputs and outputs are explicit:
before drafting `should_draft()`; while drafting `keep_drafting(frontier scores)`; after drafting
`choose(candidate scores)` (how many nodes are verified) and `lookup_tokens(...)` (the n-gram branch);
after verifying `observe(...)`, `observe_levels(...)` and `observe_lookup(...)`.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np
import torch

from .costs import CostModel
from .lookup import MAX_NGRAM

CONF_BINS = np.linspace(np.log(1e-3), 0.0, 13)  # edges of the calibration bins over log confidence


class Planner:
    """Per cycle: whether the head drafts, how deep, how many of its nodes are verified, how long a lookup
    branch is; learned from the cycles so far.

    costs: what a verify forward, a plain forward and a draft step cost (costs.CostModel). Calibration: per bin of log confidence, decayed counts of
    candidates and of those on the target's continuation, plus `weight` pseudo-counts at the raw
    confidence scaled by how over- or underconfident the head has been overall; the table is fitted
    non-decreasing in confidence.

    N-gram lookup branches (lookup.py) get their own per-position acceptance for each match length n
    (decayed, prior `lookup_prior`): in prose a one-token match is mostly noise while a three-token one
    is often copied text, and one shared rate would cut the long branches short or pay for the noise.
    """

    def __init__(self, costs: CostModel, max_depth: int, top_k: int = 4, decay: float = 0.995, weight: float = 4.0,
                 rate_decay: float = 0.98, max_probe: int = 64, lookup_max: int = 8, lookup_prior: float = 0.5,
                 max_ngram: int = MAX_NGRAM) -> None:
        self.costs = costs
        self.verify_cost = (costs.verify_s, costs.verify_s_per_token)
        self.step_s, self.plain_s = costs.draft_step_s, costs.plain_s
        self.max_depth, self.top_k = max_depth, top_k
        self.decay, self.weight, self.rate_decay, self.max_probe = decay, weight, rate_decay, max_probe
        self.seen = np.zeros(len(CONF_BINS) + 1)  # decayed candidates per confidence bin
        self.hits = np.zeros(len(CONF_BINS) + 1)  # ... of which lay on the target's continuation
        self.tokens, self.seconds = 1.0, self.plain_s  # decayed sums over cycles: the rate λ = tokens / seconds
        # decayed tokens a drafted cycle's tree was expected to gain over plain decoding; it starts at twice
        # what a draft step costs, so the first cycles draft and learn how good the head is
        self.advantage = 2 * self.step_s / self.plain_s
        # decayed sums over drafted levels: net tokens a level's nodes earned, and its frontier's acceptance
        # mass; their ratio starts at 1, the bound (children's acceptance sums to at most their parent's)
        self.level_earned, self.level_mass = 1.0, 1.0
        self.probe, self.since_probe = 2, 0
        self.lookup_prior = lookup_prior
        self.lookup_reached = np.zeros((max_ngram, lookup_max))  # decayed counts per (match length n-1, position)
        self.lookup_passed = np.zeros((max_ngram, lookup_max))

    @property
    def rate(self) -> float:
        """λ: tokens per second of the cycles so far (by the cost model: noise-free and consistent)."""
        return self.tokens / self.seconds

    def accept_prob(self, conf: np.ndarray) -> np.ndarray:
        """Calibrated acceptance probability of draft nodes with path confidence `conf` (any shape)."""
        # A bin with few observations leans on its raw confidence scaled by how over- or underconfident the
        # head has been overall; the table is then fitted non-decreasing in confidence (isotonic).
        scale = (self.hits.sum() + self.weight) / ((self.seen * _BIN_CONF).sum() + self.weight)
        prior = np.minimum(1.0, _BIN_CONF * scale)
        table = _isotonic((self.hits + self.weight * prior) / (self.seen + self.weight), self.seen + self.weight)
        return table[_bin(conf)]

    def cost(self, nodes: int, steps: int) -> float:
        """Seconds of a cycle that ran `steps` draft steps and verifies `nodes` draft nodes (0: plain)."""
        a, b = self.verify_cost
        return steps * self.step_s + (self.plain_s if nodes == 0 else a + b * (nodes + 1))

    # ---- decisions ----------------------------------------------------------------------------
    def should_draft(self) -> bool:
        """Run the head this cycle? Yes while its trees beat plain decoding by more than a draft step
        costs; otherwise only as a probe, at intervals that double while drafting keeps not paying."""
        if self.advantage >= self.rate * self.step_s:
            return True
        self.since_probe += 1
        if self.since_probe < self.probe:
            return False
        self.since_probe, self.probe = 0, min(2 * self.probe, self.max_probe)
        return True

    def keep_drafting(self, frontier_scores: torch.Tensor) -> bool:
        """Draft one more level? frontier_scores [B, F]: the draft log-probabilities of the nodes it would expand."""
        mass = float(self.accept_prob(frontier_scores.float().exp().cpu().numpy()).sum(1).mean())
        return mass * self.level_earned / self.level_mass >= self.rate * self.step_s

    def choose(self, scores: torch.Tensor) -> int:
        """How many candidates to verify (the most confident; one count for the batch, 0 = plain decoding).
        scores [B, M]: every candidate's draft log-probability (its path confidence is exp(score))."""
        conf = scores.float().exp().cpu().numpy()
        a, b = self.verify_cost
        p = -np.sort(-self.accept_prob(conf), axis=1)  # [B, M] descending
        gain = np.concatenate([[0.0], np.cumsum(p, axis=1).mean(0)])  # [M + 1] expected extra tokens
        n = np.arange(len(gain))
        value = gain - self.rate * np.where(n == 0, self.plain_s, a + b * (n + 1))
        best = int(np.argmax(value))
        self.advantage = 0.9 * self.advantage + 0.1 * float(value[best] - value[0])
        if self.advantage >= self.rate * self.step_s:
            self.probe = 2
        return best

    def lookup_tokens(self, head_nodes: int, ngram: int) -> int:
        """How many tokens of a lookup branch from an `ngram`-token match to graft onto a tree of `head_nodes`
        draft nodes: the most expected tokens net of their verify cost (0: the branch does not pay)."""
        if self.lookup_reached.shape[1] == 0 or ngram <= 0:
            return 0
        a, b = self.verify_cost
        w = self.weight
        i = min(ngram, len(self.lookup_reached)) - 1
        rate = (self.lookup_passed[i] + w * self.lookup_prior) / (self.lookup_reached[i] + w)  # P(j+1 | j) per position
        gain = np.concatenate([[0.0], np.cumsum(np.cumprod(rate))])  # [L+1] expected extra tokens
        n = np.arange(len(gain))
        base = self.plain_s if head_nodes == 0 else a + b * (head_nodes + 1)
        cost = np.where(n == 0, base, a + b * (head_nodes + n + 1)) - base
        return int(np.argmax(gain - self.rate * cost))

    # ---- learning -----------------------------------------------------------------------------
    def observe_levels(self, levels: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The levels a draft made below its first: (frontier scores [B, F] of the nodes expanded, scores [B, C] of
        their children), as draft log-probabilities."""
        for frontier, children in levels:
            frontier_conf, children_conf = frontier.float().exp().cpu().numpy(), children.float().exp().cpu().numpy()
            net = np.maximum(0.0, self.accept_prob(children_conf) - self.rate * self.verify_cost[1]).sum(1).mean()
            self.level_earned = self.rate_decay * self.level_earned + float(net)
            self.level_mass = self.rate_decay * self.level_mass + float(self.accept_prob(frontier_conf).sum(1).mean())

    def observe(self, conf: np.ndarray, on_path: np.ndarray, tokens: float, seconds: float) -> None:
        """One cycle: candidates with confidence conf [K] whose fate is known, on_path [K] whether each lay on
        the target's continuation; tokens gained (mean per row) and the cycle's modelled seconds."""
        self.seen *= self.decay
        self.hits *= self.decay
        i = _bin(conf)
        np.add.at(self.seen, i, 1.0)
        np.add.at(self.hits, i, on_path.astype(float))
        self.tokens = self.rate_decay * self.tokens + tokens
        self.seconds = self.rate_decay * self.seconds + seconds

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

    def describe(self) -> dict[str, float]:
        """The cost model and where decoding stands, for reports."""
        return {**self.costs.describe(), "tokens_per_s_model": self.rate}


_BIN_CONF = np.exp(np.concatenate([[CONF_BINS[0] - 1], (CONF_BINS[1:] + CONF_BINS[:-1]) / 2, [0.0]]))  # bin centres


def _bin(conf: np.ndarray) -> np.ndarray:
    return np.searchsorted(CONF_BINS, np.log(np.maximum(np.asarray(conf, dtype=float), 1e-12)))


def _isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to y in weighted least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, u in zip(y, w):
        blocks.append([float(v), float(u), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (v2, u2, n2), (v1, u1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(v1 * u1 + v2 * u2) / (u1 + u2), u1 + u2, n1 + n2])
    return np.concatenate([np.full(n, v) for v, _, n in blocks])
