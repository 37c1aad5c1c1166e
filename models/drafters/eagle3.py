"""EAGLE-3 (Li et al., 2025) and its 3.1 normalisations.

    x_0 = fc(norms(concat of fused target states))               (step 0; a later step feeds back the head's state)
    h   = layers(x, emb(token))    first layer: attention over [input_layernorm(emb); hidden_norm(x)]
    logits = lm_head(norm(h)) over the draft vocabulary, mapped to target ids by d2t

Trained with training-time test (models/ttt.py): K steps unrolled as inference drafts them, step i feeding the
teacher-forced token and the head's own state of step i-1. Drafts a tree level by level (EAGLE-2).

The variants runtimes read (speculators / vLLM field names): `norm_before_residual`, `fc_norm` (EAGLE-3.1: one
RMSNorm per fused state before the fc), `norm_before_fc` (one RMSNorm over their concatenation; exclusive with
fc_norm), `norm_output` (EAGLE-3.1: the post-norm state is what the next step reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import HeadConfig, default_fused_layer_ids
from ..errors import InputError
from ..layers import DecoderLayer, RMSNorm, Rotary
from ..ttt import TTTPlan, unroll
from .base import Algorithm, DraftHead, DraftVocab, HeadOutput, Predictions, feature_noise, window_mask


@dataclass(frozen=True)
class Eagle3Options:
    # The first layer's residual is hidden_norm(state) instead of the raw state (speculators'
    # `norm_before_residual`, which most released RedHatAI heads were trained with).
    norm_before_residual: bool = False
    # EAGLE-3.1: one RMSNorm per fused target state before the fusion fc (`fc_norm`): states of layers whose
    # magnitudes differ by orders enter the fc on one scale.
    fc_norm: bool = False
    # One RMSNorm over the concatenated fused states before the fc (`norm_before_fc`, gpt-oss style); exclusive
    # with fc_norm.
    norm_before_fc: bool = False
    # EAGLE-3.1: the head's post-norm state (what its lm_head reads) is what the next drafting step reads
    # (`norm_output`), so the state's magnitude does not drift with depth.
    norm_output: bool = False


class Eagle3Head(DraftVocab, DraftHead):
    def __init__(self, config: HeadConfig, target=None) -> None:
        super().__init__(config, target)
        c, o = config, config.options
        h = c.hidden_size
        self.fc_norm = (nn.ModuleList(RMSNorm(h, c.rms_norm_eps) for _ in c.fused_layer_ids)
                        if o.fc_norm else None)
        self.input_norm = RMSNorm(c.feature_size, c.rms_norm_eps) if o.norm_before_fc else None
        self.fc = nn.Linear(c.feature_size, h, bias=False)
        self.layers = nn.ModuleList(
            DecoderLayer(c, fuse_embedding=i == 0, norm_before_residual=o.norm_before_residual)
            for i in range(c.num_layers))
        self.rotary = Rotary(c.head_dim, c.rope_theta)
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.init_vocab(c)

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """Fused target states [..., feature_size] -> the head's step-0 state [..., H]."""
        x = target_features.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.split(self.config.hidden_size, -1))], -1)
        return self.fc(x)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                allowed: torch.Tensor | None = None, cache=None, logits: bool | torch.Tensor = True) -> HeadOutput:
        """One draft step: input_ids [B, T] (the token *after* the position whose state is in `hidden`, as in EAGLE),
        hidden [B, T, H] from `fuse` or a previous step's `feedback`, position_ids [B, T]; allowed, cache: see
        DraftHead.run_layers; logits: see DraftHead.outputs."""
        emb = self.embed(input_ids)
        position_ids = position_ids.expand(input_ids.shape)  # the frontier of a level shares one position
        x = self.run_layers(hidden.to(emb.dtype), emb, position_ids, allowed, cache)
        return self.outputs(x, logits)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def feedback(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden) if self.options.norm_output else hidden


class Eagle3(Algorithm):
    name = "eagle3"
    title = "EAGLE-3 (Li et al., 2025), with the EAGLE-3.1 normalisations as options"
    Options = Eagle3Options
    head_class = Eagle3Head
    drafting = "tree"
    reduced_vocab = True

    def check(self, config: HeadConfig) -> None:
        super().check(config)
        if not config.fused_layer_ids:
            raise InputError(f"a {self.name} head needs fused_layer_ids (e.g. [2, N//2, N-3])")
        if config.options.fc_norm and config.options.norm_before_fc:
            raise InputError("fc_norm and norm_before_fc are exclusive: one norm per fused state, or one over "
                             "their concatenation")

    def default_layers(self, num_target_layers: int, num_layers: int) -> tuple[int, ...]:
        return default_fused_layer_ids(num_target_layers)

    def unroll(self, head: Eagle3Head, input_ids: torch.Tensor, valid: torch.Tensor, states: torch.Tensor,
               settings: Any, generators: list[torch.Generator | None] | None = None) -> Predictions:
        """Training-time test: K = settings.ttt_steps steps; step i at index t reads token t+1+i (teacher forcing)
        and the head's own state of step i-1 at t, and learns the target's distribution at t+1+i."""
        b, t = input_ids.shape
        plan = TTTPlan(valid.cpu(), min(settings.ttt_steps, t - 1))
        # the noise is drawn at full length so it equals what every-index evaluation draws; indices after the last
        # one that leads to a loss are read by nobody (attention is causal) and dropped
        hidden = feature_noise(head.fuse(states[:, :t - 1]), settings.feature_noise)[:, :plan.n]

        def later(i: int, at: torch.Tensor, bat: torch.Tensor, previous: torch.Tensor):
            return input_ids[bat, at + 1 + i][None], head.feedback(previous)[None]

        picked = unroll(head, input_ids, hidden, plan, later, window_mask(head.config.sliding_window, b, plan.n,
                                                                           input_ids.device))
        return Predictions(torch.cat(picked), torch.cat(plan.teacher), [len(r) for r in plan.teacher])

    def training_activations(self, config: HeadConfig, seq_len: int, loss_fraction: float, settings: Any,
                             itemsize: int, batch: int) -> tuple[dict[str, float], int]:
        from ..memory import ttt_activations, ttt_rows

        n0, rows, loss_rows = ttt_rows(seq_len, loss_fraction, min(settings.ttt_steps, seq_len - 1))
        return ttt_activations(config, n0, rows, loss_rows, fused=True, itemsize=itemsize, batch=batch), sum(loss_rows)


ALGORITHM = Eagle3()
Eagle3Head.algorithm = ALGORITHM
