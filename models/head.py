"""EAGLE draft heads: one class, two wirings.

eagle1  hidden = layers(fc([emb(tok); feature]))          logits = target.lm_head(hidden)
eagle3  x = fc([low; mid; high])  (step 0; later steps feed back the head's own hidden)
        hidden = layers(x, emb(tok))                     logits = lm_head(norm(hidden)) over the
                                                          draft vocab, mapped to target ids by d2t

The token embedding (and for eagle1 the lm_head) belong to the frozen target: the head only
borrows them, so they are not parameters of the head and never enter its state dict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import HeadConfig, check_head_matches
from .errors import InputError
from .kv_cache import KVCache
from .layers import DecoderLayer, RMSNorm, Rotary
from .masks import additive, windowed
from .target import Target
from .ttt import TTTAttention


@dataclass
class HeadOutput:
    logits: torch.Tensor | None  # [B, T, draft_vocab_size]; None when forward(logits=False)
    hidden: torch.Tensor  # [B, T, H], fed back as the next step's feature


class DraftHead(nn.Module):
    def __init__(self, config: HeadConfig, target: Target | None = None) -> None:
        super().__init__()
        c = config
        self.config = c
        eagle3 = c.head_type == "eagle3"
        # Borrowed, frozen target modules: kept in a plain dict so nn.Module does not register them.
        self.shared: dict[str, nn.Module | None] = {"embed_tokens": None, "lm_head": None}
        if target is not None:
            self.bind(target)
        h = c.hidden_size
        if eagle3:
            self.fc = nn.Linear(c.feature_size, h, bias=False)
        else:
            self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList(
            DecoderLayer(c, fuse_embedding=eagle3 and i == 0, input_norm=eagle3 or i > 0) for i in range(c.num_layers)
        )
        self.rotary = Rotary(c.head_dim, c.rope_theta)
        if eagle3:
            self.norm = RMSNorm(h, c.rms_norm_eps)
            self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
            # SGLang/speculators convention: target_id = draft_id + d2t[draft_id]; t2d marks target
            # ids that exist in the draft vocab. Identity maps until a vocab map is installed.
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
            t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
            t2d[: c.draft_vocab_size] = True
            self.register_buffer("t2d", t2d)

    def bind(self, target: Target) -> None:
        """Borrow the target's embedding (and, for eagle1, its lm_head) after checking it fits."""
        check_head_matches(self.config, target)
        self.shared["embed_tokens"] = target.embed_tokens
        self.shared["lm_head"] = target.lm_head

    @classmethod
    def from_pretrained(cls, folder: str, target: Target | None = None, **kw) -> "DraftHead":
        from .layouts import load_head

        return load_head(folder, target, **kw)

    def save_pretrained(self, folder: str) -> None:
        from .layouts import save_head

        save_head(self, folder)

    # ---- vocab maps -------------------------------------------------------------------------
    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """Install the draft vocabulary: draft id i stands for target id draft_to_target[i]."""
        if self.config.head_type != "eagle3":
            raise InputError("only eagle3 heads have a reduced draft vocabulary")
        ids = draft_to_target.to(self.d2t.device, torch.long)
        if ids.shape != self.d2t.shape:
            raise InputError(f"vocab map has {ids.numel()} ids, head draft_vocab_size is {self.d2t.numel()}")
        if ids.unique().numel() != ids.numel() or ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise InputError("vocab map must hold distinct target ids in range")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.config.head_type != "eagle3":
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def can_propose(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Bool, same shape as target_ids: the token is in the draft vocabulary (eagle1: every token is)."""
        if self.config.head_type != "eagle3":
            return torch.ones_like(target_ids, dtype=torch.bool)
        return self.t2d[target_ids.to(self.t2d.device)]

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab_size] target id of each draft id."""
        return self.to_target_ids(torch.arange(self.config.draft_vocab_size, device=self.fc.weight.device))

    # ---- forward ----------------------------------------------------------------------------
    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target features [B, T, feature_size] -> the head's step-0 hidden input [B, T, H]."""
        if self.config.head_type == "eagle3":
            return self.fc(target_features.to(self.fc.weight.dtype))
        return target_features.to(self.fc.weight.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        allowed: torch.Tensor | None = None,
        cache: KVCache | TTTAttention | None = None,
        logits: bool | torch.Tensor = True,
    ) -> HeadOutput:
        """One draft step.

        input_ids [B, T]: the token at each position (the token *after* the position whose feature is in
        `hidden`, as in EAGLE); hidden [B, T, H] from `fuse` or a previous step; position_ids [B, T];
        allowed [B, T, cache.width + T] bool: which cache columns each token may see (masks.after_history),
        or None for causal attention within this block (an empty cache, or training's TTTAttention).
        A KVCache gets this block's keys/values as pending entries (the caller commits or rolls back).
        logits=False skips the vocabulary projection (training projects only the rows that carry loss); positions
        [B, K] project only those of each row (a drafter's catch-up needs the logits at each row's root alone).
        """
        if self.shared["embed_tokens"] is None:
            raise RuntimeError("the head is not bound to a target: call head.bind(target) first")
        dtype = self.fc.weight.dtype
        emb = self.shared["embed_tokens"](input_ids).to(dtype)
        x = hidden.to(dtype)
        if self.config.head_type == "eagle1":
            x = self.fc(torch.cat([emb, x], dim=-1))
        position_ids = position_ids.expand(input_ids.shape)  # the frontier of a level shares one position
        rope = self.rotary(position_ids, dtype)
        if isinstance(cache, KVCache):
            with cache.writing(position_ids):
                mask = None if allowed is None else self._mask(allowed, position_ids, cache)
                for i, layer in enumerate(self.layers):
                    x = layer(x, rope, mask, cache, i, emb=emb if i == 0 else None)
        else:
            mask = None if allowed is None else additive(allowed, dtype)
            for i, layer in enumerate(self.layers):
                x = layer(x, rope, mask, cache, i, emb=emb if i == 0 else None)
        if isinstance(logits, torch.Tensor):
            return HeadOutput(logits=self.project(x.gather(1, logits[..., None].expand(-1, -1, x.shape[-1]))), hidden=x)
        return HeadOutput(logits=self.project(x) if logits else None, hidden=x)

    def _mask(self, allowed: torch.Tensor, position_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        kind = ("sliding", self.config.sliding_window) if self.config.sliding_window else ("full", None)
        key_pos = cache.key_positions(allowed.shape[2])  # the block's own entries are recorded already
        return additive(windowed(allowed, kind, position_ids, key_pos), self.fc.weight.dtype)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head hidden [..., H] -> logits [..., draft_vocab_size] (eagle1: the target's lm_head)."""
        if self.config.head_type == "eagle3":
            return self.lm_head(self.norm(hidden))
        return self.shared["lm_head"](hidden.to(self.shared["lm_head"].weight.dtype))

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """The head's KV cache while drafting: the same kind as the target's, slot for slot."""
        return KVCache(self.config.num_layers, batch, capacity, self.fc.weight.device)
