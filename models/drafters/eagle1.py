"""EAGLE-1 (Li et al., 2024): the head reads the target's final hidden state and predicts the next one.

    h = layers(fc([emb(token); state]))        logits = the target's own lm_head(h)

The first layer has no input norm (the fc output it receives is not a residual stream, as in the reference).
Trained on one step: SmoothL1 between its state at t and the target's at t+1, plus a soft cross-entropy against
the target's distribution. Drafts a tree level by level, each level feeding its own states back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import HeadConfig
from ..errors import InputError
from ..layers import DecoderLayer, Rotary
from ..ttt import to_device
from .base import Algorithm, DraftHead, HeadOutput, Predictions, feature_noise, window_mask


@dataclass(frozen=True)
class Eagle1Options:
    """EAGLE-1 heads have no settings of their own."""


class Eagle1Head(DraftHead):
    def __init__(self, config: HeadConfig, target=None) -> None:
        super().__init__(config, target)
        c = config
        h = c.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList(DecoderLayer(c, input_norm=i > 0) for i in range(c.num_layers))
        self.rotary = Rotary(c.head_dim, c.rope_theta)

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """The target's final states [..., H] are the head's input states as they are."""
        return target_features.to(self.fc.weight.dtype)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                allowed: torch.Tensor | None = None, cache=None, logits: bool | torch.Tensor = True) -> HeadOutput:
        """One draft step, as Eagle3Head.forward: the token after each state, the states, their positions."""
        emb = self.embed(input_ids)
        x = self.fc(torch.cat([emb, hidden.to(emb.dtype)], dim=-1))
        x = self.run_layers(x, None, position_ids.expand(input_ids.shape), allowed, cache)
        return self.outputs(x, logits)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        lm_head = self.shared["lm_head"]
        return lm_head(hidden.to(lm_head.weight.dtype))


class Eagle1(Algorithm):
    name = "eagle1"
    title = "EAGLE-1 (Li et al., 2024)"
    Options = Eagle1Options
    head_class = Eagle1Head
    drafting = "tree"

    def check(self, config: HeadConfig) -> None:
        super().check(config)
        if config.fused_layer_ids:
            raise InputError("an eagle1 head reads the final hidden state: fused_layer_ids must be empty")

    def reads(self, config: HeadConfig, num_target_layers: int) -> tuple[int, ...]:
        return (num_target_layers,)  # the decoder's normed output

    def unroll(self, head: Eagle1Head, input_ids: torch.Tensor, valid: torch.Tensor, states: torch.Tensor,
               settings: Any, generators: list[torch.Generator | None] | None = None) -> Predictions:
        """One step at every index t: token t+1 and the target's state at t; its state is held to the target's at
        t+1 and its logits to the target's distribution there."""
        b, t = input_ids.shape
        n, dev = t - 1, input_ids.device
        hidden = feature_noise(head.fuse(states[:, :n]), settings.feature_noise)
        out = head(input_ids[:, 1:], hidden, torch.arange(n, device=dev).expand(b, -1),
                   window_mask(head.config.sliding_window, b, n, dev), logits=False)
        keep = valid.cpu()[:, 1:].flatten().nonzero().squeeze(1)  # [P] flat (b, t) of the rows with loss
        at = to_device(keep, dev)
        picked = out.hidden.flatten(0, 1).index_select(0, at)  # [P, H]
        wanted = states[:, 1:].flatten(0, 1).index_select(0, at)
        return Predictions(picked, keep + keep // n + 1, [len(keep)], regression=(picked, wanted))

    def depth_weights(self, head: Eagle1Head, settings: Any, sizes: list[int]) -> list[float]:
        return [settings.ce_weight]

    def training_activations(self, config: HeadConfig, seq_len: int, loss_fraction: float, settings: Any,
                             itemsize: int, batch: int) -> tuple[dict[str, float], int]:
        from ..memory import ttt_activations, ttt_rows

        n0, rows, loss_rows = ttt_rows(seq_len, loss_fraction, 1)
        return ttt_activations(config, n0, rows, loss_rows, fused=False, itemsize=itemsize, batch=batch), sum(loss_rows)


ALGORITHM = Eagle1()
Eagle1Head.algorithm = ALGORITHM
