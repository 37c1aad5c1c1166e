"""Drafting's interface and data: what the drafter is given (`DraftContext`), what it returns (`Candidates`), the
tree options, and how a tree is expanded level by level (static trees, chains and EAGLE-2 dynamic trees differ
only there). The drafters themselves are in drafting.py; which candidates are verified is the caller's choice
(the planner's, or TreeOptions' fixed size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol, Sequence

import torch

from eyas.models.errors import InputError

from .tree import DEFAULT_PATHS, DraftTree, chain_paths, check_paths


@dataclass(frozen=True)
class TreeOptions:
    """How the draft tree is shaped. Illegal: static paths with kind != "static"."""

    # dynamic: EAGLE-2 (expand the best top_k nodes per level, keep the best total_tokens);
    # static: a fixed set of child-rank paths; chain: depth tokens, one after another.
    kind: Literal["dynamic", "static", "chain"] = "dynamic"
    # Draft tokens on the longest path (dynamic, chain). A cycle gains at most depth + 1 tokens.
    # With total_tokens="auto" the most the planner may choose.
    depth: int = 6
    # dynamic: children per expanded node and nodes expanded per level.
    top_k: int = 4
    # dynamic: draft nodes verified per cycle, or "auto": every cycle the head drafts as deep, and verifies as
    # many nodes, as its calibrated confidence says pays at the costs measured on this machine (planner.py).
    # On a CPU that is a few nodes or none; on a GPU tens.
    total_tokens: int | Literal["auto"] = "auto"
    # static: the tree as child-rank paths from the root (default: a 16-node tree, tree.DEFAULT_PATHS).
    paths: tuple[tuple[int, ...], ...] | None = None
    # At most this many n-gram lookup tokens grafted onto the tree as one more branch (lookup.py);
    # with total_tokens="auto" the planner picks fewer from their observed acceptance. 0 = off.
    lookup: int = 8

    def __post_init__(self) -> None:
        if self.kind not in ("dynamic", "static", "chain"):
            raise InputError(f"tree kind {self.kind!r} is not one of dynamic, static, chain")
        if self.lookup < 0:
            raise InputError(f"lookup must be >= 0 (0 = off), got {self.lookup}")
        if self.depth < 1 or self.top_k < 1:
            raise InputError(f"depth and top_k must be >= 1, got depth={self.depth} top_k={self.top_k}")
        if self.total_tokens != "auto" and (not isinstance(self.total_tokens, int) or self.total_tokens < 1):
            raise InputError(f"total_tokens must be a positive int or 'auto', got {self.total_tokens!r}")
        if self.paths is not None:
            if self.kind != "static":
                raise InputError(f"paths describe a static tree; got kind={self.kind!r}")
            object.__setattr__(self, "paths", tuple(tuple(p) for p in self.paths))
            check_paths(self.paths)

    @property
    def planned(self) -> bool:
        """The planner decides each cycle's tree (dynamic trees of total_tokens="auto")."""
        return self.kind == "dynamic" and self.total_tokens == "auto"

    def expansion(self) -> "Expansion":
        if self.kind == "dynamic":
            return DynamicExpansion(self.depth, self.top_k)
        return StaticExpansion(self.paths or DEFAULT_PATHS if self.kind == "static" else chain_paths(self.depth))

    def max_nodes(self) -> int:
        """The most draft nodes a verified tree can hold (head nodes + the lookup branch)."""
        if self.kind == "dynamic":
            head = self.top_k + (self.depth - 1) * self.top_k ** 2
            if self.total_tokens != "auto":
                head = min(head, self.total_tokens)
        else:
            head = len(self.paths or DEFAULT_PATHS) if self.kind == "static" else self.depth
        return head + self.lookup


@dataclass
class DraftContext:
    """What the head has not seen yet. Row b's first counts[b] entries are real (left-aligned), the rest padding."""

    tokens: torch.Tensor  # [B, A] accepted tokens, EAGLE-shifted: tokens[b, counts[b] - 1] is the next root
    features: torch.Tensor  # [B, A, F] target features at the positions before them
    positions: torch.Tensor  # [B, A] position ids of those features
    counts: list[int]  # [B]

    def last(self) -> torch.Tensor:
        """[B, 1] the column of each row's last real entry, whose token is the row's root."""
        return torch.tensor([max(n - 1, 0) for n in self.counts], device=self.tokens.device)[:, None]

    def roots(self) -> torch.Tensor:
        """[B] each row's root: the last accepted token, which the target has not seen yet."""
        return self.tokens.gather(1, self.last())[:, 0]

    def rows(self, index: list[int]) -> "DraftContext":
        """Only batch rows `index`."""
        i = torch.tensor(index, device=self.tokens.device)
        return DraftContext(self.tokens[i], self.features[i], self.positions[i], [self.counts[r] for r in index])

    @staticmethod
    def join(parts: Sequence["DraftContext"]) -> "DraftContext":
        """Contexts in order as one (the head skipped cycles: it catches up on all of them at once). One gather
        per field, however many parts: joining each plain cycle's context as it came would copy the
        growing context every cycle."""
        if len(parts) == 1:
            return parts[0]
        counts = [sum(c) for c in zip(*(p.counts for p in parts))]
        width = max(counts)
        index = []  # [B, width] per row: the columns of its real entries in the parts laid side by side
        for b, total in enumerate(counts):
            cols, offset = [], 0
            for p in parts:
                cols.extend(range(offset, offset + p.counts[b]))
                offset += p.tokens.shape[1]
            index.append(cols + [cols[-1] if cols else 0] * (width - total))
        idx = torch.tensor(index, device=parts[0].tokens.device)

        def joined(name: str) -> torch.Tensor:
            both = torch.cat([getattr(p, name) for p in parts], 1)
            return both.gather(1, idx if both.dim() == 2 else idx[..., None].expand(-1, -1, both.shape[-1]))

        return DraftContext(joined("tokens"), joined("features"), joined("positions"), counts)


@dataclass
class Candidates:
    """Every node a draft made, in creation order (parents before children), below each row's root."""

    root: torch.Tensor  # [B]
    tokens: torch.Tensor  # [B, M] target ids
    parents: torch.Tensor  # [B, M] index of the parent candidate, -1 for the root
    scores: torch.Tensor  # [B, M] cumulative draft log-probability: the node's path confidence is exp(score)
    depth: torch.Tensor  # [B, M] 1 below the root
    # per level below the first: (scores of the frontier expanded [B, F], scores of its children [B, C])
    levels: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    height: int | None = None  # levels drafted, when the drafter knows it on the host (None: read `depth`)
    forwards: int = 0  # head forwards the draft took (a tree drafter: one per level; a parallel one: one)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def tree(self, select: torch.Tensor | None = None) -> DraftTree:
        """The tree of candidates `select` [B, n] (ascending; None: all) under the root."""
        b = self.tokens.shape[0]
        dev = self.tokens.device
        sel = torch.arange(self.size, device=dev).expand(b, -1) if select is None else select
        n = sel.shape[1]
        new_index = torch.zeros(b, self.size, dtype=torch.long, device=dev)
        new_index.scatter_(1, sel, torch.arange(1, n + 1, device=dev).expand(b, -1))
        par = self.parents.gather(1, sel)
        par = torch.where(par < 0, 0, new_index.gather(1, par.clamp(min=0)))
        zero = torch.zeros(b, 1, dtype=torch.long, device=dev)
        height = None if self.height is None else min(self.height, n)
        return DraftTree(tokens=torch.cat([self.root[:, None], self.tokens.gather(1, sel)], 1),
                         parents=torch.cat([zero - 1, par], 1),
                         depth=torch.cat([zero, self.depth.gather(1, sel)], 1),
                         scores=torch.cat([zero.float(), self.scores.gather(1, sel)], 1),
                         height=height, chain=True if n <= 1 else None)

    def best(self, n: int) -> DraftTree:
        """The tree of the n most confident candidates. A child never scores above its parent and comes later,
        so a stable sort keeps every chosen node's parent in."""
        n = min(n, self.size)
        chosen = self.scores.sort(dim=1, descending=True, stable=True).indices[:, :n]
        return self.tree(chosen.sort(dim=1).values)


    def chain(self) -> DraftTree:
        """The path that follows, from the root down, the most confident child at every level (ties: the first
        made), as deep as every row's path goes: what a target that verifies chains only gets from a tree."""
        node = torch.full((self.tokens.shape[0],), -1, dtype=torch.long, device=self.tokens.device)
        chosen = []
        while True:
            child = self.parents == node[:, None]  # [B, M] children of each row's current node
            if not bool(child.any(1).all()):
                break
            node = torch.where(child, self.scores, float("-inf")).argmax(1)  # argmax: the first of equals
            chosen.append(node)
        if not chosen:
            return DraftTree.root_only(self.root)
        path = self.tree(torch.stack(chosen, 1))
        path.chain = True
        return path


class Drafter(Protocol):
    def reset(self, batch: int, capacity: int) -> None:
        """A new generation of `batch` rows, at most `capacity` tokens each."""
        ...

    def draft(self, ctx: DraftContext, depth: int | None = None,
              keep_going: Callable[[torch.Tensor], bool] | None = None) -> Candidates:
        """Candidates below root ctx.tokens[b, counts[b] - 1]; `depth` levels at most, and another level only while
        keep_going(frontier scores [B, F]) says so."""
        ...

    def keep_rows(self, order: list[int]) -> None:
        """Fewer rows go on: row i now holds what old row order[i] held (the others are done)."""
        ...


class Expansion(Protocol):
    """How a tree grows. A level's candidates are children of that level's frontier nodes."""

    depth: int

    def children(self, level: int, logq: torch.Tensor, frontier_scores: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logq [B, F, Vd] at the frontier -> (parent index into the frontier, draft id, cumulative score), each
        [B, C]."""
        ...

    def frontier(self, level: int, scores: torch.Tensor) -> torch.Tensor:
        """Which of this level's candidates [B, C] are expanded next: index [B, F']."""
        ...


class DynamicExpansion:
    """EAGLE-2: expand the top_k frontier by cumulative draft log-prob (the rerank is `Candidates.best`)."""

    def __init__(self, depth: int, top_k: int) -> None:
        self.depth, self.top_k = depth, top_k

    def children(self, level, logq, frontier_scores):
        b, f, _ = logq.shape
        val, ids = logq.topk(self.top_k, dim=-1)  # [B, F, k]
        parent = torch.arange(f, device=logq.device).repeat_interleave(self.top_k).expand(b, -1)
        return parent, ids.reshape(b, -1), (frontier_scores[..., None] + val).reshape(b, -1)

    def frontier(self, level, scores):
        return scores.topk(min(self.top_k, scores.shape[1]), dim=1).indices


class StaticExpansion:
    """A fixed tree of child ranks; a chain is the static tree (0,), (0, 0), (0, 0, 0), ..."""

    def __init__(self, paths: tuple[tuple[int, ...], ...]) -> None:
        paths = sorted(paths, key=lambda p: (len(p), p))
        self.depth = len(paths[-1])
        self.width = max(max(p) for p in paths) + 1
        levels = [[p for p in paths if len(p) == d] for d in range(1, self.depth + 1)]
        # parent of each candidate as an index into its level's frontier (expanded nodes of the level above)
        self._parent, self._rank, self._frontier = [], [], []
        for d, level in enumerate(levels):
            above = [()] if d == 0 else [p for p in levels[d - 1] if any(q[:-1] == p for q in level)]
            self._parent.append(torch.tensor([above.index(p[:-1]) for p in level]))
            self._rank.append(torch.tensor([p[-1] for p in level]))
            if d + 1 < len(levels):
                nxt = {q[:-1] for q in levels[d + 1]}
                self._frontier.append(torch.tensor([i for i, p in enumerate(level) if p in nxt]))

    def children(self, level, logq, frontier_scores):
        b = logq.shape[0]
        val, ids = logq.topk(self.width, dim=-1)  # [B, F, width]
        parent = self._parent[level].to(logq.device).expand(b, -1)
        rank = self._rank[level].to(logq.device).expand(b, -1)
        flat = parent * self.width + rank
        score = frontier_scores.gather(1, parent) + val.flatten(1).gather(1, flat)
        return parent, ids.flatten(1).gather(1, flat), score

    def frontier(self, level, scores):
        return self._frontier[level].to(scores.device).expand(scores.shape[0], -1)
