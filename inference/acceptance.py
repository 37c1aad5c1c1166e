"""Which draft tokens the target accepts. Pure functions; names as in the papers: p = target, q = draft.

Greedy: walk the tree from the root, at each node following the child whose token equals the
target's argmax there; the bonus token is the target's argmax at the last accepted node.

Sampling (temperature > 0): recursive rejection sampling over each node's children (SpecInfer,
EAGLE-2). Child x_j, proposed from q_j, is accepted with probability min(1, p(x_j) / q_j(x_j));
on rejection p <- norm(max(p - q_j, 0)) and the next child is tried; when all are rejected the
bonus token is drawn from what is left of p. This preserves p exactly only if x_j really is a
sample from q_j. Our drafters (like EAGLE's) pick children deterministically -- the top-k of
the draft -- so the only proposal distribution they sample from is the point mass q_j = δ(x_j).
As in the EAGLE reference (evaluate_posterior, `qx = 1.0`) we use exactly that:

    accept x_j with probability p(x_j);  on rejection p <- p with x_j zeroed, renormalised.

Chaining these steps over distinct children x_1..x_k returns x_j with probability p(x_j) and
otherwise a draw from p restricted to the other tokens: in total, a draw y ~ p, with the rule
"descend into the child whose token is y". That is the form implemented below: draw y ~ p at
every node at once (one tensor op), then walk. It is exact for any tree chosen without looking
at the verification randomness -- top-k, dynamic reranking, a perfect oracle alike -- and
greedy is its temperature -> 0 limit (y = argmax p). Using the head's soft q with top-k
children would be biased. top-k / top-p shape p only; with q = δ there is nothing to shape on q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from eyas.models.sampling import Sampling, choose, penalize

from .tree import DraftTree, path_to

# A verifier maps the target's logits over a tree to its choice y at every node; tests inject biased ones.
Verifier = Callable[[torch.Tensor, DraftTree, Sampling, "torch.Generator | None"], torch.Tensor]


def verify(logits: torch.Tensor, tree: DraftTree, s: Sampling,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Default verifier: y [B, N] with y ~ p (or argmax p) at every node, independent of the draft."""
    return choose(logits, s, generator)


def penalized(logits: torch.Tensor, tree: DraftTree, ancestors: torch.Tensor, seen: torch.Tensor,
              penalty: float) -> torch.Tensor:
    """The repetition penalty at every node: what node i predicts follows the sequence so far (seen [B, V] bool,
    the root included) and the draft tokens on i's path (ancestors [B, N, N]). logits [B, N, V] -> [B, N, V]."""
    if penalty == 1.0:
        return logits
    b, n, v = logits.shape
    on_path = torch.zeros(b, n, v, dtype=torch.int32, device=logits.device)  # summed: nodes may share a token
    on_path.scatter_add_(2, tree.tokens[:, None, :].expand(b, n, n), ancestors.int())  # node i's path tokens
    return penalize(logits, (on_path > 0) | seen[:, None, :], penalty)


@dataclass
class Accepted:
    path: torch.Tensor  # [B, A] node indices root..last accepted node, left-aligned (padded after with the last);
    # A = the tree's height + 1 (its max_depth), which may exceed every row's length
    length: torch.Tensor  # [B] nodes on the path = accepted drafts + 1 = tokens gained this cycle
    bonus: torch.Tensor  # [B] y at the last accepted node: the next root


def accept(tree: DraftTree, y: torch.Tensor, ancestors: torch.Tensor) -> Accepted:
    """Walk the tree following y: a node is accepted when its token is y at its parent and its parent is.

    y [B, N]; ancestors [B, N, N] from tree.ancestors(). Siblings carry distinct tokens, so at most one
    node per depth is accepted and the accepted nodes form one path.
    """
    if tree.size == 1:  # the root alone (plain decoding): the target's choice there is the next token
        zero = torch.zeros_like(tree.parents)
        return Accepted(path=zero, length=zero[:, 0] + 1, bonus=y[:, 0])
    parent = tree.parents.clamp(min=0)
    match = tree.tokens == y.gather(1, parent)  # [B, N]: node i is the target's choice after its parent
    match[:, 0] = True
    ok = match.clone()
    height = tree.max_depth
    for _ in range(height):  # a node is accepted iff every node on its path matches
        ok = match & ok.gather(1, parent)
    depth = torch.where(ok, tree.depth, -1)
    last = depth.argmax(1)  # the deepest accepted node
    length = depth.max(1).values + 1
    path = path_to(ancestors, last, height + 1)  # as wide as the longest path can be: no device read
    return Accepted(path=path, length=length, bonus=y.gather(1, last[:, None])[:, 0])
