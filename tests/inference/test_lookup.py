"""N-gram lookup branches: found right, grafted right, and never change what greedy decoding outputs."""

import random

import pytest
import torch

from eyas.inference import SpeculativeGenerator, TreeOptions
from eyas.inference.lookup import MAX_NGRAM, NgramIndex, accepted_prefix, graft
from eyas.inference.tree import DraftTree
from tests.helpers.inference import NO_EOS, greedy, make_head
from tests.helpers.tiny import tiny_target


def test_ngram_index_finds_the_longest_latest_match():
    ids = [1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2, 3]
    assert NgramIndex(ids).continuation(2) == ([7, 8], 2)  # "2 3" last seen before 7 8 (latest wins over 9 9)
    assert NgramIndex(ids + [4]).continuation(3) == ([], 0)  # "4" never occurred before
    assert NgramIndex([5, 1, 2, 6, 1, 2], max_ngram=2).continuation(2) == ([6, 1], 2)
    assert NgramIndex([5, 1, 2, 6, 1, 2], max_ngram=1).continuation(2) == ([6, 1], 1)
    assert NgramIndex([1, 2, 3]).continuation(0) == ([], 0) and NgramIndex([1]).continuation(4) == ([], 0)


def test_ngram_index_grown_token_by_token_answers_as_a_scan_of_the_whole_sequence():
    rng = random.Random(0)
    ids = [rng.randrange(6) for _ in range(300)]  # a small alphabet: matches of every length, overlapping ones too
    index = NgramIndex(ids[:1])
    for end in range(2, len(ids) + 1):
        index.extend(ids[end - 1:end])
        assert index.continuation(4) == _scan(ids[:end], 4, MAX_NGRAM), end


def _scan(ids, num_tokens, max_ngram):
    """The definition: the tokens after the latest earlier occurrence of the last n tokens, longest n first."""
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == ids[len(ids) - n:]:
                return ids[start + n:start + n + num_tokens], n
    return [], 0


def _tree(rows):
    """rows: (tokens, parents) per row, same size."""
    tokens = torch.tensor([r[0] for r in rows])
    parents = torch.tensor([r[1] for r in rows])
    depth = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        depth[:, i] = depth.gather(1, parents[:, i:i + 1])[:, 0] + 1
    return DraftTree(tokens, parents, depth, torch.linspace(0, -1, tokens.numel()).view(tokens.shape))


def test_graft_shares_agreeing_nodes_and_pads_rows_to_one_size():
    tree = _tree([([10, 11, 12, 13], [-1, 0, 0, 1]),  # root 10: children 11, 12; 13 under 11
                  ([20, 21, 22, 23], [-1, 0, 1, 2])])  # a chain 20 21 22 23
    out = graft(tree, [[11, 13, 14], []])
    assert out.tokens[0].tolist() == [10, 11, 12, 13, 14]  # 11 and 13 were there: one new node
    assert out.parents[0].tolist() == [-1, 0, 0, 1, 3] and out.depth[0].tolist() == [0, 1, 1, 2, 3]
    assert out.tokens[1].tolist() == [20, 21, 22, 23, 23]  # padded under its last node (a leaf)
    assert out.parents[1].tolist() == [-1, 0, 1, 2, 3]
    assert torch.equal(out.scores[:, :4], tree.scores) and (out.scores[:, 4:] == 0).all()
    for b in range(2):  # siblings stay distinct, parents precede children
        pairs = [(int(p), int(t)) for p, t in zip(out.parents[b, 1:], out.tokens[b, 1:])]
        assert len(set(pairs)) == len(pairs)
        assert all(int(out.parents[b, i]) < i for i in range(1, out.size))
    assert accepted_prefix([5, 6, 7], [5, 6, 9, 7]) == 2 and accepted_prefix([5], []) == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lookup_keeps_greedy_identity_and_earns_tokens_on_repetitive_text(arch):
    target = tiny_target(arch)
    prompt = list(range(30, 42)) * 3  # the tiny random target tends to continue a pattern it saw
    ref = greedy(target, prompt, 40)
    taus = {}
    for lookup in (0, 8):
        gen = SpeculativeGenerator(target, make_head(target), TreeOptions(total_tokens=2, depth=1, lookup=lookup))
        res = gen.generate(prompt, max_new_tokens=40, **NO_EOS)
        assert res.tokens == ref
        taus[lookup] = res.stats.mean_accepted
    assert taus[8] > taus[0], taus


def test_planner_sizes_lookup_branches_by_the_match_length_they_came_from():
    from eyas.inference.costs import CostModel
    from eyas.inference.planner import Planner

    # plain decoding (no head nodes) on a machine where each extra verified token costs 5% of a forward
    planner = Planner(CostModel(1.0, 0.05, 1.0, 0.01, learn=False), max_depth=2, lookup_max=8, slack=100.0)
    prior = planner.plan(100, 1).lookup_sizes(0)
    assert prior[0] == prior[1] == prior[2] > 0  # nothing observed yet: every match length alike
    for _ in range(30):  # one-token matches are rejected at once, three-token ones copied to the end
        planner.observe_lookup([8, 8], [0, 8], [1, 3])
    one, two, three = planner.plan(100, 1).lookup_sizes(0)
    assert one == 0 and three == 8
    assert two == prior[1]  # a match length never seen keeps its prior
