"""How a head drafts, by its algorithm's drafting style (models/drafters): a tree grown level by level, one head
forward per level (EAGLE-1, EAGLE-3), or every position of a block from one forward (P-EAGLE, DFlash). Both keep
the head's own KV cache across cycles, column for column with the target's, and return every candidate they
made (`Candidates`); the expansion (drafter.py) decides which children each level keeps either way.

Each cycle the generator hands the drafter a DraftContext: the tokens accepted since the head last ran and the
target's states at their positions (EAGLE shift: tokens[t] is the token *after* the position whose state is
features[t]; each row's last token is its root). The drafter catches up on them once (they stay in its cache),
then grows the tree: a tree drafter runs the head on each level's frontier as one batch that attends to the
committed cache plus its own ancestors, as pending entries dropped once the draft is done; a parallel drafter
reads position d's distribution for every node of level d from the one forward it made.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from eyas.models import DraftHead
from eyas.models.cpu_kernels import CpuLinear, cpu_linears
from eyas.models.masks import after_history, causal

from .drafter import Candidates, DraftContext, Expansion

# the next level's draft log-probabilities [B, F', Vd] from (level, frontier [B, F'] as indices into this level's
# candidates, their parents' indices into this level's frontier [B, F'], their tokens [B, F'] in draft ids)
NextLevel = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grow(expansion: Expansion, root: torch.Tensor, logq: torch.Tensor, depth: int, next_level: NextLevel,
         to_target_ids: Callable[[torch.Tensor], torch.Tensor], forwards: Callable[[int], int],
         keep_going: Callable[[torch.Tensor], bool] | None = None) -> Candidates:
    """Candidates below root [B], from the root's draft log-probabilities logq [B, 1, Vd]: `depth` levels at most,
    and another only while keep_going(the frontier's scores [B, F]) says so. forwards(levels): the head forwards
    a draft of that many levels took."""
    b, dev = root.shape[0], root.device
    frontier_scores = torch.zeros(b, 1, device=dev)
    frontier_node = torch.full((b, 1), -1, device=dev, dtype=torch.long)  # candidate index, -1 = the root
    tokens, parents, scores, depths, levels = [], [], [], [], []
    count = 0
    for level in range(depth):
        par, draft_ids, score = expansion.children(level, logq, frontier_scores)
        if level > 0:
            levels.append((frontier_scores, score))
        tokens.append(to_target_ids(draft_ids))
        parents.append(frontier_node.gather(1, par))
        scores.append(score)
        depths.append(torch.full_like(draft_ids, level + 1))
        if level + 1 == depth:
            break
        nxt = expansion.frontier(level, score)  # [B, F']
        if keep_going is not None and not keep_going(score.gather(1, nxt)):
            break
        logq = next_level(level, nxt, par.gather(1, nxt), draft_ids.gather(1, nxt))
        frontier_scores = score.gather(1, nxt)
        frontier_node = count + nxt
        count += draft_ids.shape[1]
    return Candidates(root, torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1), torch.cat(depths, 1),
                      levels, height=len(tokens), forwards=forwards(len(tokens)))


class _HeadDrafter:
    """What both drafting styles share: the head, its expansion, its cache, and on CPU eyas's copies of its linear
    weights (models/cpu_kernels.py): prepacked for forwards of several rows (F.linear repacks per call; a 6-level
    draft of the demo head 85 -> 68 ms on one thread), the draft-vocab projection's [in, out] copy for one row
    (2.8 -> 1.6 ms)."""

    def __init__(self, head: DraftHead, expansion: Expansion) -> None:
        self.head = head
        self.expansion = expansion
        self.cache = None
        self._linears = [CpuLinear(m, row_copy=m is getattr(head, "lm_head", None))
                         for m in head.modules() if type(m) is nn.Linear]

    def reset(self, batch: int, capacity: int) -> None:
        self.cache = self.head.new_cache(batch, capacity)

    def keep_rows(self, order: list[int]) -> None:
        moved = self.cache.keep_rows(sorted(order))  # the target's cache made the same moves
        assert moved == list(order), (moved, order)


class TreeDrafter(_HeadDrafter):
    """A tree grown level by level: one head forward per level, over that level's frontier."""

    @torch.no_grad()
    def draft(self, ctx: DraftContext, depth: int | None = None,
              keep_going: Callable[[torch.Tensor], bool] | None = None) -> Candidates:
        head, cache = self.head, self.cache
        b, a = ctx.tokens.shape
        dev = ctx.tokens.device
        depth = min(depth or self.expansion.depth, self.expansion.depth)
        # Catch-up: the new accepted tokens see the committed cache and each other causally.
        allowed = after_history(cache.lengths, causal(a, dev).expand(b, a, a), cache.width + a)
        last = ctx.last()  # [B, 1] each row's root
        with cpu_linears(self._linears, b * a):  # the frontier is the root: only its logits are needed
            out = head(ctx.tokens, head.fuse(ctx.features), ctx.positions, allowed, cache, logits=last)
        cache.commit(ctx.counts)
        state = {"hidden": head.feedback(out.hidden.gather(1, last[..., None].expand(-1, -1, out.hidden.shape[-1]))),
                 "anc": torch.zeros(b, 1, 0, dtype=torch.bool, device=dev)}  # [B, F, E] over the pending entries
        root_pos = ctx.positions.gather(1, last)

        def next_level(level: int, nxt: torch.Tensor, fpar: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            hidden, anc = state["hidden"], state["anc"]
            fh = hidden.gather(1, fpar[..., None].expand(-1, -1, hidden.shape[-1]))
            f = nxt.shape[1]
            # a parent's row already holds the parent and its ancestors; add each new node itself
            anc = torch.cat([anc.gather(1, fpar[..., None].expand(-1, -1, anc.shape[2])),
                             torch.eye(f, dtype=torch.bool, device=dev).expand(b, f, f)], dim=2)
            with cpu_linears(self._linears, b * f):
                step = head(head.to_target_ids(ids), fh, root_pos + level + 1,
                            after_history(cache.lengths, anc, cache.width + f), cache)
            state["hidden"], state["anc"] = head.feedback(step.hidden), anc
            return torch.log_softmax(step.logits.float(), dim=-1)

        try:
            return grow(self.expansion, ctx.roots(), torch.log_softmax(out.logits.float(), dim=-1), depth, next_level,
                        head.to_target_ids, lambda levels: levels, keep_going)
        finally:
            cache.rollback()


class ParallelDrafter(_HeadDrafter):
    """Every position of a block from one head forward (head.propose); the tree's level d reads position d."""

    @torch.no_grad()
    def draft(self, ctx: DraftContext, depth: int | None = None,
              keep_going: Callable[[torch.Tensor], bool] | None = None) -> Candidates:
        depth = min(depth or self.expansion.depth, self.expansion.depth, self.head.draft_positions)
        b, a = ctx.tokens.shape
        with cpu_linears(self._linears, b * (a + depth)):
            logq = torch.log_softmax(self.head.propose(ctx.tokens, ctx.features, ctx.positions, ctx.counts,
                                                       self.cache, depth).float(), dim=-1)  # [B, depth, Vd]

        def next_level(level: int, nxt: torch.Tensor, fpar: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return logq[:, level + 1:level + 2].expand(-1, nxt.shape[1], -1)

        # the positions are read from one forward, so a level costs nothing: the tree grows to full depth
        return grow(self.expansion, ctx.roots(), logq[:, :1], depth, next_level, self.head.to_target_ids,
                    lambda levels: 1)


DRAFTERS = {"tree": TreeDrafter, "parallel": ParallelDrafter}


def make_drafter(head: DraftHead, expansion: Expansion) -> TreeDrafter | ParallelDrafter:
    """The drafter of the head's drafting style."""
    return DRAFTERS[head.algorithm.drafting](head, expansion)
