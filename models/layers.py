"""The draft head's decoder layer: Llama-style RMSNorm, RoPE, GQA attention and SwiGLU MLP.

Written out (not borrowed from a transformers model class) because the EAGLE-3 first layer
attends over [norm(embedding); norm(hidden)] of width 2H, and because drafting needs
explicit 4D masks and a KV cache that can be trimmed to arbitrary positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import HeadConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """RoPE evaluated at explicit position ids (tree nodes share depths, not indices)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids [B, T] -> cos, sin [B, 1, T, head_dim]
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class HeadCache:
    """Per-layer key/value tensors of the draft head, [B, kv_heads, L, head_dim] each."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        """Drop everything past the first `length` positions (e.g. the last draft tree)."""
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i] = k[:, :, :length]
                self.values[i] = self.values[i][:, :, :length]

    def keep(self, index: torch.Tensor) -> None:
        """Keep positions `index` [B, L'] (per row, in order); everything else is dropped."""
        for i, k in enumerate(self.keys):
            if k is not None:
                idx = index[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
                self.keys[i] = k.gather(2, idx)
                self.values[i] = self.values[i].gather(2, idx)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Append this block's k, v [B, kv_heads, T, D] and attend q [B, heads, T, D] over the whole cache."""
        if mask is None and self.keys[layer] is not None:  # this layer's keys: layer 0 is filled first
            raise ValueError("attention_mask is required when the head cache is not empty")
        k, v = self.update(layer, k, v)
        return attend(q, k, v, mask)

    def outputs(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The rows of layer `layer`'s residual stream x [B, T, H] that go on through its MLP: all of them
        (TTTCache keeps fewer at step 0)."""
        return x


class TTTCache(HeadCache):
    """Training-time test (EAGLE-3): step 0 batched at every sequence index, then steps i >= 1 packed.

    A step-i query at index t sees the step-0 keys at indices <= t of its own batch element and its
    own chain's keys of steps 1..i, all at index t. As a dense mask [T, (i+1)T] = [causal | eye | ...]
    the eye blocks cost O(T^2) each for O(T) useful entries, so here the chain's keys are kept per
    query row, [kv_heads, P, i, D], scored elementwise and merged with the causal step-0 block in
    one softmax. Steps i >= 1 run as one packed sequence [1, P] of rows ordered by batch element, so
    no compute goes to padding when batch elements keep different numbers of rows.

    Step 0 needs every index's keys/values but only some indices' outputs (those the loss or a later
    step reads): `step0_rows` [P0] (flat indices b * T + t, ascending) makes the last layer drop the
    others before its MLP, so step 0 returns hidden [1, P0, H] instead of [B, T, H]. None: all rows.
    """

    def __init__(self, num_layers: int, step0_rows: torch.Tensor | None = None) -> None:
        super().__init__(num_layers)
        self.step0_rows = step0_rows
        self.chain_keys: list[torch.Tensor | None] = [None] * num_layers
        self.chain_values: list[torch.Tensor | None] = [None] * num_layers
        self.query_index: torch.Tensor | None = None  # [P] sequence index t of each packed row; None at step 0
        self.batch_sizes: list[int] = []  # packed rows per batch element, in order

    def next_step(self, query_index: torch.Tensor, batch_sizes: list[int], keep: torch.Tensor) -> None:
        """The next step runs at packed rows with index query_index [P], batch_sizes[b] of them in batch
        element b; keep [P_prev] bool: which rows of the previous step continue (in order)."""
        self.query_index, self.batch_sizes = query_index, batch_sizes
        for i, k in enumerate(self.chain_keys):
            if k is not None:
                self.chain_keys[i], self.chain_values[i] = k[:, keep], self.chain_values[i][:, keep]

    def outputs(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if self.query_index is not None or self.step0_rows is None or layer < len(self.keys) - 1:
            return x  # earlier layers: every index's output feeds the next layer's keys/values
        return x.flatten(0, 1).index_select(0, self.step0_rows)[None]  # [1, P0, H]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        if self.query_index is None:  # step 0: plain causal attention over every index
            return super().attend(layer, q, k, v, mask)
        if mask is not None:
            raise ValueError("TTTCache builds its own mask; pass attention_mask=None")
        # q [1, heads, P, D] -> [kv, rep, P, D]: GQA by broadcasting instead of repeating keys
        _, heads, p, d = q.shape
        kv = k.shape[1]
        q = q.reshape(kv, heads // kv, p, d) * d ** -0.5
        new_k, new_v = k[0, :, :, None], v[0, :, :, None]  # [kv, P, 1, D]
        old_k, old_v = self.chain_keys[layer], self.chain_values[layer]
        chain_k = new_k if old_k is None else torch.cat([old_k, new_k], dim=2)  # [kv, P, i, D]
        chain_v = new_v if old_v is None else torch.cat([old_v, new_v], dim=2)
        self.chain_keys[layer], self.chain_values[layer] = chain_k, chain_v
        keys, values = self.keys[layer], self.values[layer]  # step 0: [B, kv, T, D]
        t = keys.shape[2]
        segments = q.split(self.batch_sizes, dim=2)  # per batch element [kv, rep, P_b, D]
        scores = torch.cat([qb @ keys[i, :, None].transpose(-1, -2) for i, qb in enumerate(segments)], dim=2)
        causal = torch.arange(t, device=q.device) <= self.query_index[:, None]  # [P, T]
        scores = scores.masked_fill(~causal, float("-inf"))  # [kv, rep, P, T]
        chain = torch.einsum("krpd,kpid->krpi", q, chain_k)  # [kv, rep, P, i]
        probs = torch.softmax(torch.cat([scores, chain], dim=-1), dim=-1)
        step0 = torch.cat([pb @ values[i, :, None]
                           for i, pb in enumerate(probs[..., :t].split(self.batch_sizes, dim=2))], dim=2)
        out = step0 + torch.einsum("krpi,kpid->krpd", probs[..., t:], chain_v)  # [kv, rep, P, D]
        return out.reshape(1, heads, p, d)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, heads, T, D], k, v [B, kv_heads, S, D], mask [B, 1, T, S] additive (0 / -inf) or None
    (causal, S == T) -> [B, heads, T, D]."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and q.shape[2] > 1)


class Attention(nn.Module):
    def __init__(self, config: HeadConfig, in_size: int) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(in_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(in_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(in_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: HeadCache | None,
        layer_idx: int,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # mask [B, 1, T, S] additive (0 / -inf); None means plain causal over a cache-free block.
        out = attend(q, k, v, mask) if cache is None else cache.attend(layer_idx, q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).flatten(2))  # [B, T, H]; flatten, not view(b, t, -1): T may be 0


class MLP(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer.

    `fuse_embedding` (EAGLE-3, first layer): attention reads [input_layernorm(emb); hidden_norm(x)]
    and the residual is x. `input_norm=False` (EAGLE-1, first layer) skips the input norm because
    the fc output it receives is not a residual stream, as in the EAGLE-1 reference.
    """

    def __init__(self, config: HeadConfig, fuse_embedding: bool = False, input_norm: bool = True) -> None:
        super().__init__()
        h = config.hidden_size
        self.fuse_embedding = fuse_embedding
        self.self_attn = Attention(config, 2 * h if fuse_embedding else h)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps) if (input_norm or fuse_embedding) else None
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps) if fuse_embedding else None
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: HeadCache | None,
        layer_idx: int,
        emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.fuse_embedding:
            attn_in = torch.cat([self.input_layernorm(emb), self.hidden_norm(x)], dim=-1)
        else:
            attn_in = self.input_layernorm(x) if self.input_layernorm is not None else x
        x = x + self.self_attn(attn_in, rope, mask, cache, layer_idx)
        if cache is not None:
            x = cache.outputs(layer_idx, x)  # TTT step 0: the MLP runs only where the output is read
        return x + self.mlp(self.post_attention_layernorm(x))
