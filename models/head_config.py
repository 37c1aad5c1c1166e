"""Derive a head's shape from its target: the decoder layer mirrors the target's by default."""

from __future__ import annotations

from typing import Sequence

from .config import HeadConfig, HeadType, default_fused_layer_ids
from .target import Target


def head_config_for(
    target: Target, head_type: HeadType = "eagle3", draft_vocab_size: int | None = None,
    fused_layer_ids: Sequence[int] | None = None, num_layers: int = 1, **overrides,
) -> HeadConfig:
    """HeadConfig for `target`; draft_vocab_size defaults to the full vocab, EAGLE-3 layers to 2, N//2, N-3."""
    c = target.config
    heads = c.num_attention_heads
    # the head's MLP width is its own choice; mirror the target's where the config names it
    intermediate = (getattr(c, "intermediate_size", None) or getattr(c, "ffn_hidden_size", None)
                    or 4 * target.hidden_size)
    if isinstance(intermediate, (list, tuple)):  # one width per layer (Gemma 3n): the widest
        intermediate = max(intermediate)
    if head_type == "eagle3":
        ids = tuple(fused_layer_ids) if fused_layer_ids is not None else default_fused_layer_ids(target.num_layers)
    else:
        ids = ()
    return HeadConfig(
        head_type=head_type,
        hidden_size=target.hidden_size,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or target.hidden_size // heads,
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab_size or target.vocab_size if head_type == "eagle3" else target.vocab_size,
        fused_layer_ids=ids,
        num_layers=num_layers,
        rms_norm_eps=getattr(c, "rms_norm_eps", None) or getattr(c, "layer_norm_eps", None) or 1e-6,
        rope_theta=_rope_theta(c),
        max_position_embeddings=getattr(c, "max_position_embeddings", 4096),
        target=target.identity(),
        **overrides,
    )


def _rope_theta(config) -> float:
    # transformers 5 keeps rope settings in `rope_parameters`; older configs had `rope_theta`.
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
