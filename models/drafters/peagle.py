"""P-EAGLE, parallel drafting (arXiv 2602.01469): K draft tokens from one forward of an EAGLE-3 head.

The first position reads the target's fused states like EAGLE-3 (the root and the target's state before it);
every later position d = 1..K-1 reads a mask token's embedding and one learned state shared by all positions
(`mask_hidden`, fused through the same fc as the target's states), at position root + d. Position d attends to
the context and to the positions 0..d of its own rollout, so one forward gives a distribution at every
position: a chain of K, or a tree from each position's top-k.

Trained like EAGLE-3's training-time test (models/ttt.py), with depth d fed the mask token and state instead of
the teacher-forced token and the head's own state, and a shrinking random share of the rows per depth
(max(r^d, r_min) of the loss rows: long unrolls stay affordable), each depth distilling the target's
distribution at its position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import HeadConfig
from ..errors import InputError
from ..masks import after_history, causal
from ..ttt import TTTPlan, unroll
from .base import Predictions, feature_noise, window_mask
from .eagle3 import Eagle3, Eagle3Head, Eagle3Options


@dataclass(frozen=True)
class PEagleOptions(Eagle3Options):
    # The token every position after the first reads (speculators' `mask_token_id`); chosen from the target's
    # tokenizer when the head is made (models/head_config.py: mask_token_for).
    mask_token_id: int | None = None
    # Draft positions one forward proposes (K); the reference trains 8.
    depths: int = 8
    # Training: depth d >= 1 runs at a random share max(depth_keep ** d, depth_keep_min) of the loss rows (the
    # reference's 0.7 and 0.2), so an unroll of K depths costs a few times one depth, not K times.
    depth_keep: float = 0.7
    depth_keep_min: float = 0.2


class PEagleHead(Eagle3Head):
    def __init__(self, config: HeadConfig, target=None) -> None:
        super().__init__(config, target)
        # the learned target state of a masked position (fused like the target's), as speculators initialises it
        self.mask_hidden = nn.Parameter(torch.randn(config.feature_size))

    @property
    def own_tokens(self) -> tuple[int, ...]:
        return (self.options.mask_token_id,)

    @property
    def draft_positions(self) -> int:
        """The positions it was trained to propose from one forward."""
        return self.options.depths

    def mask_inputs(self, shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask token ids [*shape], their fused states [*shape, H]) for masked positions."""
        ids = torch.full(shape, self.options.mask_token_id, dtype=torch.long, device=device)
        return ids, self.fuse(self.mask_hidden).expand(*shape, -1)

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, counts: list[int],
                cache, k: int) -> torch.Tensor:
        """One forward over what the head has not seen yet and k - 1 masked positions after each row's root.

        tokens [B, A] (EAGLE-shifted: row b's last real entry, counts[b] - 1, is its root), features [B, A, F],
        positions [B, A]; rows left-aligned, padded after counts[b]. The real entries stay in the head's cache.
        Returns logits [B, k, draft_vocab]: position 0 proposes the token after the root, position d the one d after.
        """
        b, a = tokens.shape
        dev = tokens.device
        last = torch.tensor([max(n - 1, 0) for n in counts], device=dev)[:, None]  # [B, 1] each row's root
        mask_ids, mask_state = self.mask_inputs((b, k - 1), dev)
        depth = torch.arange(1, k, device=dev)
        ids = torch.cat([tokens, mask_ids], 1)
        state = torch.cat([self.fuse(features), mask_state], 1)
        pos = torch.cat([positions, positions.gather(1, last) + depth], 1)
        # the catch-up is causal; masked position d sees the row's real entries and masked positions <= d
        real = torch.arange(a, device=dev)[None, :] < torch.tensor(counts, device=dev)[:, None]  # [B, A]
        block = torch.zeros(b, a + k - 1, a + k - 1, dtype=torch.bool, device=dev)
        block[:, :a, :a] = causal(a, dev)
        block[:, a:, :a] = real[:, None, :]
        block[:, a:, a:] = causal(k - 1, dev)
        allowed = after_history(cache.lengths, block, cache.width + a + k - 1)
        wanted = torch.cat([last, (a - 1 + depth).expand(b, -1)], 1)  # the root, then each masked position
        out = self(ids, state, pos, allowed, cache, logits=wanted)
        cache.commit(counts)  # the real entries stay; padding and masked positions go
        return out.logits


class PEagle(Eagle3):
    name = "peagle"
    title = "P-EAGLE, parallel drafting (arXiv 2602.01469), on an EAGLE-3 head"
    Options = PEagleOptions
    head_class = PEagleHead
    drafting = "parallel"
    # one layer cannot tell K positions apart from one shared mask state; the reference drafters have four
    default_num_layers = 4

    def default_options(self, target) -> dict[str, Any]:
        from ..head_config import mask_token_for

        return {"mask_token_id": mask_token_for(target)}

    def check(self, config: HeadConfig) -> None:
        super().check(config)
        o = config.options
        if o.mask_token_id is None or not 0 <= o.mask_token_id < config.vocab_size:
            raise InputError(f"a peagle head needs a mask_token_id in 0..{config.vocab_size - 1}, got "
                             f"{o.mask_token_id}")
        if o.depths < 1:
            raise InputError(f"peagle depths must be >= 1, got {o.depths}")
        if not (0 < o.depth_keep_min <= 1 and 0 < o.depth_keep <= 1):
            raise InputError(f"peagle depth_keep and depth_keep_min must be in (0, 1], got {o.depth_keep} and "
                             f"{o.depth_keep_min}")

    def unroll(self, head: PEagleHead, input_ids: torch.Tensor, valid: torch.Tensor, states: torch.Tensor,
               settings: Any, generators: list[torch.Generator | None] | None = None) -> Predictions:
        """Depth 0 at every index t: token t+1 and the target's state at t (as EAGLE-3's step 0). Depth d at a
        sampled share of the anchors t: the mask token and state at position t + d, seeing the context up to t and
        its own rollout's depths 1..d; it learns the target's distribution at t+1+d."""
        b, t = input_ids.shape
        steps = min(head.options.depths, t - 1)
        hidden = feature_noise(head.fuse(states[:, :t - 1]), settings.feature_noise)  # drawn before the rows are
        plan = TTTPlan(valid.cpu(), steps, shares=lambda d: _share(head.options, d), generators=generators)
        hidden = hidden[:, :plan.n]

        def later(d: int, at: torch.Tensor, bat: torch.Tensor, previous: torch.Tensor):
            ids, state = head.mask_inputs((1, len(at)), input_ids.device)
            return ids, state

        picked = unroll(head, input_ids, hidden, plan, later, window_mask(head.config.sliding_window, b, plan.n,
                                                                           input_ids.device))
        sizes = [len(r) for r in plan.teacher]
        # a depth's mean over the rows it is drawn to have, share x depth 0's: not over how many it got
        return Predictions(torch.cat(picked), torch.cat(plan.teacher), sizes,
                           per_depth=[sizes[0]] + [sizes[0] * _share(head.options, d) for d in range(1, len(sizes))])

    def depth_weights(self, head: PEagleHead, settings: Any, sizes: list[int]) -> list[float]:
        """Each depth's mean weighted by its share of the rows (1, r, r^2, ...): in expectation the reference's mean
        over every row, as a constant."""
        shares = [1.0] + [_share(head.options, d) for d in range(1, len(sizes))]
        return [s / sum(shares) for s in shares]

    def training_activations(self, config: HeadConfig, seq_len: int, loss_fraction: float, settings: Any,
                             itemsize: int, batch: int) -> tuple[dict[str, float], int]:
        from ..memory import ttt_activations, ttt_rows

        steps = min(config.options.depths, seq_len - 1)
        n0, _, loss_rows = ttt_rows(seq_len, loss_fraction, steps)
        rows = [loss_rows[0]] + [round(loss_rows[0] * _share(config.options, d)) for d in range(1, steps)]
        return ttt_activations(config, n0, rows, rows, fused=True, itemsize=itemsize, batch=batch), sum(rows)


def _share(options: PEagleOptions, depth: int) -> float:
    return max(options.depth_keep ** depth, options.depth_keep_min)


ALGORITHM = PEagle()
PEagleHead.algorithm = ALGORITHM
