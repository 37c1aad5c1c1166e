"""The planner: which cycles draft, how many nodes they verify, what the cost model learns, and the guard that keeps
decoding within its margin of plain decoding whatever the head."""

import numpy as np
import pytest
import torch

from eyas.inference.costs import CostModel, LinearFit, fit_cost
from eyas.inference.planner import Planner
from eyas.inference.tree import DraftTree, on_continuation


def _planner(costs=None, **kw) -> Planner:
    """Verify a + b k with a = 1, b = 0.1; plain forward 1.0; a draft step 0.05 (seconds), kept fixed."""
    return Planner(costs or CostModel(1.0, 0.1, 1.0, 0.05, learn=False), **{"max_depth": 4, **kw})


def log(conf) -> torch.Tensor:
    """Path confidences -> the draft log-probabilities the planner is given."""
    return torch.log(torch.as_tensor(conf, dtype=torch.float64))


class Machine:
    """A simulated machine and head: what cycles really cost, and how many of their drafts the target accepts."""

    def __init__(self, plain=1.0, verify=(1.0, 0.1), step=0.05, accept=0.0, conf=0.5, nodes=8, seed=0):
        self.plain, self.verify, self.step = plain, verify, step
        self.accept, self.conf, self.nodes = accept, conf, nodes
        self.rng = np.random.default_rng(seed)

    def run(self, planner: Planner, tokens: int, context: int = 200) -> tuple[float, list[tuple[int, int]]]:
        """Decode `tokens` tokens; returns (seconds, (levels drafted, nodes verified) per cycle)."""
        seconds, done, cycles = 0.0, 0, []
        planner.begin()
        while done < tokens:
            nodes, levels, gained, draft_s = 0, 0, 1, 0.0
            plan = planner.plan(context + done, 1)
            if plan.draft:
                levels = 2
                scores = log(np.full((1, self.nodes), self.conf))
                nodes = plan.choose(scores, levels)
                draft_s = self.step * levels
                # each verified node is the next token with probability `accept` (a chain of the best guesses)
                while gained <= nodes and self.rng.random() < self.accept:
                    gained += 1
                planner.observe(np.full(self.nodes, self.conf), np.arange(self.nodes) < gained - 1)
            rest_s = self.plain if nodes == 0 else self.verify[0] + self.verify[1] * (nodes + 1)
            planner.observe_cycle(plan, nodes, levels, gained, draft_s, rest_s)
            seconds += draft_s + rest_s
            done += gained
            cycles.append((levels, nodes))
        return seconds, cycles


# ---- choosing ---------------------------------------------------------------------------------------
def test_planner_verifies_the_nodes_that_pay_for_their_verify_cost():
    planner = _planner(slack=100.0)  # the guard allows anything: this is the value of a tree alone
    rate = planner.rate
    sure, hopeless = np.full((1, 16), 0.999), np.full((1, 16), 1e-3)
    assert planner.plan(200, 1).choose(log(hopeless), 1) == 0  # plain decoding: no node is worth the wider forward
    assert planner.plan(200, 1).choose(log(sure), 1) == 16  # each sure node gains ~1 token for 0.1 s
    # falling confidences: stop where one more node gains less than its verify seconds earn at rate λ
    conf = np.array([[0.9, 0.6, 0.3, 0.05, 0.01]])
    p = planner.accept_prob(conf)[0]
    n = planner.plan(200, 1).choose(log(conf), 1)
    value = [0.0 - rate * 1.0] + [p[:k].sum() - rate * (1.0 + 0.1 * (k + 1)) for k in range(1, 6)]
    assert n == int(np.argmax(value)) and 0 < n < 5
    assert planner.plan(200, 1).choose(log(np.concatenate([conf, hopeless[:, :5]])), 1) <= n  # one count per batch


def test_planner_calibrates_confidence_from_what_the_target_accepted():
    planner = _planner(slack=100.0)
    conf = np.full(20, 0.8)
    assert planner.accept_prob(conf)[0] == pytest.approx(0.8, abs=0.1)  # prior: the raw confidence
    for _ in range(30):  # an overconfident head: nothing at 0.8 is ever on the target's continuation
        planner.observe(conf, np.zeros(20, bool))
    assert planner.accept_prob(conf)[0] < 0.05
    assert planner.plan(200, 1).choose(log(conf[None]), 1) == 0
    planner = _planner()
    for _ in range(30):  # an underconfident head: everything at 0.3 is accepted
        planner.observe(np.full(20, 0.3), np.ones(20, bool))
    probs = planner.accept_prob(np.array([0.01, 0.3, 0.8]))
    assert probs[1] > 0.9 and probs[2] >= probs[1]  # never less likely at a higher confidence
    for _ in range(10):  # contradicting evidence at 0.8 does not make it less likely than 0.3
        planner.observe(np.full(20, 0.8), np.zeros(20, bool))
    probs = planner.accept_prob(np.array([0.01, 0.3, 0.8]))
    assert list(probs) == sorted(probs)


def test_planner_drafts_while_it_pays_and_probes_while_it_does_not():
    planner = _planner(slack=100.0)

    def drafted(conf: float) -> None:  # a drafting cycle whose candidates all have confidence `conf`
        plan = planner.plan(200, 1)
        plan.choose(log(np.full((1, 8), conf)), 1)
        planner.observe_cycle(plan, 0, 1, 1.0, 0.05, 1.0)

    assert planner.plan(200, 1).draft  # optimistic start
    for _ in range(40):  # the head is hopeless: every cycle's best choice is plain decoding
        drafted(1e-3)
    gaps, since = [], 0
    for _ in range(60):  # drafting only as a probe, ever further apart
        since += 1
        plan = planner.plan(200, 1)
        if plan.draft:
            gaps.append(since)
            since = 0
            plan.choose(log(np.full((1, 8), 1e-3)), 1)
            planner.observe_cycle(plan, 0, 1, 1.0, 0.05, 1.0)
        else:
            planner.observe_cycle(plan, 0, 0, 1.0, 0.0, 1.0)
    assert len(gaps) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]
    for _ in range(5):  # a probe finds a confident head: drafting every cycle again
        drafted(0.999)
    assert all(planner.plan(200, 1).draft for _ in range(5))


def test_planner_stops_drafting_at_a_level_that_cannot_pay():
    planner = _planner(slack=100.0)
    frontier = np.array([[0.9, 0.5, 0.2, 0.1]])
    assert planner.plan(200, 1).keep_drafting(log(frontier))
    # the next level's nodes could at best add what their parents have: here far less than a step costs
    assert not planner.plan(200, 1).keep_drafting(log(np.full((1, 4), 1e-3)))
    for _ in range(50):  # levels below confident frontiers keep earning nothing: stop at the frontier
        planner.observe_levels([(np.log(frontier), np.log(np.full((1, 16), 1e-3)))], 200)
    assert not planner.plan(200, 1).keep_drafting(log(frontier))


def test_a_verify_that_grows_with_the_context_makes_trees_smaller_there():
    costs = CostModel(1.0, 0.02, 1.0, 0.05)
    for _ in range(60):  # this machine's verify: each node costs 0.02 s per thousand tokens of context more
        for context in (500, 2000, 4000):
            for nodes in (2, 6, 12):
                k = nodes + 1
                costs.observe(nodes, 1, 1, context, 0.05, 1.0 + 0.02 * k + 0.03 * k * context / 1000)
            costs.observe(0, 0, 1, context, 0.0, 1.0)
    assert costs.verify(8, 4000) > costs.verify(8, 500) + 0.8 * 0.03 * 9 * 3.5
    planner = _planner(costs, slack=100.0)
    conf = log(np.linspace(0.9, 0.02, 16)[None])
    short = planner.plan(300, 1).choose(conf, 1)
    assert 0 < planner.plan(6000, 1).choose(conf, 1) < short


# ---- the cost model ---------------------------------------------------------------------------------
def test_cost_model_follows_the_machine_ignores_a_stall_and_never_rewards_bigger_trees():
    costs = CostModel(0.5, 0.01, 0.4, 0.01)  # a calibration that underestimates this machine by half
    for i in range(80):
        nodes = 2 + i % 8
        costs.observe(nodes, 3, 1 + i % 4, 300, 0.02 + 0.02 * 2 + 0.01 * (i % 4), 1.0 + 0.05 * (nodes + 1))
        costs.observe(0, 0, 1, 300, 0.0, 0.8)
    assert costs.verify(6, 300) == pytest.approx(1.35, rel=0.03)
    assert costs.verify(0, 300) == pytest.approx(0.8, rel=0.03)
    assert costs.draft(3, 2) == pytest.approx(0.07, rel=0.05)
    before = costs.verify(6, 300)
    costs.observe(6, 3, 1, 300, 0.06, 40.0)  # another process stalled this cycle
    assert costs.verify(6, 300) < 1.2 * before
    fit = LinearFit([1.0, 0.1], [1.0, 8.0])
    for k, y in [(2, 3.0), (16, 1.0), (8, 2.0), (4, 2.5)] * 5:  # noise in which bigger forwards look cheaper
        fit.observe([1.0, k], y)
    assert fit.theta[1] >= 0.0


def test_fit_cost_is_affine_and_never_rewards_noise():
    assert fit_cost({1: 2.0, 2: 3.0, 4: 5.0}) == pytest.approx((1.0, 1.0))
    a, b = fit_cost({1: 3.0, 8: 1.0, 16: 1.0})  # a lucky big forward must not make big trees look free
    assert b == 0.0 and a == pytest.approx(5 / 3)


# ---- the guard --------------------------------------------------------------------------------------
@pytest.mark.parametrize("accept", [0.0, 0.3])
def test_a_head_that_does_not_pay_costs_at_most_the_margin(accept):
    """The calibration believed a verify costs what a plain step does; on this machine it costs twice as much,
    and the head is confident but (nearly) always wrong: decoding converges to plain, within the margin."""
    machine = Machine(plain=1.0, verify=(1.8, 0.05), step=0.1, accept=accept, conf=0.7)
    planner = _planner(CostModel(0.9, 0.01, 1.0, 0.02), margin=0.015, slack=1.0)
    worst_cycle = 0.1 * 4 + 1.8 + 0.05 * 9 - machine.plain  # the most one misjudged cycle can lose
    for tokens, misjudged in ((64, 1), (256, 0)):  # the second generation starts from what the first learned
        seconds, cycles = machine.run(planner, tokens)
        allowed = tokens * machine.plain * (1 + planner.margin) + planner.slack * machine.plain
        assert seconds <= allowed + misjudged * worst_cycle
        later = cycles[len(cycles) // 2:]
        assert sum(levels > 0 for levels, _ in later) <= 0.1 * len(later)  # mostly plain by now


def test_probes_of_a_hopeless_head_stay_within_the_margin():
    machine = Machine(plain=1.0, verify=(1.0, 0.1), step=0.1, accept=0.0, conf=1e-3)
    planner = _planner(CostModel(1.0, 0.1, 1.0, 0.1), margin=0.01, slack=1.0)
    seconds, cycles = machine.run(planner, 2000)
    assert seconds <= 2000 * (1 + planner.margin) + planner.slack
    probes = [i for i, (levels, _) in enumerate(cycles) if levels]
    gaps = np.diff(probes)
    assert len(probes) >= 10 and gaps[-5:].min() > gaps[:5].max()  # it keeps looking, ever less often


def test_a_good_head_is_never_held_back():
    machine = Machine(plain=1.0, verify=(1.0, 0.05), step=0.05, accept=0.8, conf=0.8)
    planner = _planner(CostModel(1.0, 0.05, 1.0, 0.05))
    seconds, cycles = machine.run(planner, 256)
    plain = [i for i, (_, nodes) in enumerate(cycles) if nodes == 0]
    assert plain and plain[0] > 0 and len(plain) <= 0.05 * len(cycles)  # all draft but a plain one now and then
    assert seconds < 0.6 * 256 * machine.plain and planner.excess < 0


def test_the_guard_caps_a_cycle_whose_worst_case_the_allowance_cannot_cover():
    planner = _planner(CostModel(1.0, 0.2, 1.0, 0.05, learn=False), slack=2.0, margin=0.0)
    sure = log(np.full((1, 16), 0.999))
    plan = planner.plan(200, 1)
    assert plan.draft
    # 16 sure nodes would pay (4.4 s for 17 tokens) but risk 3.4 s of an allowance of 2 s, 0.05 s of it drafted:
    # the most nodes whose verify adds at most 1.95 s to a plain step
    assert plan.choose(sure, 1) == 8
    plan = planner.plan(200, 1)
    assert plan.draft
    confident = log(np.full((1, 4), 0.99))
    assert plan.keep_drafting(confident) and plan.keep_drafting(confident)  # levels 2, 3: 0.15 s drafted
    plan.left = 0.17  # what remains of the allowance: a fourth level (0.2 s) would overspend it
    assert not plan.keep_drafting(confident)
    planner.begin()
    planner.excess = 5.0  # this generation has lost more than it may: plain decoding until it earns it back
    plan = planner.plan(200, 1)
    assert not plan.draft and plan.lookup_sizes(0) == [0, 0, 0]


def test_head_candidates_are_labelled_by_the_target_continuation():
    """Every candidate the head drafted (verified or not) is scored against the tokens that followed."""
    #            root  a   b   a.c  a.d  b.e  a.c.f
    tokens = torch.tensor([[9, 1, 2, 3, 4, 5, 6]])
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]])
    depth = torch.tensor([[0, 1, 1, 2, 2, 2, 3]])
    tree = DraftTree(tokens, parents, depth, torch.zeros(1, 7))
    # the target produced 1, 3 (then nothing known): a and a.c are on it; a.c.f is beyond it, undecided
    on, known = on_continuation(tree, torch.tensor([[1, 3, 0]]), torch.tensor([2]))  # left-aligned
    assert on.tolist() == [[True, True, False, True, False, False, False]]
    assert known.tolist() == [[True, True, True, True, True, True, False]]
    # only 2 known: b is on it; everything under a is known to be off it, b.e undecided
    on, known = on_continuation(tree, torch.tensor([[2, 0, 0]]), torch.tensor([1]))
    assert on.tolist() == [[True, False, True, False, False, False, False]]
    assert known.tolist() == [[True, True, True, True, True, False, True]]
