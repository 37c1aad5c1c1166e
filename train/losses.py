"""Distillation losses for EAGLE-1 and EAGLE-3 heads, and the per-step acceptance metrics.

Index convention (EAGLE): the target's feature at sequence index t together with token t+1 lets the
head predict token t+2, whose distribution the target gives in its logits at index t+1.

EAGLE-1: SmoothL1(head hidden at t, target final hidden at t+1) * feature_weight
         + soft CE(head logits at t, softmax(target logits at t+1)) * ce_weight.
EAGLE-3 training-time test (TTT), K unrolled steps as inference drafts them:
  step 0 at index t: token ids[t+1], hidden = fuse(target features at t), position t
  step i:            token ids[t+1+i] (teacher forcing), hidden = the head's own step i-1 output at t,
                     position t+i; it predicts token t+2+i from the target logits at t+1+i.
  The step-i query at t attends to step-0 keys at indices <= t and to its own earlier steps' keys at
  index t only, i.e. mask [T, (i+1)T] = [causal | eye | ... | eye] over a HeadCache grown per step.
  Loss = sum_i step_decay**i * soft CE against the target distribution restricted to the draft vocab
  (gathered through draft_to_target and renormalised).

Positions whose target argmax lies outside the draft vocab are kept in the soft CE: the renormalised
target distribution still says how to rank the tokens the head can propose, and dropping them would
bias training towards easy positions. They can never be accepted, so they count as misses in the
top-1 accuracy and are reported as `oov/step{i}` so a too-small draft vocab is visible.

Positions count only where the token whose target distribution is learned (index t+1+i) is inside
the sequence and loss-masked (an assistant token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eyas.models import DraftHead, HeadOutput

from .config import LossConfig

# Metric tensors are sums over positions (not means) so they add up across micro-batches and
# processes; `acceptance` turns them into rates.
Metrics = dict[str, torch.Tensor]


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """[..., V] x [..., V] -> [...]: cross-entropy of the head against softmax(target_logits)."""
    p = torch.softmax(target_logits.float(), dim=-1)
    return -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


def feature_noise(hidden: torch.Tensor, scale: float) -> torch.Tensor:
    """EAGLE reference augmentation: uniform noise (U-0.5) * scale * 512 / T on the input feature."""
    if scale <= 0:
        return hidden
    return hidden + (torch.rand_like(hidden) - 0.5) * (scale * 512 / hidden.shape[1])


def ttt_mask(length: int, step: int, batch: int, device: torch.device) -> torch.Tensor:
    """[B, T, (step+1)*T] bool: causal over step-0 keys, then the query's own index in each later step.

    Right padding needs no extra term: a real query only sees indices <= itself, all real.
    """
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=-1).expand(batch, -1, -1)


def eagle1_loss(head: DraftHead, input_ids: torch.Tensor, valid: torch.Tensor, target_hidden: torch.Tensor,
                target_logits: torch.Tensor, config: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """input_ids, valid [B, T]; target_hidden [B, T, H] final normed; target_logits [B, T, V]."""
    b, t = input_ids.shape
    n = t - 1
    position_ids = torch.arange(n, device=input_ids.device).expand(b, -1)
    hidden_in = feature_noise(head.fuse(target_hidden[:, :n]), config.feature_noise)
    out = head(input_ids[:, 1:], hidden_in, position_ids)
    keep = valid[:, 1:].float()  # [B, n]
    count = keep.sum()
    denom = count.clamp(min=1)
    feature = F.smooth_l1_loss(out.hidden.float(), target_hidden[:, 1:].float(), reduction="none").mean(-1)
    feature_loss = (feature * keep).sum() / denom
    ce_loss = (soft_cross_entropy(out.logits, target_logits[:, 1:]) * keep).sum() / denom
    loss = config.feature_weight * feature_loss + config.ce_weight * ce_loss
    correct = ((out.logits.argmax(-1) == target_logits[:, 1:].argmax(-1)).float() * keep).sum()
    metrics = {"loss/feature": feature_loss.detach() * count, "loss/ce": ce_loss.detach() * count,
               "correct/step0": correct, "count/step0": count, "oov/step0": torch.zeros_like(count)}
    return loss, metrics


def ttt_unroll(head: DraftHead, input_ids: torch.Tensor, hidden: torch.Tensor, steps: int) -> list[HeadOutput]:
    """The K draft steps of training-time test over every index at once.

    input_ids [B, T]; hidden [B, T-1, H] the fused step-0 input. Returns one HeadOutput
    (logits [B, T-1, Dv], hidden [B, T-1, H]) per step; step i at index t is what inference computes
    for draft depth i after the target's token t+1 (see the module docstring).
    """
    b, n = hidden.shape[:2]
    cache = head.new_cache()
    outputs = []
    for i in range(min(steps, n)):
        ids = torch.cat([input_ids[:, 1 + i:], input_ids.new_zeros(b, i)], dim=1)  # [B, n], zeros past the end
        position_ids = (torch.arange(n, device=input_ids.device) + i).expand(b, -1)
        out = head(ids, hidden, position_ids, ttt_mask(n, i, b, input_ids.device), cache)
        hidden = out.hidden
        outputs.append(out)
    return outputs


def eagle3_ttt_loss(head: DraftHead, input_ids: torch.Tensor, valid: torch.Tensor, target_features: torch.Tensor,
                    target_logits: torch.Tensor, config: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """input_ids, valid [B, T]; target_features [B, T, F] fused-layer inputs; target_logits [B, T, V]."""
    b, t = input_ids.shape
    target_top = target_logits.argmax(-1)  # [B, T] in target ids
    in_vocab = head.t2d[target_top]  # [B, T]
    restricted = target_logits.gather(-1, head.draft_to_target.expand(b, t, -1))  # [B, T, Dv]
    hidden = feature_noise(head.fuse(target_features[:, : t - 1]), config.feature_noise)
    loss = target_logits.new_zeros((), dtype=torch.float32)
    metrics: Metrics = {}
    for i, out in enumerate(ttt_unroll(head, input_ids, hidden, config.ttt_steps)):
        m = t - 1 - i  # only indices whose target logits (at t+1+i) exist
        logits = out.logits[:, :m]
        keep = valid[:, 1 + i:].float()  # [B, m]
        count = keep.sum()
        step_loss = (soft_cross_entropy(logits, restricted[:, 1 + i:]) * keep).sum() / count.clamp(min=1)
        loss = loss + config.step_decay ** i * step_loss
        hit = head.to_target_ids(logits.argmax(-1)) == target_top[:, 1 + i:]
        metrics[f"loss/step{i}"] = step_loss.detach() * count
        metrics[f"correct/step{i}"] = (hit.float() * keep).sum()
        metrics[f"count/step{i}"] = count
        metrics[f"oov/step{i}"] = ((~in_vocab[:, 1 + i:]).float() * keep).sum()
    return loss, metrics


class DistillationLoss(nn.Module):
    """The trainable head and its loss as one module, so DDP/DeepSpeed see one forward per micro-batch
    (the TTT unroll calls the head K times) and the frozen target stays outside the wrapped model."""

    def __init__(self, head: DraftHead, config: LossConfig) -> None:
        super().__init__()
        self.head = head
        self.config = config

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor, target_states: torch.Tensor,
                target_logits: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        """target_states: [B, T, H] final hidden (eagle1) or [B, T, F] fused-layer features (eagle3)."""
        fn = eagle3_ttt_loss if self.head.config.head_type == "eagle3" else eagle1_loss
        return fn(self.head, input_ids, valid, target_states, target_logits, self.config)


def acceptance(metrics: dict[str, float]) -> dict[str, float]:
    """Per-step top-1 accuracy acc_i and the chain estimate of the acceptance length
    tau = 1 + sum_k prod_{j<=k} acc_j (each teacher-forced step's accuracy read as the chance it is
    accepted given the earlier ones were; the 1 is the token the target always adds)."""
    out: dict[str, float] = {}
    tau, chain, i = 1.0, 1.0, 0
    while f"count/step{i}" in metrics:
        count = max(metrics[f"count/step{i}"], 1.0)
        acc = metrics[f"correct/step{i}"] / count
        out[f"acc/step{i}"] = acc
        out[f"oov/step{i}"] = metrics[f"oov/step{i}"] / count
        chain *= acc
        tau += chain
        i += 1
    out["tau"] = tau
    return out
