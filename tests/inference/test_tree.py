import pytest
import torch

from eyas.inference.acceptance import accept
from eyas.inference.drafter import Candidates, StaticExpansion, TreeOptions
from eyas.inference.tree import DraftTree, ancestor_mask, chain_paths, path_to
from eyas.models.masks import after_history

#        0
#      /   \
#     1     2
#    / \    |
#   3   4   5
#   |
#   6
PARENTS = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]])
DEPTH = torch.tensor([[0, 1, 1, 2, 2, 2, 3]])


def test_ancestor_mask_literal():
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(ancestor_mask(PARENTS, 3)[0], expected)


def test_chain_mask_is_causal():
    parents = torch.tensor([[-1, 0, 1, 2]])
    assert torch.equal(ancestor_mask(parents, 3)[0], torch.ones(4, 4, dtype=torch.bool).tril())


def test_tree_mask_after_rows_of_different_lengths_literal():
    lengths = torch.tensor([2, 1])  # row 1 is one token shorter: its tree starts a column earlier
    anc = ancestor_mask(torch.tensor([[-1, 0, 0]]).expand(2, -1), 1)
    allowed = after_history(lengths, anc, 2 + 3)
    assert allowed[0].int().tolist() == [[1, 1, 1, 0, 0],
                                         [1, 1, 1, 1, 0],
                                         [1, 1, 1, 0, 1]]
    assert allowed[1].int().tolist() == [[1, 1, 0, 0, 0],
                                         [1, 1, 1, 0, 0],
                                         [1, 1, 0, 1, 0]]


def test_path_to_is_left_aligned():
    anc = ancestor_mask(PARENTS.expand(2, -1), 3)
    paths = path_to(anc, torch.tensor([6, 5]), 4)
    assert paths.tolist() == [[0, 1, 3, 6], [0, 2, 5, 5]]


def _tree(tokens):
    return DraftTree(torch.tensor([tokens]), PARENTS, DEPTH, torch.zeros(1, 7))


def test_accept_follows_the_target_choice_into_second_children():
    tree = _tree([9, 10, 11, 12, 13, 14, 15])
    # the target wants 11 after the root (node 2), then 14 (node 5), then 7 (no such child: bonus)
    y = torch.tensor([[11, 0, 14, 0, 0, 7, 0]])
    acc = accept(tree, y, tree.ancestors())
    # the path is padded with its last node to the tree's height + 1 (known without reading the device)
    assert acc.path.tolist() == [[0, 2, 5, 5]] and acc.length.tolist() == [3] and acc.bonus.tolist() == [7]


def test_accept_nothing_gives_the_bonus_at_the_root():
    tree = _tree([9, 10, 11, 12, 13, 14, 15])
    y = torch.tensor([[3, 12, 0, 0, 0, 0, 0]])  # 12 would match node 3, but node 1 is not accepted
    acc = accept(tree, y, tree.ancestors())
    assert acc.path.tolist() == [[0, 0, 0, 0]] and acc.length.tolist() == [1] and acc.bonus.tolist() == [3]


def test_accept_full_depth():
    tree = _tree([9, 10, 11, 12, 13, 14, 15])
    y = torch.tensor([[10, 12, 0, 15, 0, 0, 4]])
    acc = accept(tree, y, tree.ancestors())
    assert acc.path.tolist() == [[0, 1, 3, 6]] and acc.length.tolist() == [4] and acc.bonus.tolist() == [4]


def test_static_expansion_structure():
    exp = StaticExpansion(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    logq = torch.log_softmax(torch.tensor([[[0.0, 3.0, 2.0, 1.0]]]), -1)  # ranks: 1, 2, 3, 0
    parent, ids, score = exp.children(0, logq, torch.zeros(1, 1))
    assert parent.tolist() == [[0, 0]] and ids.tolist() == [[1, 2]]
    assert exp.frontier(0, score).tolist() == [[0, 1]]  # both depth-1 nodes have children
    parent, ids, _ = exp.children(1, logq.expand(1, 2, 4), score)
    assert parent.tolist() == [[0, 0, 1]] and ids.tolist() == [[1, 2, 1]]
    assert exp.frontier(1, score).tolist() == [[0]]


def test_best_candidates_keep_every_parent():
    # candidates in creation order: two children of the root, then children of the first (lower scores)
    scores = torch.tensor([[-0.1, -2.0, -0.3, -0.3, -2.5, -3.0]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    c = Candidates(torch.tensor([9]), torch.arange(10, 16)[None], parents, scores, torch.tensor([[1, 1, 2, 2, 2, 2]]))
    tree = c.best(3)
    assert tree.tokens.tolist() == [[9, 10, 12, 13]] and tree.parents.tolist() == [[-1, 0, 1, 1]]
    assert c.chain().tokens.tolist() == [[9, 10, 12]]  # the most confident child at each level


def test_tree_options_errors():
    with pytest.raises(ValueError, match="kind"):
        TreeOptions(kind="bushy")
    with pytest.raises(ValueError, match="parent path"):
        TreeOptions(kind="static", paths=((0,), (1, 0)))
    with pytest.raises(ValueError, match="static"):
        TreeOptions(kind="chain", paths=((0,),))
    assert chain_paths(3) == ((0,), (0, 0), (0, 0, 0))
