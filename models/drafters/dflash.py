"""DFlash, block drafting (z-lab; Chen et al., 2026): a few decoder layers denoise a block of mask tokens in one
forward, conditioned on the target's own states injected into every layer.

    context c = hidden_norm(fc(concat of several target layers' states))          at positions < the anchor
    block     = [the anchor (the last accepted token), mask, mask, ...]           at the anchor's position onwards
    layer:  queries from the block alone; keys and values = [k/v_proj(c); k/v_proj(input_layernorm(block))]
            (Qwen3-style: per-head q_norm and k_norm, RoPE on both); the block attends to itself bidirectionally
    logits = the target's own lm_head(norm(h)) at block positions 1..B-1: B-1 draft tokens from one forward

The target's embedding and lm_head are borrowed, frozen. Trained on blocks that start at anchors sampled among
the loss-carrying positions (many per sequence, so one target forward trains many blocks): each block sees the
context strictly before its anchor and itself; position k of a block learns the target's distribution of the
token k after the anchor, weighted exp(-(k-1)/gamma) (gamma tied to the block size as the reference ties it), or
by D-PACE (each position weighted by how likely the positions before it are to be accepted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ..config import HeadConfig
from ..errors import InputError
from ..kv_cache import KVCache
from ..layers import MLP, RMSNorm, Rotary, attend, rotate_half
from ..masks import after_history
from ..ttt import to_device
from .base import Algorithm, DraftHead, Predictions

# the reference's decay per block size (the DFlash paper: gamma 7 for blocks of 16, 5 for 10, 4 for 8)
GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


@dataclass(frozen=True)
class DFlashOptions:
    # Positions of a block (the anchor and block_size - 1 masks): one forward drafts block_size - 1 tokens.
    block_size: int = 16
    # The token masked positions read (z-lab's `mask_token_id`); chosen from the target's tokenizer when the head
    # is made (models/head_config.py: mask_token_for).
    mask_token_id: int | None = None
    # Training: blocks per sequence, their anchors drawn among the positions whose next token carries loss.
    anchors: int = 64
    # Training: the per-position loss weight, exp(-(k-1)/gamma) ("exp"; gamma None: tied to block_size as the
    # reference ties it) or D-PACE ("dpace": position k weighted by the smoothed chance that positions 1..k-1 are
    # accepted, dpace_alpha the smoothing).
    loss_weight: Literal["exp", "dpace"] = "exp"
    gamma: float | None = None
    dpace_alpha: float = 0.5


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from the context states and the block (Qwen3-style q/k norms)."""

    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor, rope_q, rope_k, mask: torch.Tensor | None,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        """x [B, Q, H] (normed block), context [B, A, H] (new context states); rope_q for the block's positions,
        rope_k for the context's then the block's; mask [B, 1, Q, S] additive over (the cache's columns and) the
        new keys -> [B, Q, H]."""
        b, q_len, _ = x.shape
        kv_in = torch.cat([context, x], 1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_in.shape[1], self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, kv_in.shape[1], self.kv_heads, self.head_dim).transpose(1, 2)
        (cq, sq), (ck, sk) = rope_q, rope_k
        q, k = q * cq + rotate_half(q) * sq, k * ck + rotate_half(k) * sk
        if cache is not None:
            k, v = cache.update(k, v, layer)
        return self.o_proj(attend(q, k, v, mask).transpose(1, 2).flatten(2))


class DFlashLayer(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, context, rope_q, rope_k, mask, cache, layer) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, rope_q, rope_k, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(DraftHead):
    def __init__(self, config: HeadConfig, target=None) -> None:
        super().__init__(config, target)
        c = config
        self.fc = nn.Linear(c.feature_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta)

    @property
    def own_tokens(self) -> tuple[int, ...]:
        return (self.options.mask_token_id,)

    @property
    def draft_positions(self) -> int:
        return self.options.block_size - 1

    def context(self, target_features: torch.Tensor) -> torch.Tensor:
        """Fused target states [..., feature_size] -> the context every layer reads [..., H]."""
        return self.hidden_norm(self.fc(target_features.to(self.fc.weight.dtype)))

    def block(self, anchors: torch.Tensor, length: int) -> torch.Tensor:
        """The block's token ids [B, length]: each row's anchor, then masks."""
        masks = torch.full((anchors.shape[0], length - 1), self.options.mask_token_id, device=anchors.device)
        return torch.cat([anchors[:, None], masks], 1)

    def forward(self, ids: torch.Tensor, context: torch.Tensor, block_pos: torch.Tensor, context_pos: torch.Tensor,
                allowed: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """The block ids [B, Q] at block_pos [B, Q] over the new context states [B, A, H] at context_pos [B, A];
        allowed [B, Q, S]: which keys each block position sees, S = (cache.width +) A + Q. With a cache, the
        context's and the block's keys/values are pending entries (the caller commits the context's). Returns the
        head's states [B, Q, H] (project() gives logits)."""
        dtype = self.fc.weight.dtype
        x = self.embed(ids)
        positions = torch.cat([context_pos, block_pos], 1)
        rope_k = self.rotary(positions, dtype)
        rope_q = tuple(r[:, :, context_pos.shape[1]:] for r in rope_k)
        if cache is None:
            mask = self.window_mask(allowed, block_pos, positions)
            for i, layer in enumerate(self.layers):
                x = layer(x, context, rope_q, rope_k, mask, None, i)
            return x
        with cache.writing(positions):
            mask = self.cache_mask(allowed, block_pos, cache)
            for i, layer in enumerate(self.layers):
                x = layer(x, context, rope_q, rope_k, mask, cache, i)
        return x

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        lm_head = self.shared["lm_head"]
        return lm_head(self.norm(hidden).to(lm_head.weight.dtype))

    @torch.no_grad()
    def propose(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, counts: list[int],
                cache: KVCache, k: int) -> torch.Tensor:
        """One forward: the target states the head has not seen yet join the context (they stay in its cache), and
        the block [root, k masks] after each row's last state proposes k tokens.

        tokens [B, A] (EAGLE-shifted: row b's entry counts[b] - 1 holds its root), features [B, A, F], positions
        [B, A] of those states; rows left-aligned, padded after counts[b]. Returns logits [B, k, V]."""
        b, a = tokens.shape
        dev = tokens.device
        last = torch.tensor([max(n - 1, 0) for n in counts], device=dev)[:, None]  # [B, 1]
        ids = self.block(tokens.gather(1, last)[:, 0], k + 1)
        block_pos = positions.gather(1, last) + 1 + torch.arange(k + 1, device=dev)  # the root's position onwards
        real = torch.arange(a, device=dev)[None, :] < torch.tensor(counts, device=dev)[:, None]  # [B, A]
        new = torch.cat([real[:, None, :].expand(-1, k + 1, -1), torch.ones(b, k + 1, k + 1, dtype=torch.bool,
                                                                             device=dev)], 2)
        allowed = after_history(cache.lengths, new, cache.width + a + k + 1)
        hidden = self(ids, self.context(features), block_pos, positions, allowed, cache)
        cache.commit(counts)  # the context's real entries stay; its padding and the block go
        return self.project(hidden[:, 1:])


class DFlash(Algorithm):
    name = "dflash"
    title = "DFlash, block drafting (z-lab, Chen et al., 2026)"
    Options = DFlashOptions
    head_class = DFlashHead
    drafting = "parallel"
    # the reference uses about 5 layers on GPU targets; on a CPU a layer costs more of a cycle (docs/benchmarks.md)
    default_num_layers = 3

    def check(self, config: HeadConfig) -> None:
        super().check(config)
        o = config.options
        if not config.fused_layer_ids:
            raise InputError("a dflash head needs fused_layer_ids (the target layers its context reads)")
        if o.block_size < 2:
            raise InputError(f"dflash block_size must be >= 2 (the anchor and a mask at least), got {o.block_size}")
        if o.mask_token_id is None or not 0 <= o.mask_token_id < config.vocab_size:
            raise InputError(f"a dflash head needs a mask_token_id in 0..{config.vocab_size - 1}, got "
                             f"{o.mask_token_id}")
        if o.anchors < 1:
            raise InputError(f"dflash anchors must be >= 1, got {o.anchors}")

    def default_layers(self, num_target_layers: int, num_layers: int) -> tuple[int, ...]:
        """The reference spreads as many target layers as the drafter has layers between the second and the
        fourth-last (z-lab's layer outputs 1 .. N-3: our ids 2 .. N-2)."""
        n = num_target_layers
        if num_layers == 1:
            return (n // 2 + 1,)
        span = (n - 3) - 1
        return tuple(sorted({round(1 + i * span / (num_layers - 1)) + 1 for i in range(num_layers)}))

    def default_options(self, target) -> dict[str, Any]:
        from ..head_config import mask_token_for

        return {"mask_token_id": mask_token_for(target)}

    def unroll(self, head: DFlashHead, input_ids: torch.Tensor, valid: torch.Tensor, states: torch.Tensor,
               settings: Any, generators: list[torch.Generator | None] | None = None) -> Predictions:
        """Blocks at anchors a drawn among the positions whose next token carries loss: [token a, masks] at
        positions a.., seeing the context states at positions < a and the whole block; block position k learns the
        target's distribution at a + k - 1 (of token a + k) where token a + k carries loss."""
        b, t = input_ids.shape
        size, dev = head.options.block_size, input_ids.device
        plan = _BlockPlan(valid.cpu(), size, head.options.anchors, generators)
        q = plan.width * size
        anchors = to_device(plan.anchors, dev)  # [B, n] anchor positions (padding: 0, never read)
        ids = head.block(input_ids.gather(1, anchors).flatten(), size).view(b, q)
        offsets = torch.arange(size, device=dev)
        block_pos = (anchors[..., None] + offsets).view(b, q)
        context_pos = torch.arange(t, device=dev).expand(b, t)
        hidden = head(ids, head.context(states), block_pos, context_pos, to_device(plan.allowed(t), dev))
        rows = to_device(plan.rows, dev)  # flat b * q + j of the block positions with loss, depth by depth
        return Predictions(hidden.flatten(0, 1).index_select(0, rows), plan.teacher, plan.sizes,
                           blocks=plan.blocks)

    def depth_weights(self, head: DFlashHead, settings: Any, sizes: list[int]) -> list[float]:
        """The block positions alike (the reference's mean over every row, whose counts differ only past sequence
        ends); the per-row weights carry the decay (row_weights)."""
        return [1 / len(sizes)] * len(sizes)

    def row_weights(self, head: DFlashHead, pred: Predictions, ce: torch.Tensor) -> torch.Tensor:
        """Each loss row's weight [P] (no gradient): exp(-(k-1)/gamma) for block position k, or D-PACE's."""
        o = head.options
        depth = torch.repeat_interleave(torch.arange(len(pred.sizes)), torch.tensor(pred.sizes)).to(ce.device)
        if o.loss_weight == "exp":
            gamma = o.gamma or _gamma(o.block_size)
            return torch.exp(-depth.float() / gamma)
        # D-PACE: per block, the prefix product of the smoothed confidences exp(-CE) of its positions, summed from
        # each position to the block's end (a position counts for every later one it must be accepted for)
        blocks = to_device(pred.blocks, ce.device)
        n, k = int(pred.blocks.max()) + 1 if len(pred.blocks) else 0, len(pred.sizes)
        smooth = torch.ones(n, k, device=ce.device)
        present = torch.zeros(n, k, device=ce.device)
        conf = (1 - o.dpace_alpha) * torch.exp(-ce.detach().float()) + o.dpace_alpha
        smooth[blocks, depth] = conf
        present[blocks, depth] = 1.0
        prefix = torch.cumprod(smooth, 1) * present
        weight = prefix.flip(1).cumsum(1).flip(1)
        return weight[blocks, depth]

    def training_activations(self, config: HeadConfig, seq_len: int, loss_fraction: float, settings: Any,
                             itemsize: int, batch: int) -> tuple[dict[str, float], int]:
        """Per sequence: the context states and each layer's context keys/values over seq_len positions, and for
        the anchors' blocks (anchors x block_size rows) each layer's activations and attention scores."""
        o, h = config.options, config.hidden_size
        taught = max(1, round(loss_fraction * seq_len))
        rows = min(o.anchors, taught) * o.block_size
        kv = config.num_key_value_heads * config.head_dim
        q = config.num_attention_heads * config.head_dim
        per_layer = (seq_len * 2 * kv  # the context's keys and values (and their k_norm input)
                     + rows * (4 * h + 3 * q + 2 * kv + 4 * config.intermediate_size))
        scores = config.num_layers * rows * config.num_attention_heads * (seq_len + rows) * 4
        parts = {"DFlash activations": batch * (seq_len * 2 * h + config.num_layers * per_layer) * itemsize,
                 "DFlash attention scores": batch * scores}
        return parts, rows - min(o.anchors, taught)


def _gamma(block_size: int) -> float:
    """The reference's decay for a block size, interpolated between the sizes it names."""
    sizes = sorted(GAMMA)
    if block_size in GAMMA:
        return GAMMA[block_size]
    if block_size < sizes[0]:
        return GAMMA[sizes[0]] * block_size / sizes[0]
    if block_size > sizes[-1]:
        return GAMMA[sizes[-1]] * block_size / sizes[-1]
    lo = max(s for s in sizes if s < block_size)
    hi = min(s for s in sizes if s > block_size)
    return GAMMA[lo] + (GAMMA[hi] - GAMMA[lo]) * (block_size - lo) / (hi - lo)


class _BlockPlan:
    """Host-side bookkeeping of a DFlash training batch, from valid [B, T] (CPU): each sequence's anchors, which
    block positions carry loss and the teacher row (flat b * T + u) each learns from, depth by depth."""

    def __init__(self, valid: torch.Tensor, size: int, anchors: int,
                 generators: list[torch.Generator | None] | None = None) -> None:
        b, t = valid.shape
        self.size = size
        chosen = []
        for i, row in enumerate(valid):
            # an anchor a needs a context (a >= 1) and its first prediction, token a + 1, to carry loss
            can = (row[2:].nonzero().squeeze(1) + 1).tolist()
            gen = generators[i] if generators is not None else None
            pick = torch.randperm(len(can), generator=gen)[:anchors].sort().values.tolist()
            chosen.append([can[i] for i in pick])
        self.width = max(1, max(map(len, chosen)))
        self.count = [len(c) for c in chosen]
        self.anchors = torch.tensor([c + [0] * (self.width - len(c)) for c in chosen], dtype=torch.long)  # [B, n]
        k = torch.arange(size)
        target = self.anchors[..., None] + k  # [B, n, size] the token each block position predicts
        live = torch.arange(self.width)[None, :, None] < torch.tensor(self.count)[:, None, None]
        inside = target < t
        carries = live & inside & (k >= 1) & valid.gather(1, target.clamp(max=t - 1).flatten(1)).view_as(target)
        q = self.width * size
        flat = torch.arange(b)[:, None, None] * q + torch.arange(self.width)[None, :, None] * size + k  # [B, n, size]
        teacher = torch.arange(b)[:, None, None] * t + target - 1
        block = torch.arange(b)[:, None, None] * self.width + torch.arange(self.width)[None, :, None] + 0 * k
        rows, teach, blocks, self.sizes = [], [], [], []
        for depth in range(1, size):  # block position k = depth + 1 ... as the loss counts depths from 0
            m = carries[..., depth]
            rows.append(flat[..., depth][m])
            teach.append(teacher[..., depth][m])
            blocks.append(block[..., depth][m])
            self.sizes.append(int(m.sum()))
        self.rows, self.teacher, self.blocks = torch.cat(rows), torch.cat(teach), torch.cat(blocks)

    def allowed(self, t: int) -> torch.Tensor:
        """[B, n * size, t + n * size]: a block position sees the context before its anchor and its own block; a
        padding block (past a sequence's anchors) sees itself alone, so its rows stay finite."""
        b, n, size = self.anchors.shape[0], self.width, self.size
        q = n * size
        ctx = torch.arange(t)[None, None, :] < self.anchors.repeat_interleave(size, 1)[..., None]  # [B, Q, T]
        live = (torch.arange(n)[None, :] < torch.tensor(self.count)[:, None]).repeat_interleave(size, 1)
        ctx &= live[..., None]
        own = torch.block_diag(*[torch.ones(size, size, dtype=torch.bool)] * n).expand(b, q, q)
        return torch.cat([ctx, own], 2)


DFlashHead.algorithm = ALGORITHM = DFlash()
