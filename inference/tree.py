"""Draft trees: the tokens a drafter proposes, how they hang together, and the attention they imply.

Node 0 is the root: the last accepted token, which the target has not processed yet. Every other
node is a draft token whose parent has a smaller index, so index order is topological and a path
read in index order runs root -> leaf. A chain is the tree whose node i has parent i - 1.
Rows of a batch hold trees of the same size, each with its own shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.models.errors import InputError


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] target token ids; N = 1 + number of draft nodes
    parents: torch.Tensor  # [B, N] parent index, -1 for the root; parents[:, i] < i
    depth: torch.Tensor  # [B, N] 0 at the root
    scores: torch.Tensor  # [B, N] cumulative draft log-probability (0 at the root)
    # What the builder knows on the host, so that the cycle need not read the device for it:
    height: int | None = None  # at least the deepest node's depth (None: read `depth`)
    chain: bool | None = None  # every row is a chain (None: read `parents`)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    @property
    def max_depth(self) -> int:
        """A bound on the deepest node's depth (exact unless the builder gave a looser `height`)."""
        return self.height if self.height is not None else int(self.depth.max())

    @property
    def is_chain(self) -> bool:
        """Every row is a chain (the root alone included): its attention is plain causal."""
        if self.chain is None:
            n = self.size
            self.chain = bool((self.parents == torch.arange(-1, n - 1, device=self.parents.device)).all())
        return self.chain

    @classmethod
    def root_only(cls, root: torch.Tensor) -> "DraftTree":
        """The tree without drafts (root [B]): verifying it is one step of plain decoding."""
        zero = torch.zeros_like(root)[:, None]
        return cls(tokens=root[:, None], parents=zero - 1, depth=zero, scores=zero.float(), height=0, chain=True)

    def prefix(self, n: int) -> "DraftTree":
        """The root and the first n draft nodes of a chain (a chain's first nodes are a path)."""
        keep = slice(0, n + 1)
        height = None if self.height is None else min(self.height, n)
        return DraftTree(self.tokens[:, keep], self.parents[:, keep], self.depth[:, keep], self.scores[:, keep],
                         height=height, chain=True)

    def ancestors(self) -> torch.Tensor:
        """[B, N, N] bool: node j is node i itself or one of its ancestors."""
        return ancestor_mask(self.parents, self.max_depth)


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [B, N] (-1 = none) -> [B, N, N] bool, self included. Pointer-jumps once per level."""
    b, n = parents.shape
    if n == 1:  # the root alone: every plain decoding cycle
        return torch.ones(b, 1, 1, dtype=torch.bool, device=parents.device)
    anc = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    cur = parents
    for _ in range(max_depth):
        has = cur >= 0
        anc |= torch.nn.functional.one_hot(cur.clamp(min=0), n).bool() & has[..., None]
        cur = torch.where(has, parents.gather(1, cur.clamp(min=0)), cur)
    return anc


def on_continuation(tree: DraftTree, continuation: torch.Tensor,
                    length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which nodes spell the tokens that actually followed the root: (on [B, N], known [B, N]) bool.

    continuation [B, L]: row b's first length[b] entries are the tokens after the root, in order. A node is on
    it when its path equals the first `depth` of them; its fate is known when its depth is within length, or
    when an ancestor already differs. The root is on it.
    """
    width = continuation.shape[1]
    d = tree.depth
    within = d <= length[:, None]
    expect = continuation.gather(1, (d - 1).clamp(0, width - 1))
    match = (d == 0) | ~within | (tree.tokens == expect)  # beyond the continuation: undecided, not wrong
    alive = match
    for _ in range(tree.max_depth):  # alive: the node and all its ancestors match
        alive = match & alive.gather(1, tree.parents.clamp(min=0))
    return alive & within, within | ~alive


def path_to(ancestors: torch.Tensor, node: torch.Tensor, length: int) -> torch.Tensor:
    """Node indices root..node [B, length], left-aligned: a shorter path is padded after its end with its last
    node (callers know each row's length). ancestors [B, N, N]; node [B]. Index order is root-to-leaf order
    because parents precede children."""
    row = ancestors.gather(1, node[:, None, None].expand(-1, 1, ancestors.shape[2]))[:, 0]  # [B, N]
    n = row.shape[1]
    key = torch.where(row, torch.arange(n, device=row.device), n)  # non-path nodes sort last
    path = key.sort(dim=1).values[:, :length]
    return torch.where(path < n, path, node[:, None])


# ---- static shapes -------------------------------------------------------------------------
# A static tree is a set of paths of child ranks from the root: (0,) is the draft's top-1 token,
# (0, 1) the second-best continuation of it. Sized for CPUs (16 nodes, depth 5); EAGLE-1's
# mc_sim_7b_63 has the same form with 63 nodes.
DEFAULT_PATHS: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 0, 0),
)


def chain_paths(depth: int) -> tuple[tuple[int, ...], ...]:
    return tuple((0,) * d for d in range(1, depth + 1))


def check_paths(paths: tuple[tuple[int, ...], ...]) -> None:
    """Every path's prefix must be a path too, else a node would hang off nothing."""
    have = set(paths)
    if len(have) != len(paths):
        raise InputError("static tree paths contain duplicates")
    for p in paths:
        if not p or min(p) < 0:
            raise InputError(f"static tree path {p} must be a non-empty tuple of child ranks >= 0")
        if len(p) > 1 and p[:-1] not in have:
            raise InputError(f"static tree path {p} has no parent path {p[:-1]}; add it")
