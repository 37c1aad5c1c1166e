"""Configuration of a draft head and the identity of the target it was trained for.

Plain frozen dataclasses that validate themselves: the config alone rebuilds a head,
and the target identity travels with it so a head is never run against the wrong model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import HeadTargetMismatch, InputError


@dataclass(frozen=True)
class TargetIdentity:
    """What a head needs to know about its target to refuse the wrong one."""

    name_or_path: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int  # 0 when unknown (foreign layouts do not record it)
    # sha256 over the tokenizer's (token, id) pairs; "" when unknown (foreign formats).
    tokenizer_fingerprint: str = ""


@dataclass(frozen=True)
class HeadConfig:
    """Shape of a draft head, its algorithm and the algorithm's own settings. Attention/MLP sizes default to the
    target's decoder layer (head_config.head_config_for)."""

    # The drafter algorithm (models/drafters): eagle1, eagle3, peagle, dflash.
    head_type: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # Target vocabulary (the ids the head's proposals are expressed in).
    vocab_size: int
    # Algorithms with an lm_head of their own may predict over a reduced vocabulary mapped to target ids by d2t;
    # those that predict through the target's lm_head have the full vocab.
    draft_vocab_size: int
    # Target layers whose *inputs* are fused into the head's context (hidden_states[i] in HF terms; id N is the
    # decoder's output after its final norm). Empty for algorithms that read the final hidden state (EAGLE-1).
    fused_layer_ids: tuple[int, ...] = ()
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    # The head's own attention window (tokens), None = the whole context. eyas trains full-attention heads
    # for every target, sliding-window ones included (the head is small: seeing the whole context is cheap and
    # keeps long-range evidence); released heads that carry a window run with it.
    sliding_window: int | None = None
    # The algorithm's own settings: an instance of its Options dataclass (a dict is converted; None: defaults).
    options: Any = None
    target: TargetIdentity | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        from .drafters import algorithm

        algo = algorithm(self.head_type)
        options = self.options
        if options is None or isinstance(options, dict):
            options = algo.options_from_dict(options or {})
        elif not isinstance(options, algo.Options):
            raise InputError(f"a {self.head_type} head takes {algo.Options.__name__} options, got "
                             f"{type(options).__name__}")
        object.__setattr__(self, "options", options)
        if self.num_layers < 1:
            raise InputError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise InputError(f"sliding_window must be >= 1 or null, got {self.sliding_window}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InputError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise InputError(
                f"draft_vocab_size ({self.draft_vocab_size}) must be in 1..vocab_size ({self.vocab_size})"
            )
        algo.check(self)
        if self.target is not None:
            for name in ("hidden_size", "vocab_size"):
                if getattr(self.target, name) != getattr(self, name):
                    raise InputError(f"head {name} {getattr(self, name)} differs from its target's "
                                     f"{getattr(self.target, name)}")
            n = self.target.num_hidden_layers
            bad = [i for i in self.fused_layer_ids if i < 0 or (n and i > n)]
            if bad:
                raise InputError(
                    f"fused_layer_ids {bad} out of range for a {self.target.num_hidden_layers}-layer target"
                )

    @property
    def feature_size(self) -> int:
        """Width of the target feature the head consumes before fusion: [.., feature_size]."""
        return self.hidden_size * max(1, len(self.fused_layer_ids))

    def replace(self, **changes: Any) -> "HeadConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fused_layer_ids"] = list(self.fused_layer_ids)
        d["options"] = dataclasses.asdict(self.options)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HeadConfig":
        """From to_dict's output; a config written before options existed (eyas format 1: EAGLE-3's
        norm_before_residual among the shape fields) reads as the same head."""
        d = dict(d)
        if "norm_before_residual" in d:  # eyas format 1
            d.setdefault("options", {})["norm_before_residual"] = d.pop("norm_before_residual")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InputError(f"unknown head config keys {unknown}; valid keys: {sorted(known)}")
        d["fused_layer_ids"] = tuple(d.get("fused_layer_ids", ()))
        if d.get("target") is not None and not isinstance(d["target"], TargetIdentity):
            d["target"] = TargetIdentity(**d["target"])
        return cls(**d)


def default_fused_layer_ids(num_hidden_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/mid/high features: the inputs of layers 2, N//2 and N-3."""
    n = num_hidden_layers
    ids = (min(2, n - 1), n // 2, max(n - 3, 0))
    return tuple(sorted(set(ids)))


def check_head_matches(config: HeadConfig, target) -> None:
    """Raise HeadTargetMismatch naming the first property where a head (config) and a Target disagree."""
    trained = config.target
    for name, head_value, target_value in [
        ("hidden size", config.hidden_size, target.hidden_size),
        ("vocab size", config.vocab_size, target.vocab_size),
    ]:
        if head_value != target_value:
            raise HeadTargetMismatch(
                f"{name} mismatch: the head was trained for {head_value}, "
                f"target {target.name_or_path!r} has {target_value}"
            )
    if config.fused_layer_ids and max(config.fused_layer_ids) > target.num_layers:
        raise HeadTargetMismatch(
            f"layer mismatch: the head fuses target layers {list(config.fused_layer_ids)}, "
            f"target {target.name_or_path!r} has only {target.num_layers}"
        )
    if trained is not None and trained.tokenizer_fingerprint:
        current = target.identity().tokenizer_fingerprint
        if current and current != trained.tokenizer_fingerprint:
            raise HeadTargetMismatch(
                f"tokenizer mismatch: the head was trained for {trained.name_or_path!r} whose tokenizer vocabulary "
                f"differs from that of target {target.name_or_path!r} "
                f"(fingerprints {trained.tokenizer_fingerprint[:19]}… "
                f"vs {current[:19]}…)"
            )
