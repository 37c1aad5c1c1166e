"""What the fast losses in losses.py compute, written the plain way: every TTT step at every index, full logits,
then the loss mask. Slow (dense [T, (i+1)T] masks, a full-vocabulary softmax per position) but readable;
the tests hold the fast losses to these in value, metrics and gradients."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from eyas.models import DraftHead
from eyas.models.drafters.base import feature_noise

from .config import LossConfig
from .losses import Metrics


def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """torch's own soft-target cross-entropy: [..., V] x [..., V] -> [...]."""
    probs = torch.softmax(target_logits.float(), dim=-1)
    return F.cross_entropy(logits.flatten(0, -2), probs.flatten(0, -2), reduction="none").view(logits.shape[:-1])


def unroll(head: DraftHead, input_ids: torch.Tensor, hidden: torch.Tensor, steps: int, masked: bool = False) -> list:
    """Step i over all T-1 indices under the mask [causal | eye * i]: step i at index t sees step 0 at indices <= t
    and its own chain's steps 1..i at index t. Step i >= 1 reads the next teacher-forced token and the head's own
    state (EAGLE-3), or with `masked` the mask token and state (P-EAGLE). Returns one HeadOutput per step."""
    b, n = hidden.shape[:2]
    causal = torch.ones(n, n, dtype=torch.bool, device=hidden.device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=hidden.device)
    cache, outputs = head.new_cache(b, n * steps), []
    for i in range(min(steps, n)):
        ids = torch.cat([input_ids[:, 1 + i:], input_ids.new_zeros(b, i)], dim=1)
        if masked and i > 0:
            ids, hidden = head.mask_inputs((b, n), input_ids.device)
        mask = torch.cat([causal] + [eye] * i, dim=-1).expand(b, -1, -1)
        out = head(ids, hidden, (torch.arange(n, device=hidden.device) + i).expand(b, -1), mask, cache)
        hidden = head.feedback(out.hidden)
        outputs.append(out)
    return outputs


def eagle3_loss(head: DraftHead, input_ids: torch.Tensor, valid: torch.Tensor, features: torch.Tensor,
                target_logits: torch.Tensor, config: LossConfig, masked: bool = False) -> tuple[torch.Tensor, Metrics]:
    """An EAGLE-3 head's loss (losses.drafter_loss), every step at every index; with `masked`, a P-EAGLE head's with
    every depth at every anchor: depth i at t learns where the tokens t+1 .. t+1+i all carry loss, weighted 1."""
    b, t = input_ids.shape
    steps = head.options.depths if masked else config.ttt_steps
    target_top = target_logits.argmax(-1)
    in_vocab = head.t2d[target_top]
    restricted = target_logits.gather(-1, head.draft_to_target.expand(b, t, -1))
    hidden = feature_noise(head.fuse(features[:, : t - 1]), config.feature_noise)
    loss, metrics = 0.0, {}
    chain, first = torch.ones_like(valid[:, 1:]), None
    # P-EAGLE: each depth's mean weighted by its share of the rows (depth i: max(r^i, r_min)), normalised
    total = sum(max(head.options.depth_keep ** i, head.options.depth_keep_min) if i else 1.0
                for i in range(min(steps, t - 1))) if masked else 1
    for i, out in enumerate(unroll(head, input_ids, hidden, steps, masked)):
        logits = out.logits[:, : t - 1 - i]
        chain = chain[:, : t - 1 - i] & valid[:, 1 + i:]
        keep = (chain if masked else valid[:, 1 + i:]).float()
        count = keep.sum()
        share = max(head.options.depth_keep ** i, head.options.depth_keep_min) if masked and i else 1.0
        first = count if i == 0 else first  # P-EAGLE: depth i's sum over the rows it is drawn to have, share x first
        divisor = first * share if masked else count
        step_loss = (soft_ce(logits, restricted[:, 1 + i:]) * keep).sum() / divisor.clamp(min=1)
        loss = loss + (share / total if masked else config.step_decay ** i) * step_loss
        hit = head.to_target_ids(logits.argmax(-1)) == target_top[:, 1 + i:]
        metrics.update({f"loss/step{i}": step_loss.detach() * count, f"correct/step{i}": (hit.float() * keep).sum(),
                        f"count/step{i}": count, f"oov/step{i}": ((~in_vocab[:, 1 + i:]).float() * keep).sum()})
    return loss, metrics


def eagle1_loss(head: DraftHead, input_ids: torch.Tensor, valid: torch.Tensor, target_hidden: torch.Tensor,
                target_logits: torch.Tensor, config: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """An EAGLE-1 head's loss (losses.drafter_loss) at every index."""
    b, t = input_ids.shape
    out = head(input_ids[:, 1:], feature_noise(head.fuse(target_hidden[:, :-1]), config.feature_noise),
               torch.arange(t - 1, device=input_ids.device).expand(b, -1))
    keep = valid[:, 1:].float()
    count = keep.sum()
    feature = F.smooth_l1_loss(out.hidden, target_hidden[:, 1:], reduction="none").mean(-1)
    feature_loss = (feature * keep).sum() / count.clamp(min=1)
    ce_loss = (soft_ce(out.logits, target_logits[:, 1:]) * keep).sum() / count.clamp(min=1)
    correct = ((out.logits.argmax(-1) == target_logits[:, 1:].argmax(-1)).float() * keep).sum()
    loss = config.feature_weight * feature_loss + config.ce_weight * ce_loss
    return loss, {"loss/feature": feature_loss.detach() * count, "loss/step0": ce_loss.detach() * count,
                  "correct/step0": correct, "count/step0": count, "oov/step0": torch.zeros_like(count)}


def dflash_loss(head: DraftHead, input_ids: torch.Tensor, valid: torch.Tensor, features: torch.Tensor,
                target_logits: torch.Tensor, config: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """A DFlash head's loss (losses.drafter_loss) with a block at every anchor a (a >= 1 whose next token carries
    loss), each block run alone over the context states before a: position k learns the target's distribution at
    a + k - 1 where token a + k carries loss, weighted exp(-(k-1)/gamma) (the exp weighting)."""
    from eyas.models.drafters.dflash import _gamma

    b, t = input_ids.shape
    size = head.options.block_size
    gamma = head.options.gamma or _gamma(size)
    per_depth: list[list[torch.Tensor]] = [[] for _ in range(size - 1)]
    hits: list[list[torch.Tensor]] = [[] for _ in range(size - 1)]
    for row in range(b):
        for a in range(1, t - 1):
            if not valid[row, a + 1]:
                continue
            block = head.block(input_ids[row, a:a + 1], size)
            pos = a + torch.arange(size)[None]
            allowed = torch.ones(1, size, a + size, dtype=torch.bool)
            hidden = head(block, head.context(features[row:row + 1, :a]), pos, torch.arange(a)[None], allowed)
            logits = head.project(hidden)[0]
            for k in range(1, size):
                if a + k < t and valid[row, a + k]:
                    teacher = target_logits[row, a + k - 1]
                    per_depth[k - 1].append(soft_ce(logits[k:k + 1], teacher[None])[0] * math.exp(-(k - 1) / gamma))
                    hits[k - 1].append((logits[k].argmax() == teacher.argmax()).float())
    loss, metrics = 0.0, {}
    for i, (ces, hit) in enumerate(zip(per_depth, hits)):  # the block positions alike
        count = torch.tensor(float(len(ces)))
        depth_loss = torch.stack(ces).sum() / count.clamp(min=1) if ces else torch.zeros(())
        loss = loss + depth_loss / (size - 1)
        metrics.update({f"loss/step{i}": depth_loss.detach() * count, f"count/step{i}": count,
                        f"correct/step{i}": torch.stack(hit).sum() if hit else torch.zeros(()),
                        f"oov/step{i}": torch.zeros(())})
    return loss, metrics
