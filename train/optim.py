"""The optimizer and its learning-rate schedule."""

from __future__ import annotations

import math

import torch

from .config import RunConfig


def lr_lambda(config: RunConfig, total_steps: int):
    """Warmup, then constant, cosine or linear decay to min_lr_ratio: the factor on optim.lr at each step."""
    s = config.schedule

    def factor(step: int) -> float:
        if step < s.warmup_steps:
            return (step + 1) / (s.warmup_steps + 1)
        if s.kind == "constant":
            return 1.0
        progress = min(1.0, (step - s.warmup_steps) / max(1, total_steps - s.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if s.kind == "cosine" else 1 - progress
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * decay

    return factor


def optimizer_and_schedule(config: RunConfig, params, total_steps: int):
    """AdamW over `params` and its LambdaLR schedule (stepped by hand once per optimizer step: a prepared
    scheduler would step once per process)."""
    o = config.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config, total_steps))
