"""Drafting: one interface, one head drafter; static trees, chains and EAGLE-2 dynamic trees differ
only in how the tree is expanded.

Each cycle the generator hands the drafter a DraftContext: the tokens accepted since the last call
and the target's features at their positions (EAGLE shift: tokens[t] is the token *after* the
position whose feature is features[t]). The head drafter runs them through the head once, keeping
its own cache across cycles (catch-up), then grows the tree level by level: the frontier nodes of a
level go through the head as one batch that attends to the committed cache plus their own
ancestors. The draft entries are cropped from the head cache afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn

from eyas.models import DraftHead, HeadCache
from eyas.models.cpu_kernels import CpuLinear, cpu_linears

from .tree import DEFAULT_PATHS, DraftTree, chain_paths, check_paths


@dataclass(frozen=True)
class TreeOptions:
    """How the draft tree is shaped. Illegal: static paths with kind != "static"."""

    # dynamic: EAGLE-2 (expand the best top_k nodes per level, keep the best total_tokens);
    # static: a fixed set of child-rank paths; chain: depth tokens, one after another.
    kind: Literal["dynamic", "static", "chain"] = "dynamic"
    # Draft tokens on the longest path (dynamic, chain). A cycle gains at most depth + 1 tokens.
    # With total_tokens="auto" the most the tuner may choose.
    depth: int = 6
    # dynamic: children per expanded node and nodes expanded per level.
    top_k: int = 4
    # dynamic: draft nodes verified per cycle, or "auto": on the first generate, time target forwards
    # over 1..32 tokens and a draft step; then every cycle the head drafts as deep, and verifies as many
    # nodes, as its calibrated confidence says pays on this machine (tuning.Planner). On a CPU that is
    # a few nodes or none; on a GPU tens.
    total_tokens: int | Literal["auto"] = "auto"
    # static: the tree as child-rank paths from the root (default: a 16-node tree, tree.DEFAULT_PATHS).
    paths: tuple[tuple[int, ...], ...] | None = None
    # At most this many n-gram lookup tokens grafted onto the tree as one more branch (lookup.py);
    # with total_tokens="auto" the planner picks fewer from their observed acceptance. 0 = off.
    lookup: int = 8

    def __post_init__(self) -> None:
        if self.kind not in ("dynamic", "static", "chain"):
            raise ValueError(f"tree kind {self.kind!r} is not one of dynamic, static, chain")
        if self.lookup < 0:
            raise ValueError(f"lookup must be >= 0 (0 = off), got {self.lookup}")
        if self.depth < 1 or self.top_k < 1:
            raise ValueError(f"depth and top_k must be >= 1, got depth={self.depth} top_k={self.top_k}")
        if self.total_tokens != "auto" and (not isinstance(self.total_tokens, int) or self.total_tokens < 1):
            raise ValueError(f"total_tokens must be a positive int or 'auto', got {self.total_tokens!r}")
        if self.paths is not None:
            if self.kind != "static":
                raise ValueError(f"paths describe a static tree; got kind={self.kind!r}")
            object.__setattr__(self, "paths", tuple(tuple(p) for p in self.paths))
            check_paths(self.paths)

    def expansion(self, total_tokens: int | None = None, depth: int | None = None) -> "Expansion":
        """The expansion these options describe; total_tokens / depth override them (tuned values)."""
        if self.kind == "dynamic":
            n = total_tokens if total_tokens is not None else self.total_tokens
            return DynamicExpansion(depth or self.depth, self.top_k, 16 if n == "auto" else n)
        return StaticExpansion(self.paths or DEFAULT_PATHS if self.kind == "static" else chain_paths(self.depth))


@dataclass
class DraftContext:
    tokens: torch.Tensor  # [B, A] newly accepted tokens, EAGLE-shifted; tokens[:, -1] is the next root
    features: torch.Tensor  # [B, A, F] target features at the positions before them
    positions: torch.Tensor  # [B, A] position ids of those features
    valid: torch.Tensor  # [B, L] which cache slots hold real tokens, the A new ones last

    def rows(self, index: torch.Tensor) -> "DraftContext":
        """Only batch rows `index` [B']."""
        return DraftContext(self.tokens[index], self.features[index], self.positions[index], self.valid[index])

    def then(self, later: "DraftContext") -> "DraftContext":
        """This context followed by a later one (the head skipped a cycle: it catches up on both at once)."""
        return DraftContext(torch.cat([self.tokens, later.tokens], 1), torch.cat([self.features, later.features], 1),
                            torch.cat([self.positions, later.positions], 1), later.valid)


class Drafter(Protocol):
    def draft(self, ctx: DraftContext) -> DraftTree:
        """Propose a tree rooted at ctx.tokens[:, -1]. A new generation starts with reset()."""
        ...

    def reset(self) -> None: ...

    def keep_rows(self, index: torch.Tensor) -> None:
        """Only batch rows `index` [B'] go on (the others are done); drop any per-row state of the rest."""
        ...


class Expansion(Protocol):
    """How a tree grows. A level's candidates are children of that level's frontier nodes."""

    depth: int

    def children(self, level: int, logq: torch.Tensor, frontier_scores: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logq [B, F, Vd] at the frontier -> (parent index into the frontier, draft id, cumulative score), each [B, C]."""
        ...

    def frontier(self, level: int, scores: torch.Tensor) -> torch.Tensor:
        """Which of this level's candidates [B, C] are expanded next: index [B, F']."""
        ...

    def expand(self, frontier_scores: torch.Tensor) -> bool:
        """Draft the next level below these frontier nodes (scores [B, F'])? Before `depth` is reached."""
        ...

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Which candidates [B, M] (all levels, in creation order) form the tree: ascending index [B, n]."""
        ...


class DynamicExpansion:
    """EAGLE-2: expand the top_k frontier by cumulative draft log-prob, rerank all candidates."""

    def __init__(self, depth: int, top_k: int, total_tokens: int) -> None:
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens

    def children(self, level, logq, frontier_scores):
        b, f, _ = logq.shape
        val, ids = logq.topk(self.top_k, dim=-1)  # [B, F, k]
        parent = torch.arange(f, device=logq.device).repeat_interleave(self.top_k).expand(b, -1)
        return parent, ids.reshape(b, -1), (frontier_scores[..., None] + val).reshape(b, -1)

    def frontier(self, level, scores):
        return scores.topk(min(self.top_k, scores.shape[1]), dim=1).indices

    def expand(self, frontier_scores):
        return True

    def select(self, scores):
        # A child never scores above its parent and comes later, so a stable sort keeps parents in.
        n = min(self.total_tokens, scores.shape[1])
        best = scores.sort(dim=1, descending=True, stable=True).indices[:, :n]
        return best.sort(dim=1).values


class StaticExpansion:
    """A fixed tree of child ranks; a chain is the static tree (0,), (0, 0), (0, 0, 0), ..."""

    def __init__(self, paths: tuple[tuple[int, ...], ...]) -> None:
        paths = sorted(paths, key=lambda p: (len(p), p))
        self.depth = len(paths[-1])
        self.n = len(paths)
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

    def expand(self, frontier_scores):
        return True

    def select(self, scores):
        return torch.arange(scores.shape[1], device=scores.device).expand(scores.shape[0], -1)


class HeadDrafter:
    """Drafts with an EAGLE head that keeps its own cache across cycles."""

    def __init__(self, head: DraftHead, expansion: Expansion) -> None:
        self.head = head
        self.expansion = expansion
        self.cache: HeadCache | None = None
        self._last: tuple | None = None  # the last draft's root and candidate tensors, for `candidates`
        # on CPU fp32 the head's linears run through eyas's weight copies (models/cpu_kernels.py): prepacked for
        # levels of several frontier nodes (F.linear repacks per call; a 6-level draft of the demo head
        # 85 -> 68 ms on one thread), the draft-vocab projection's [in, out] copy for one row (2.8 -> 1.6 ms)
        self._linears = [CpuLinear(m, row_copy=m is getattr(head, "lm_head", None))
                         for m in head.modules() if type(m) is nn.Linear]

    @property
    def candidates(self) -> DraftTree | None:
        """The last draft's every candidate, in creation order (built on demand: only the planner reads it)."""
        if self._last is None:
            return None
        root, parts = self._last
        every = torch.arange(parts[0].shape[1], device=root.device).expand(len(root), -1)
        return _build_tree(root, every, *parts)

    def reset(self) -> None:
        self.cache = self.head.new_cache()

    def keep_rows(self, index: torch.Tensor) -> None:
        for i, k in enumerate(self.cache.keys):
            if k is not None:
                self.cache.keys[i], self.cache.values[i] = k[index], self.cache.values[i][index]

    @torch.no_grad()
    def draft(self, ctx: DraftContext) -> DraftTree:
        head, exp, cache = self.head, self.expansion, self.cache
        b, a = ctx.tokens.shape
        dev = ctx.tokens.device
        # Catch-up: the new accepted tokens see the committed cache and each other causally.
        past = len(cache)
        new_valid = ctx.valid[:, past:]
        causal = torch.ones(a, a, dtype=torch.bool, device=dev).tril()
        mask = torch.cat([ctx.valid[:, None, :past].expand(b, a, past), causal & new_valid[:, None, :]], dim=2)
        with cpu_linears(self._linears, b * a):
            out = head(ctx.tokens, head.fuse(ctx.features), ctx.positions, mask, cache)
        committed = ctx.valid  # [B, L]: the head cache mirrors the target cache slot for slot
        logits, hidden = out.logits[:, -1:], out.hidden[:, -1:]  # the frontier: the root alone
        root_pos = ctx.positions[:, -1:]
        frontier_scores = torch.zeros(b, 1, device=dev)
        frontier_node = torch.full((b, 1), -1, device=dev, dtype=torch.long)  # candidate index, -1 = root
        frontier_anc = torch.zeros(b, 1, 0, dtype=torch.bool, device=dev)  # [B, F, E] over draft cache entries
        tokens, parents, scores, depths = [], [], [], []
        count = 0
        for level in range(exp.depth):
            logq = torch.log_softmax(logits.float(), dim=-1)
            par, draft_ids, score = exp.children(level, logq, frontier_scores)
            tok = head.to_target_ids(draft_ids)
            tokens.append(tok)
            parents.append(frontier_node.gather(1, par))
            scores.append(score)
            depths.append(torch.full_like(tok, level + 1))
            if level + 1 == exp.depth:
                break
            nxt = exp.frontier(level, score)  # [B, F']
            if not exp.expand(score.gather(1, nxt)):
                break
            fpar = par.gather(1, nxt)
            fh = hidden.gather(1, fpar[..., None].expand(-1, -1, hidden.shape[-1]))
            f = nxt.shape[1]
            # a parent's row already holds the parent and its ancestors; add each new node itself
            anc = torch.cat([frontier_anc.gather(1, fpar[..., None].expand(-1, -1, frontier_anc.shape[2])),
                             torch.eye(f, dtype=torch.bool, device=dev).expand(b, f, f)], dim=2)
            mask = torch.cat([committed[:, None, :].expand(b, f, -1), anc], dim=2)
            with cpu_linears(self._linears, b * f):
                out = head(tok.gather(1, nxt), fh, root_pos + level + 1, mask, cache)
            logits, hidden = out.logits, out.hidden
            frontier_scores = score.gather(1, nxt)
            frontier_node = count + nxt
            frontier_anc = anc
            count += tok.shape[1]
        cache.crop(committed.shape[1])
        parts = (torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1), torch.cat(depths, 1))
        self._last = (ctx.tokens[:, -1], parts)
        return _build_tree(ctx.tokens[:, -1], exp.select(parts[2]), *parts)


def _build_tree(root: torch.Tensor, sel: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                scores: torch.Tensor, depths: torch.Tensor) -> DraftTree:
    """Keep candidates `sel` [B, n] (ascending) under `root` [B]; candidate parents -1 mean the root."""
    b, n = sel.shape
    dev = sel.device
    new_index = torch.zeros(b, tokens.shape[1], dtype=torch.long, device=dev)
    new_index.scatter_(1, sel, torch.arange(1, n + 1, device=dev).expand(b, -1))
    par = parents.gather(1, sel)
    par = torch.where(par < 0, 0, new_index.gather(1, par.clamp(min=0)))
    zero = torch.zeros(b, 1, dtype=torch.long, device=dev)
    return DraftTree(
        tokens=torch.cat([root[:, None], tokens.gather(1, sel)], 1),
        parents=torch.cat([zero - 1, par], 1),
        depth=torch.cat([zero, depths.gather(1, sel)], 1),
        scores=torch.cat([zero.float(), scores.gather(1, sel)], 1),
    )
