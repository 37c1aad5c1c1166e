"""Derive a head's shape from its target: the decoder layer mirrors the target's by default, the algorithm
(models/drafters) supplies its own defaults (fused layers, options such as a mask token)."""

from __future__ import annotations

from typing import Any, Sequence

from .config import HeadConfig
from .drafters import algorithm
from .target import Target


def head_config_for(
    target: Target, head_type: str = "eagle3", draft_vocab_size: int | None = None,
    fused_layer_ids: Sequence[int] | None = None, num_layers: int | None = None,
    options: dict[str, Any] | None = None, **overrides,
) -> HeadConfig:
    """HeadConfig for `target`: draft_vocab_size defaults to the full vocab (a reduced one only for algorithms with an
    lm_head of their own), fused layers, layer count and options to the algorithm's defaults for this target."""
    algo = algorithm(head_type)
    c = target.config
    heads = c.num_attention_heads
    # the head's MLP width is its own choice; mirror the target's where the config names it
    intermediate = (getattr(c, "intermediate_size", None) or getattr(c, "ffn_hidden_size", None)
                    or 4 * target.hidden_size)
    if isinstance(intermediate, (list, tuple)):  # one width per layer (Gemma 3n): the widest
        intermediate = max(intermediate)
    layers = num_layers or algo.default_num_layers
    ids = tuple(fused_layer_ids) if fused_layer_ids is not None else algo.default_layers(target.num_layers, layers)
    return HeadConfig(
        head_type=head_type,
        hidden_size=target.hidden_size,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or target.hidden_size // heads,
        vocab_size=target.vocab_size,
        draft_vocab_size=(draft_vocab_size or target.vocab_size) if algo.reduced_vocab else target.vocab_size,
        fused_layer_ids=ids,
        num_layers=layers,
        rms_norm_eps=getattr(c, "rms_norm_eps", None) or getattr(c, "layer_norm_eps", None) or 1e-6,
        rope_theta=_rope_theta(c),
        max_position_embeddings=getattr(c, "max_position_embeddings", 4096),
        options={**algo.default_options(target), **(options or {})},
        target=target.identity(),
        **overrides,
    )


def mask_token_for(target: Target) -> int:
    """The token a drafter reads at masked positions (P-EAGLE, DFlash): the tokenizer's mask token; else its pad
    token where that is not also an end, start or unknown token; else the last id of the target's vocabulary (the
    rarest token in most tokenizers, often a reserved slot). Only its embedding matters, and a token that rarely
    appears in text keeps masked positions apart from real ones."""
    tok = target.tokenizer
    if tok is not None:
        if tok.mask_token_id is not None and tok.mask_token_id < target.vocab_size:
            return int(tok.mask_token_id)
        others = {tok.eos_token_id, tok.bos_token_id, tok.unk_token_id, *target.eos_ids()}
        if tok.pad_token_id is not None and tok.pad_token_id not in others and tok.pad_token_id < target.vocab_size:
            return int(tok.pad_token_id)
    return target.vocab_size - 1


def _rope_theta(config) -> float:
    # transformers 5 keeps rope settings in `rope_parameters`; older configs had `rope_theta`.
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
