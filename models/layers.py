"""The draft head's decoder layer: Llama-style RMSNorm, RoPE, GQA attention and SwiGLU MLP.

Written out (not borrowed from a transformers model class) because the EAGLE-3 first layer
attends over [norm(embedding); norm(hidden)] of width 2H, and because drafting needs explicit
masks over eyas's KV cache (kv_cache.py) and training its packed TTT attention (ttt.py). Every drafter
(models/drafters) builds its decoder from these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import HeadConfig
from .kv_cache import KVCache
from .ttt import TTTAttention


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
    """RoPE evaluated at explicit position ids (tree nodes share depths, not indices).

    The frequencies stay fp32 whatever the head's dtype (they are not a buffer, so `.to(bf16)` leaves them):
    in bf16, theta 5e5 at position 2000 would put the phase off by radians, and a bf16 head would then
    disagree with the fp32 one it was trained as. cos/sin are computed in fp32 and only then cast."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float()

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids [B, T] -> cos, sin [B, 1, T, head_dim]
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


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
        cache: KVCache | TTTAttention | None,
        layer_idx: int,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if isinstance(cache, TTTAttention) and cache.packed:  # training, TTT steps >= 1
            out = cache.attend(layer_idx, q, k, v)
        else:  # mask [B, 1, T, S] additive (0 / -inf); None means plain causal over a cache-free block
            if cache is not None:
                k, v = cache.update(k, v, layer_idx)
            out = attend(q, k, v, mask)
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
    and the residual is x, or hidden_norm(x) with `norm_before_residual`. `input_norm=False`
    (EAGLE-1, first layer) skips the input norm because the fc output it receives is not a residual
    stream, as in the EAGLE-1 reference.
    """

    def __init__(self, config: HeadConfig, fuse_embedding: bool = False, input_norm: bool = True,
                 norm_before_residual: bool = False) -> None:
        super().__init__()
        h = config.hidden_size
        self.fuse_embedding = fuse_embedding
        self.norm_before_residual = fuse_embedding and norm_before_residual
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
        cache: KVCache | TTTAttention | None,
        layer_idx: int,
        emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.fuse_embedding:
            normed = self.hidden_norm(x)
            attn_in = torch.cat([self.input_layernorm(emb), normed], dim=-1)
            if self.norm_before_residual:
                x = normed
        else:
            attn_in = self.input_layernorm(x) if self.input_layernorm is not None else x
        x = x + self.self_attn(attn_in, rope, mask, cache, layer_idx)
        if isinstance(cache, TTTAttention):
            x = cache.outputs(layer_idx, x)  # TTT step 0: the MLP runs only where the output is read
        return x + self.mlp(self.post_attention_layernorm(x))
