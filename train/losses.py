"""Distillation losses for EAGLE-1 and EAGLE-3 heads, and the per-step acceptance metrics.

Index convention (EAGLE): the target's feature at sequence index t together with token t+1 lets the
head predict token t+2, whose distribution the target gives in its logits at index t+1.

EAGLE-1: SmoothL1(head hidden at t, target final hidden at t+1) * feature_weight
         + soft CE(head logits at t, softmax(target logits at t+1)) * ce_weight.
EAGLE-3 training-time test (TTT), K unrolled steps as inference drafts them:
  step 0 at index t: token ids[t+1], hidden = fuse(target features at t), position t
  step i:            token ids[t+1+i] (teacher forcing), hidden = the head's own step i-1 output at t,
                     position t+i; it predicts token t+2+i from the target logits at t+1+i.
  The step-i query at t attends to step-0 keys at indices <= t and to its own steps' keys 1..i at
  index t only, i.e. mask [T, (i+1)T] = [causal | eye | ... | eye]; the TTTAttention scores the eye
  blocks as elementwise products instead of dense [T, T] blocks.
  Loss = sum_i step_decay**i * soft CE against the target distribution restricted to the draft vocab
  (gathered through draft_to_target and renormalised).

Cost (the head step must stay cheaper than the target forward): the result equals evaluating every
step at every index, but work is spent only where it can reach the loss. Step 0 runs up to the last
index that leads to a loss (attention is causal, so later ones are read by nobody); there every index
leaves its keys (later steps attend to them) but the last layer's MLP runs only at the indices that
lead to a loss; step i >= 1 runs only at the indices that still carry loss at some step >= i (their
step-i keys are only ever read by their own later steps, so the dropped rows change nothing), packed
across the batch without padding; the own-chain (eye) attention terms are elementwise (TTTAttention);
the vocabulary projection and the soft CE run only at rows that carry loss at that step, in one
matmul for all steps; the teacher is cut to the draft vocabulary and the loss-carrying rows once,
before any step. What remains is matmuls (~80% of the step, profiled on
SmolLM2-135M: ~40% that projection, forward and two backward products of [rows, H] x [H, draft
vocab], ~35% the layer's own).

Positions whose target argmax lies outside the draft vocab are kept in the soft CE: the renormalised
target distribution still says how to rank the tokens the head can propose, and dropping them would
bias training towards easy positions. They can never be accepted, so they count as misses in the
top-1 accuracy and are reported as `oov/step{i}` so a too-small draft vocab is visible.

Positions count only where the token whose target distribution is learned (index t+1+i) is inside
the sequence and loss-masked (an assistant token).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import nn

from eyas.models import DraftHead
from eyas.models.ttt import TTTAttention

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


def feature_noise(hidden: torch.Tensor, scale: float) -> torch.Tensor:
    """EAGLE reference augmentation: uniform noise (U-0.5) * scale * 512 / T on the input feature."""
    if scale <= 0:
        return hidden
    return hidden + (torch.rand_like(hidden) - 0.5) * (scale * 512 / hidden.shape[1])


def eagle1_loss(head: DraftHead, input_ids: torch.Tensor, valid: torch.Tensor, target_hidden: torch.Tensor,
                target_logits: Teacher, config: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """input_ids, valid [B, T]; target_hidden [B, T, H] final normed; target_logits: the teacher (see Teacher)."""
    b, t = input_ids.shape
    n = t - 1
    dev = input_ids.device
    position_ids = torch.arange(n, device=dev).expand(b, -1)
    hidden_in = feature_noise(head.fuse(target_hidden[:, :n]), config.feature_noise)
    out = head(input_ids[:, 1:], hidden_in, position_ids, _causal_mask(head, b, n, dev), logits=False)
    keep = valid.cpu()[:, 1:].flatten().nonzero().squeeze(1)  # [P] flat (b, t) of the rows with loss (host-side)
    at = _to(keep, dev)
    count = torch.full((), float(len(keep)), device=dev)
    denom = count.clamp(min=1)
    hidden = out.hidden.flatten(0, 1).index_select(0, at)  # [P, H]: only rows with loss reach the lm_head
    wanted = target_hidden[:, 1:].flatten(0, 1).index_select(0, at)
    feature = F.smooth_l1_loss(hidden.float(), wanted.float(), reduction="none").mean(-1)
    feature_loss = feature.sum() / denom
    rows = keep + keep // n + 1  # the flat [B, T] index of (b, t + 1)
    teacher = torch.cat([_logit_rows(target_logits, _to(rows[block], dev))
                         for block in _blocks(len(rows), _teacher_block(head.config.vocab_size, dev))])  # [P, V]
    logits = head.project(hidden)  # [P, V]
    ce_loss = soft_cross_entropy(logits, teacher).sum() / denom
    loss = config.feature_weight * feature_loss + config.ce_weight * ce_loss
    correct = (logits.argmax(-1) == teacher.argmax(-1)).sum().float()
    metrics = {"loss/feature": feature_loss.detach() * count, "loss/ce": ce_loss.detach() * count,
               "correct/step0": correct, "count/step0": count, "oov/step0": torch.zeros_like(count)}
    return loss, metrics


def eagle3_ttt_loss(head: DraftHead, input_ids: torch.Tensor, valid: torch.Tensor, target_features: torch.Tensor,
                    target_logits: Teacher, config: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """input_ids, valid [B, T]; target_features [B, T, F] fused-layer inputs; target_logits: the teacher (Teacher).

    Which rows run at which step depends only on `valid`: that bookkeeping is done on the host, from one copy of
    `valid`, so the unroll launches device work without waiting on it (no data-dependent shapes on the device)."""
    b, t = input_ids.shape
    dev = input_ids.device
    plan = _TTTPlan(valid.cpu(), min(config.ttt_steps, t - 1))
    # Teacher rows: every loss-carrying index u >= 1, cut to the draft vocab before anything else.
    target_top, restricted = _teacher_rows(target_logits, plan.taught, head.draft_to_target,
                                           head.config.vocab_size, dev)
    probs = torch.softmax(restricted.float(), dim=-1)  # [P, Dv]
    in_vocab = head.t2d[target_top]  # [P]

    # The feature noise is drawn at full length so it equals what every-index evaluation draws; indices after the
    # last one that leads to a loss are read by nobody (attention is causal) and dropped.
    n = plan.n
    hidden = feature_noise(head.fuse(target_features[:, :t - 1]), config.feature_noise)[:, :n]  # [B, n, H]

    # Rows are flat (b, t) -> b * n + t. Step 0 runs batched over every index [B, n] (causal): all of
    # them leave keys/values, but the last layer's MLP runs only at the rows that lead to a loss
    # (TTTAttention.step0_rows). Step i >= 1 runs packed as one sequence [1, P_i] over the rows that
    # still lead to a loss (no padding between batch rows; the TTTAttention keeps each row's attention
    # within its own batch element).
    cache = TTTAttention(head.config.num_layers, step0_rows=_to(plan.rows[0], dev), window=head.config.sliding_window)
    ids, positions = input_ids[:, 1:n + 1], torch.arange(n, device=dev).expand(b, n)  # step 0: token t+1 at index t
    picked = []  # per step: hidden [P'_i, H] of the rows with loss there
    for i in range(plan.steps):
        if i > 0:  # the rows of step i are a subset of step i-1's: keep those, feed back their hidden
            keep, at, bat = (_to(x, dev) for x in (plan.keep[i], plan.at[i], plan.batch[i]))
            hidden = hidden.index_select(0, keep)
            cache.next_step(at, plan.batch_sizes[i], keep)
            # teacher forcing: token t+1+i (inside the sequence for needed rows)
            ids, positions, hidden = input_ids[bat, at + 1 + i][None], (at + i)[None], hidden[None]
        step0_mask = _causal_mask(head, b, n, dev) if i == 0 else None
        hidden = head(ids, hidden, positions, step0_mask, cache, logits=False).hidden.flatten(0, 1)  # [P_i, H]
        picked.append(hidden.index_select(0, _to(plan.selected[i], dev)))
    # One projection for all steps: one large matmul and one weight-gradient product instead of K.
    logits = head.project(torch.cat(picked))  # [sum P_i, Dv]
    teacher = _to(torch.cat(plan.teacher), dev)
    sizes = [len(r) for r in plan.teacher]
    hit = (head.to_target_ids(logits.argmax(-1)) == target_top[teacher]).split(sizes)
    ce = _cross_entropy(logits, probs, teacher, consume=True).split(sizes)  # logits are not read after this
    oov = (~in_vocab[teacher]).split(sizes)
    counts = _to(torch.tensor(sizes, dtype=torch.float32), dev)
    loss = counts.new_zeros(())
    metrics: Metrics = {}
    for i in range(plan.steps):
        count = counts[i]
        step_loss = ce[i].sum() / count.clamp(min=1)
        loss = loss + config.step_decay ** i * step_loss
        metrics[f"loss/step{i}"] = step_loss.detach() * count
        metrics[f"correct/step{i}"] = hit[i].sum().float()
        metrics[f"count/step{i}"] = count
        metrics[f"oov/step{i}"] = oov[i].sum().float()
    return loss, metrics


class _TTTPlan:
    """Host-side row bookkeeping of the TTT unroll, from valid [B, T] (CPU): which flat rows b * n + t run at each
    step, which of them carry loss, and the teacher row each of those learns from."""

    def __init__(self, valid: torch.Tensor, steps: int) -> None:
        b, t = valid.shape
        n = t - 1
        self.steps = steps
        taught = valid.clone()
        taught[:, 0] = False  # index 0 is never predicted
        self.taught = taught.flatten().nonzero().squeeze(1)  # [P] flat [B, T] rows of the teacher tables
        teacher_row = taught.flatten().long().cumsum(0).view(b, t) - 1  # [B, T] row of (b, u) in those tables
        # carries[i][:, t]: step i at index t learns the distribution at t+1+i, which carries loss
        shifted = torch.cat([valid[:, 1:], valid.new_zeros(b, steps)], dim=1)  # [B, n + steps]
        carries = torch.stack([shifted[:, i:i + n] for i in range(steps)])  # [K, B, n]
        needed = carries.flip(0).cumsum(0, dtype=torch.int32).flip(0) > 0  # step i still leads to a loss
        last = needed[0].any(0).nonzero()  # [L, 1] indices that lead to a loss in some batch element
        n = self.n = int(last.max()) + 1 if len(last) else 1
        carries, needed = carries[..., :n], needed[..., :n]
        t_of = torch.arange(n).repeat(b)  # [B*n] index t of each flat row
        b_of = torch.arange(b).repeat_interleave(n)  # [B*n] its batch element
        self.rows, self.keep, self.at, self.batch, self.batch_sizes = [], [], [], [], []
        self.selected, self.teacher = [], []
        rows = needed[0].flatten().nonzero().squeeze(1)  # [P_0] flat rows of step 0, ascending
        for i in range(steps):
            keep = needed[i].flatten()[rows].nonzero().squeeze(1)  # [P_i] which of step i-1's rows go on
            rows = rows if i == 0 else rows[keep]
            at, bat = t_of[rows], b_of[rows]
            self.rows.append(rows)
            self.keep.append(keep)
            self.at.append(at)
            self.batch.append(bat)
            self.batch_sizes.append(bat.bincount(minlength=b).tolist())
            sel = carries[i].flatten()[rows].nonzero().squeeze(1)  # [P'_i] rows with loss at this step
            self.selected.append(sel)
            self.teacher.append(teacher_row[bat[sel], at[sel] + 1 + i])


def _to(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device (pinned, asynchronous copy on CUDA)."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def _causal_mask(head: DraftHead, b: int, n: int, device: torch.device) -> torch.Tensor | None:
    """Step 0's mask [B, n, n]: None (plain causal) unless the head attends within a sliding window."""
    window = head.config.sliding_window
    if window is None:
        return None
    i = torch.arange(n, device=device)
    return ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)).expand(b, n, n)


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
        full = _logit_rows(teacher, _to(rows[block], device))  # [block, V]
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
                target_logits: Teacher) -> tuple[torch.Tensor, Metrics]:
        """target_states: [B, T, H] final hidden (eagle1) or [B, T, F] fused-layer features (eagle3)."""
        fn = eagle3_ttt_loss if self.head.config.head_type == "eagle3" else eagle1_loss
        with batch_embedding(self.head, input_ids):
            return fn(self.head, input_ids, valid, target_states, target_logits, self.config)


class _BatchEmbedding(nn.Module):
    """The target's embedding rows of one batch's distinct ids, looked up once: every TTT step reads its tokens
    (all of them ids of the batch, by teacher forcing) from these rows, so a sharded embedding is gathered once per
    micro-batch, not once per step."""

    def __init__(self, embedding: nn.Module, input_ids: torch.Tensor) -> None:
        super().__init__()
        self.ids = torch.unique(input_ids)  # [U] ascending
        with torch.no_grad():
            self.rows = embedding(self.ids)  # [U, H]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows[torch.searchsorted(self.ids, ids.contiguous())]


@contextlib.contextmanager
def batch_embedding(head: DraftHead, input_ids: torch.Tensor):
    """The head borrows the batch's embedding rows (see _BatchEmbedding) instead of the target's embedding."""
    embedding = head.shared["embed_tokens"]
    head.shared["embed_tokens"] = _BatchEmbedding(embedding, input_ids)
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
