"""`total_tokens="auto"`: each cycle's tree chosen from the head's own confidence and what a cycle costs here,
with a guarantee: decoding is never more than a set margin slower than plain decoding.

EAGLE-2's observation: a draft node's confidence (its path probability under the head) predicts whether
the target will accept it. A cycle that drafts `levels` levels and verifies n nodes costs a draft plus a
verify forward over n + 1 tokens (costs.CostModel, refit from every cycle's measured times), and gains
1 + Σ P(node accepted) tokens. So, every cycle:
- the head drafts level by level while the next level is expected to pay for its draft step (what a
  level earns, net of its nodes' verify cost, per unit of its frontier's acceptance probability, is
  learned from the levels drafted so far);
- the n candidates with the highest confidence are verified, n chosen to maximise
  gain - λ * cost, where λ is the tokens per second decoding runs at (a cycle is worth running when it
  beats what the same seconds earn on average; policy iteration on this rate maximises tokens/s);
  n = 0 is plain decoding (the root alone, a cheaper forward). An n-gram lookup branch (lookup.py)
  competes for the same verify forward: its tokens are added while their expected gain pays for them.
Confidences are calibrated online (a head is over- or underconfident, and acceptance moves with the
text): per confidence bin, the decayed share of candidates that lay on the continuation the target
produced. When drafting stops paying (the tree's advantage over plain decoding is worth less than the
draft), cycles skip the head and verify the root alone, with a probe draft at doubling intervals to
notice when that changes.

The guarantee (the guard). Per generation the planner keeps an account in modelled seconds: `excess`,
what the speculative cycles cost beyond what plain decoding would have spent on the tokens they gained
(negative while speculation wins), against an allowance of `margin` times the plain-decoding time of
the prompt and every token so far plus `slack` plain cycles. A cycle may draft, and may verify nodes or a lookup branch,
only if its worst case (nothing accepted: all its extra seconds lost) still fits in the allowance. So
whatever the head or the text, a generation spends at most a share `margin` (plus `slack` plain cycles)
beyond plain decoding, and a head that wins is never held back. The costs are the machine's own, refit
as it runs, so the account follows what the machine actually does.

Inputs and decisions are explicit: `begin()` per generation; `plan(context, catch-up)` before each cycle returns
its CyclePlan: `draft` (whether the head runs), then, as the cycle learns more, `keep_drafting(frontier scores)`,
`choose(candidate scores, head forwards)` (how many nodes are verified) and `lookup_sizes(head nodes)` (the n-gram
branch), spending the plan's own allowance. After verifying, `observe(...)`, `observe_levels(...)`,
`observe_lookup(...)` and `observe_cycle(plan, ...)` teach the planner; only they (and `plan`'s probe schedule)
change it.
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
    branch is; learned from the cycles so far, within the guard's allowance.

    costs: what the parts of a cycle cost (costs.CostModel), refit by every cycle. Calibration: per bin of
    log confidence, decayed counts of candidates and of those on the target's continuation, plus `weight`
    pseudo-counts at the raw confidence scaled by how over- or underconfident the head has been overall;
    the table is fitted non-decreasing in confidence.

    N-gram lookup branches (lookup.py) get their own per-position acceptance for each match length n
    (decayed, prior `lookup_prior`): in prose a one-token match is mostly noise while a three-token one
    is often copied text, and one shared rate would cut the long branches short or pay for the noise.

    margin, slack: the guard's allowance (module docstring): the share of plain-decoding time speculation
    may lose at worst, and how many plain cycles' worth it may risk before it has gained anything;
    stall: a cycle measured slower than this many times its modelled cost counts as that (a stall elsewhere).
    """

    def __init__(self, costs: CostModel, max_depth: int, top_k: int = 4, decay: float = 0.995, weight: float = 4.0,
                 rate_decay: float = 0.98, max_probe: int = 64, lookup_max: int = 8, lookup_prior: float = 0.5,
                 max_ngram: int = MAX_NGRAM, margin: float = 0.01, slack: float = 0.5, stall: float = 4.0) -> None:
        self.costs = costs
        self.max_depth, self.top_k = max_depth, top_k
        self.decay, self.weight, self.rate_decay, self.max_probe = decay, weight, rate_decay, max_probe
        self.margin, self.slack, self.stall = margin, slack, stall
        self.seen = np.zeros(len(CONF_BINS) + 1)  # decayed candidates per confidence bin
        self.hits = np.zeros(len(CONF_BINS) + 1)  # ... of which lay on the target's continuation
        plain = costs.verify(0, 0)
        self.tokens, self.seconds = 1.0, plain  # decayed sums over cycles: the rate λ = tokens / seconds
        # decayed tokens a drafted cycle's tree was expected to gain over plain decoding; it starts at twice
        # what a draft step costs, so the first cycles draft and learn how good the head is
        self.advantage = 2 * costs.draft(2, 1) / plain
        # decayed sums over drafted levels: net tokens a level's nodes earned, and its frontier's acceptance
        # mass; their ratio starts at 1, the bound (children's acceptance sums to at most their parent's)
        self.level_earned, self.level_mass = 1.0, 1.0
        self.probe, self.since_probe = 2, 0
        self.plain_every, self.since_plain = 16, 0  # a plain cycle at least this often: the guard's yardstick
        # what a drafting cycle typically drafts and verifies (decayed means): its worst case for the guard
        self.typical_levels, self.typical_nodes = 2.0, float(top_k)
        self.lookup_prior = lookup_prior
        self.lookup_reached = np.zeros((max_ngram, lookup_max))  # decayed counts per (match length n-1, position)
        self.lookup_passed = np.zeros((max_ngram, lookup_max))
        self.record: list[dict[str, float]] | None = None  # set to a list to keep every cycle's inputs and times
        self.begin()

    # ---- the guard ----------------------------------------------------------------------------
    def begin(self, prefill_s: float = 0.0) -> None:
        """A new generation, its prompt prefilled in `prefill_s` seconds: its own account (what was learned about
        the head and the machine stays). The prefill is part of what plain decoding would spend as well."""
        self.excess = 0.0  # seconds speculative cycles spent beyond plain decoding of their tokens
        self.plain_equivalent = prefill_s  # seconds plain decoding would have spent on the prompt and every token

    def allowance(self, context: int) -> float:
        """Seconds the next cycle, at `context` tokens, may lose at worst without breaking the guarantee."""
        plain = self.costs.verify(0, context)
        return self.margin * self.plain_equivalent + self.slack * plain - self.excess

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

    # ---- decisions ----------------------------------------------------------------------------
    def plan(self, context: int, catchup: int) -> "CyclePlan":
        """The plan of the next cycle, `context` tokens in the cache and `catchup` of them not yet seen by the head:
        whether the head drafts, and the allowance its later decisions (CyclePlan) spend.
        Draft while its trees beat plain decoding by more than the draft costs; otherwise only as a probe, at
        intervals that double while drafting keeps not paying; never beyond the guard's allowance; and never
        for long without a plain cycle (`plain_every`, doubling while the cost model predicts them right),
        what the guard measures speculation against."""
        self.since_plain += 1
        if self.since_plain > self.plain_every:  # measure plain decoding again: it is what the guard measures against
            return CyclePlan(self, context, catchup, draft=False, left=-1.0)
        left = self.allowance(context)
        c = self.costs
        draft = c.draft(round(self.typical_levels), catchup)
        worst = draft + c.verify(round(self.typical_nodes), context) - c.verify(0, context)
        if worst > left:  # a probe waits until it is affordable
            return CyclePlan(self, context, catchup, draft=False, left=left)
        if self.advantage >= self.rate * draft:
            return CyclePlan(self, context, catchup, draft=True, left=left)
        self.since_probe += 1
        if self.since_probe < self.probe:
            return CyclePlan(self, context, catchup, draft=False, left=left)
        self.since_probe, self.probe = 0, min(2 * self.probe, self.max_probe)
        return CyclePlan(self, context, catchup, draft=True, left=left)

    # ---- learning -----------------------------------------------------------------------------
    def observe_levels(self, levels: Sequence[tuple[np.ndarray, np.ndarray]], context: int) -> None:
        """The levels a draft made below its first: (frontier scores [B, F] of the nodes expanded, scores [B, C] of
        their children), as draft log-probabilities; `context` tokens were in the cache."""
        per_node = self.costs.verify(2, context) - self.costs.verify(1, context)
        for frontier, children in levels:
            frontier_conf, children_conf = np.exp(frontier), np.exp(children)
            net = np.maximum(0.0, self.accept_prob(children_conf) - self.rate * per_node).sum(1).mean()
            self.level_earned = self.rate_decay * self.level_earned + float(net)
            self.level_mass = self.rate_decay * self.level_mass + float(self.accept_prob(frontier_conf).sum(1).mean())

    def observe(self, conf: np.ndarray, on_path: np.ndarray) -> None:
        """Candidates with confidence conf [K] whose fate is known, on_path [K] whether each lay on the target's
        continuation."""
        self.seen *= self.decay
        self.hits *= self.decay
        i = _bin(conf)
        np.add.at(self.seen, i, 1.0)
        np.add.at(self.hits, i, on_path.astype(float))

    def observe_cycle(self, plan: "CyclePlan", nodes: int, levels: int, tokens: float, draft_s: float,
                      rest_s: float) -> None:
        """One cycle run by `plan`: the draft nodes it verified (head and lookup), the head forwards its draft took
        (0: none), tokens gained (mean per row), and its measured seconds: the draft, and the rest of the cycle."""
        c, context, catchup = self.costs, plan.context, plan.catchup
        if plan.advantage is not None:  # what the draft's tree was worth over plain decoding, as the plan judged it
            self.advantage = 0.9 * self.advantage + 0.1 * plan.advantage
            if self.advantage >= self.rate * c.draft(levels, catchup):
                self.probe = 2
        if self.record is not None:  # what a replay needs to refit this machine's costs (benchmarks/replay.py)
            self.record.append(dict(nodes=nodes, levels=levels, catchup=catchup, context=context,
                                    tokens=tokens, draft_s=draft_s, rest_s=rest_s))
        surprise = abs(c.observe(nodes, levels, catchup, context, draft_s, rest_s))
        if not nodes and not levels:  # a plain cycle: re-measured less often while the model keeps agreeing
            self.plain_every = min(2 * self.plain_every, 256) if surprise < 0.1 else 16
            self.since_plain = 0
        elif surprise > 0.25:  # the machine may have changed pace: measure plain decoding again soon
            self.plain_every = min(self.plain_every, 16)
        seconds = c.cycle(nodes, levels, catchup, context)
        plain = c.verify(0, context)
        self.tokens = self.rate_decay * self.tokens + tokens
        self.seconds = self.rate_decay * self.seconds + seconds
        self.plain_equivalent += tokens * plain
        if levels or nodes:
            # the account takes what the cycle measured (a cost model still learning this machine must not
            # hide a loss), short of a stall elsewhere on the machine (at most `stall` times the model)
            self.excess += min(draft_s + rest_s, self.stall * seconds) - tokens * plain
        if levels:
            self.typical_levels = 0.9 * self.typical_levels + 0.1 * levels
            self.typical_nodes = 0.9 * self.typical_nodes + 0.1 * nodes

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


class CyclePlan:
    """One cycle's decisions, made as the cycle learns more (the head's scores after it drafted); it reads the
    planner's learned state and changes none of it (observe_cycle learns from what the plan judged).

    draft: the head drafts this cycle; left: the seconds the cycle may still lose at worst (the guard's allowance),
    spent by the levels drafted and the nodes verified; advantage: what the chosen tree was judged worth over plain
    decoding (tokens, net of its verify cost), None until `choose`."""

    def __init__(self, planner: Planner, context: int, catchup: int, draft: bool, left: float) -> None:
        self.planner, self.context, self.catchup, self.draft, self.left = planner, context, catchup, draft, left
        self.levels = 1
        self.advantage: float | None = None

    def keep_drafting(self, frontier_scores: torch.Tensor) -> bool:
        """Draft one more level? frontier_scores [B, F]: the draft log-probabilities of the nodes it would expand
        (one read of the device). Not beyond the allowance: the levels drafted are spent whatever is verified."""
        p, c = self.planner, self.planner.costs
        self.levels += 1
        if c.draft(self.levels, self.catchup) > self.left:
            return False
        mass = float(p.accept_prob(frontier_scores.float().exp().cpu().numpy()).sum(1).mean())
        step = c.draft(2, self.catchup) - c.draft(1, self.catchup)
        return mass * p.level_earned / p.level_mass >= p.rate * step

    def choose(self, scores: torch.Tensor, forwards: int) -> int:
        """How many candidates to verify (the most confident; one count for the batch, 0 = plain decoding).
        scores [B, M]: every candidate's draft log-probability (its path confidence is exp(score); one read of the
        device); forwards: the head forwards the draft took (spent whatever is verified)."""
        p, c = self.planner, self.planner.costs
        conf = scores.float().exp().cpu().numpy()
        accept = -np.sort(-p.accept_prob(conf), axis=1)  # [B, M] descending
        gain = np.concatenate([[0.0], np.cumsum(accept, axis=1).mean(0)])  # [M + 1] expected extra tokens
        cost = c.verify(np.arange(len(gain)), self.context)
        value = gain - p.rate * cost
        self.advantage = float(value.max() - value[0])
        self.left -= c.draft(forwards, self.catchup)  # spent
        affordable = cost - cost[0] <= max(self.left, 0.0)  # worst case: none of them accepted
        best = int(np.argmax(np.where(affordable, value, -np.inf)))
        self.left -= cost[best] - cost[0]
        return best

    def lookup_sizes(self, head_nodes: int) -> list[int]:
        """How many tokens of a lookup branch to graft onto a tree of `head_nodes` draft nodes, per match length
        n = 1..max_ngram: the most expected tokens net of their verify cost (0: the branch does not pay),
        within what is left of the allowance. (Plain Python: it runs every cycle, plain ones too.)"""
        p = self.planner
        length, w, rate = p.lookup_reached.shape[1], p.weight, p.rate
        base = p.costs.verify(head_nodes, self.context)
        extra = [p.costs.verify(head_nodes + m, self.context) - base for m in range(length + 1)]
        left = max(self.left, 0.0)
        sizes = []
        for reached, passed in zip(p.lookup_reached.tolist(), p.lookup_passed.tolist()):
            reach, gain, best, best_value = 1.0, 0.0, 0, 0.0
            for m in range(1, length + 1):
                if extra[m] > left:
                    break
                reach *= (passed[m - 1] + w * p.lookup_prior) / (reached[m - 1] + w)  # P(the first m accepted)
                gain += reach
                if gain - rate * extra[m] > best_value:
                    best, best_value = m, gain - rate * extra[m]
            sizes.append(best)
        return sizes


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
