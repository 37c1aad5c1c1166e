"""The distillation loss every drafter trains with, and the per-depth acceptance metrics.

A drafter's training unroll (its algorithm's `unroll`, models/drafters) says what the head predicted: its states
at the rows that carry loss, depth by depth (depth i: draft position i + 1), and the flat row of the batch whose
target distribution each learns. The loss here is the same for every algorithm:
  loss = sum_i weights[i] * mean soft CE(head logits at depth i, target distribution at its rows)
         [+ feature_weight * SmoothL1(head state, target state): EAGLE-1's feature regression]
with the weights the algorithm gives (EAGLE-3: step_decay ** i; EAGLE-1: ce_weight; P-EAGLE: 1 per depth).
The target distribution is restricted to the draft vocabulary (gathered through draft_to_target) and
renormalised.

Cost: the teacher's logits are computed only at the distinct rows the predictions learn from, in blocks, through
the target's own head (`target_teacher`): never [B, T, V]. The vocabulary projection and the soft CE run only at
rows that carry loss, in one matmul for all depths, and the soft CE overwrites its input instead of allocating
(`_SoftCrossEntropy`). What remains is matmuls (~80% of an EAGLE-3 step, profiled on SmolLM2-135M: ~40% that
projection, forward and two backward products of [rows, H] x [H, draft vocab], ~35% the layer's own).

Positions whose target argmax lies outside the draft vocab are kept in the soft CE: the renormalised target
distribution still says how to rank the tokens the head can propose, and dropping them would bias training
towards easy positions. They can never be accepted, so they count as misses in the top-1 accuracy and are
reported as `oov/step{i}` so a too-small draft vocab is visible.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import nn

from eyas.models import DraftHead
from eyas.models.drafters.base import Predictions
from eyas.models.ttt import to_device

from .config import LossConfig

# Metric tensors are sums over positions (not means) so they add up across micro-batches and
# processes; `acceptance` turns them into rates.
Metrics = dict[str, torch.Tensor]
# The teacher: the target's logits [B, T, V], or a function from flat rows [n] (b * T + t) of the batch to their
# logits [n, V] (the trainer's: the target's own logits of those rows' hidden states), so only the rows that carry
# loss are ever computed.
Teacher = Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """[..., V] x [..., V] -> [...]: cross-entropy of the head against softmax(target_logits)."""
    probs = torch.softmax(target_logits.float(), dim=-1).flatten(0, -2)
    return _cross_entropy(logits.flatten(0, -2), probs).view(logits.shape[:-1])


def _cross_entropy(logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor | None = None,
                   consume: bool = False) -> torch.Tensor:
    """logits [N, V] against probs[rows] (probs [P, V], rows [N]; None: probs is [N, V]) -> [N].
    consume: the caller no longer reads `logits` (fp32) after this call, so they are overwritten (by
    exp(z - max z), then by the gradient) instead of a fresh [N, V] buffer being made."""
    return _SoftCrossEntropy.apply(logits.float(), probs, rows, consume)


class _SoftCrossEntropy(torch.autograd.Function):
    """Soft CE with few passes over the [N, V] logits: CE = logsumexp(z) - <p, z> (p sums to 1),
    dCE/dz = softmax(z) - p. The forward keeps e = exp(z - max z) and its row sums s, so the backward
    is two in-place passes, g * e / s - g * p, over that same buffer, which becomes the gradient. In
    blocks of rows so the teacher rows gathered per block stay small, and with no fresh [N, V]
    temporary (on CPU a fresh buffer's page faults cost as much as a pass over it). Autograd through
    log_softmax, a product, a sum and an indexed copy of the teacher rows cost about twice as much
    (profiled: ~10% of the EAGLE-3 head step). The teacher distribution gets no gradient."""

    BLOCK = 256  # rows per block: [256, 8192] fp32 = 8 MiB

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor | None,
                consume: bool) -> torch.Tensor:
        if probs.requires_grad:
            raise ValueError("soft cross-entropy: the teacher distribution must not require grad")
        exp = logits if consume else torch.empty_like(logits)  # [N, V]
        ce, sums = [], []
        for block in _blocks(len(logits), _SoftCrossEntropy.BLOCK):
            z, e = logits[block], exp[block]
            # <p, z> as a batched [1, V] x [V, 1] product (no [block, V] temporary), before z is overwritten
            dot = torch.bmm(_teacher(probs, rows, block)[:, None], z[:, :, None]).view(-1)
            top = z.amax(-1, keepdim=True)
            s = torch.sub(z, top, out=e).exp_().sum(-1)
            ce.append(top.squeeze(1) + s.log() - dot)
            sums.append(s)
        ctx.save_for_backward(exp, probs, rows, torch.cat(sums))
        return torch.cat(ce)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # The saved buffer is overwritten: a second backward through this graph fails on its version check.
        exp, probs, rows, sums = ctx.saved_tensors
        for block in _blocks(len(exp), _SoftCrossEntropy.BLOCK):
            g = grad[block, None]
            exp[block].mul_(g / sums[block, None]).addcmul_(_teacher(probs, rows, block), g, value=-1)
        return exp, None, None, None


def _blocks(n: int, size: int) -> list[slice]:
    """Slices of `size` rows covering n rows; one empty slice when n == 0, so the results concatenate."""
    return [slice(i, i + size) for i in range(0, max(n, 1), size)]


def _teacher(probs: torch.Tensor, rows: torch.Tensor | None, block: slice) -> torch.Tensor:
    """The teacher distribution of the logit rows in `block`: [len(block), V]."""
    return probs[block] if rows is None else probs.index_select(0, rows[block])


def drafter_loss(head: DraftHead, input_ids: torch.Tensor, valid: torch.Tensor, states: torch.Tensor,
                 target_logits: Teacher, config: LossConfig, seeds: list[int] | None = None
                 ) -> tuple[torch.Tensor, Metrics]:
    """The head's algorithm's training unroll, then the distillation loss of its predictions. input_ids, valid
    [B, T] (valid: the token carries loss); states [B, T, F]: the target states the head reads; seeds: one per row
    for the unroll's random choices (None: the global generator)."""
    algorithm = head.algorithm
    pred = algorithm.unroll(head, input_ids, valid, states, config, generators(seeds))
    return distill(head, pred, target_logits, config, algorithm.depth_weights(head, config, pred.sizes))


def generators(seeds: list[int] | None) -> list[torch.Generator | None] | None:
    """One CPU generator per row (the unrolls draw on the host), or None."""
    return None if seeds is None else [torch.Generator().manual_seed(s) for s in seeds]


def distill(head: DraftHead, pred: Predictions, target_logits: Teacher, config: LossConfig,
            weights: list[float]) -> tuple[torch.Tensor, Metrics]:
    """The distillation loss of an unroll's predictions: per depth i, the mean soft cross-entropy of the head's
    distribution against the target's at the rows it learns (restricted to the draft vocabulary and renormalised),
    weighted by weights[i]; plus config.feature_weight x a SmoothL1 feature regression where the algorithm has one.

    Teacher rows are computed once per distinct row, cut to the draft vocabulary before anything else, in blocks
    (never [B, T, V]). One vocabulary projection for all depths: one large matmul and one weight-gradient product
    instead of one per depth."""
    dev = pred.hidden.device
    rows, inverse = torch.unique(pred.teacher, return_inverse=True)  # host: each distinct teacher row once
    target_top, restricted = _teacher_rows(target_logits, rows, head.draft_to_target, head.config.vocab_size, dev)
    probs = torch.softmax(restricted.float(), dim=-1)  # [U, Dv]
    teacher = to_device(inverse, dev)
    logits = head.project(pred.hidden)  # [P, Dv]
    hit = (head.to_target_ids(logits.argmax(-1)) == target_top[teacher]).split(pred.sizes)
    ce = _cross_entropy(logits, probs, teacher, consume=True)  # logits are not read after this
    weighted = head.algorithm.row_weights(head, pred, ce.detach())
    ce = (ce if weighted is None else ce * weighted).split(pred.sizes)
    oov = (~head.can_propose(target_top)[teacher]).split(pred.sizes)
    counts = to_device(torch.tensor(pred.sizes, dtype=torch.float32), dev)
    loss = counts.new_zeros(())
    metrics: Metrics = {}
    for i, weight in enumerate(weights):
        count = counts[i]
        depth_loss = ce[i].sum() / (count.clamp(min=1) if pred.per_depth is None else max(pred.per_depth[i], 1.0))
        loss = loss + weight * depth_loss
        metrics[f"loss/step{i}"] = depth_loss.detach() * count
        metrics[f"correct/step{i}"] = hit[i].sum().float()
        metrics[f"count/step{i}"] = count
        metrics[f"oov/step{i}"] = oov[i].sum().float()
    if pred.regression is not None:
        ours, wanted = pred.regression
        feature = F.smooth_l1_loss(ours.float(), wanted.float(), reduction="none").mean(-1)
        count = counts[0]
        feature_loss = feature.sum() / count.clamp(min=1)
        loss = loss + config.feature_weight * feature_loss
        metrics["loss/feature"] = feature_loss.detach() * count
    return loss, metrics


def target_teacher(target, hidden: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The teacher of a batch whose target decoder outputs are `hidden` [B, T, H]: flat rows [n] -> the target's
    own logits there [n, V] (Target.logits: whatever the model does after its decoder)."""
    flat = hidden.flatten(0, 1)

    def teacher(rows: torch.Tensor) -> torch.Tensor:
        return target.logits(flat.index_select(0, rows).to(target.dtype))

    return teacher


def _teacher_rows(teacher: Teacher, rows: torch.Tensor, columns: torch.Tensor, vocab: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's logits at flat rows `rows` [P] (host): their argmax over the full vocabulary [P] and their
    logits at `columns` [P, C]. In blocks of rows, so no [P, V] (let alone [B, T, V]) is ever held."""
    top, cut = [], []
    for block in _blocks(len(rows), _teacher_block(vocab, device)):
        full = _logit_rows(teacher, to_device(rows[block], device))  # [block, V]
        top.append(full.argmax(-1))
        cut.append(full.index_select(1, columns))
    return torch.cat(top), torch.cat(cut)


def _teacher_block(vocab: int, device: torch.device) -> int:
    """Rows per block of teacher logits [rows, vocab]: a fixed byte budget, small on a CPU so a block stays in
    cache, larger on a GPU to amortise the calls."""
    budget = (8 << 20) if device.type == "cpu" else (1 << 30)
    return max(1, budget // (4 * vocab))


def _logit_rows(teacher: Teacher, rows: torch.Tensor) -> torch.Tensor:
    """Teacher logits at flat rows [n] of the [B, T] batch -> [n, V]."""
    if isinstance(teacher, torch.Tensor):
        return teacher.flatten(0, 1).index_select(0, rows)
    return teacher(rows)


class DistillationLoss(nn.Module):
    """The trainable head and its loss as one module, so DDP/DeepSpeed see one forward per micro-batch
    (the TTT unroll calls the head K times) and the frozen target stays outside the wrapped model."""

    def __init__(self, head: DraftHead, config: LossConfig) -> None:
        super().__init__()
        self.head = head
        self.config = config

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor, target_states: torch.Tensor,
                target_logits: Teacher, seeds: list[int] | None = None) -> tuple[torch.Tensor, Metrics]:
        """input_ids, valid [B, T]; target_states [B, T, F]: the target states the head reads (head.reads),
        concatenated; target_logits: the teacher (Teacher); seeds: one per row for the unroll's random choices."""
        with batch_embedding(self.head, input_ids):
            return drafter_loss(self.head, input_ids, valid, target_states, target_logits, self.config, seeds)


class _BatchEmbedding(nn.Module):
    """The target's embedding rows of one batch's distinct ids and the head's own tokens (a mask token), looked up
    once: every unroll step reads its tokens from these rows (the batch's, by teacher forcing, or the mask), so a
    sharded embedding is gathered once per micro-batch, not once per step."""

    def __init__(self, embedding: nn.Module, input_ids: torch.Tensor, own: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.ids = torch.unique(torch.cat([input_ids.flatten(), input_ids.new_tensor(own)]))  # [U] ascending
        with torch.no_grad():
            self.rows = embedding(self.ids)  # [U, H]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows[torch.searchsorted(self.ids, ids.contiguous())]


@contextlib.contextmanager
def batch_embedding(head: DraftHead, input_ids: torch.Tensor):
    """The head borrows the batch's embedding rows (see _BatchEmbedding) instead of the target's embedding."""
    embedding = head.shared["embed_tokens"]
    head.shared["embed_tokens"] = _BatchEmbedding(embedding, input_ids, head.own_tokens)
    try:
        yield
    finally:
        head.shared["embed_tokens"] = embedding


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
