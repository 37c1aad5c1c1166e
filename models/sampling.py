"""The target's next-token distribution and its choice: one sampler for generation, verification and regeneration.

`Sampling` holds what shapes the distribution: the repetition penalty, then temperature, top-k, top-p
(nucleus) and min-p, applied in that order as transformers' `generate` does. Unset fields follow the
target's own `generation_config` (`Sampling.for_target`), as `model.generate` does when called without
arguments: a model that ships with do_sample=False decodes greedily, one that ships temperature 0.6 /
top-p 0.95 samples with those.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from .errors import InputError

logger = logging.getLogger(__name__)

# generation_config fields that change what `generate` samples and that eyas does not apply (it warns instead)
_NOT_APPLIED = ("no_repeat_ngram_size", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h",
                "encoder_repetition_penalty", "bad_words_ids", "sequence_bias", "suppress_tokens",
                "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                "exponential_decay_length_penalty", "min_new_tokens", "min_length", "guidance_scale")


def _generate_defaults() -> dict:
    """What `generate` uses for settings neither the call nor the model's generation_config sets (top_k 50, ...)."""
    from transformers import GenerationConfig

    return GenerationConfig._get_default_generation_params()


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off: drop tokens below min_p x the top token's probability
    # 1 = off: logits of tokens already in the sequence are divided by it (negative logits multiplied)
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise InputError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InputError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def for_target(cls, generation_config, temperature: float | None = None, top_p: float | None = None,
                   top_k: int | None = None, min_p: float | None = None,
                   repetition_penalty: float | None = None) -> "Sampling":
        """The settings `model.generate` would use: each argument given wins, the rest come from the model's
        generation_config, and what that leaves unset from transformers' own defaults (top_k 50 when sampling).
        A temperature > 0 samples, 0 decodes greedily; without one the config's do_sample decides (no config:
        greedy), so a model that ships do_sample=True, temperature 0.6 samples with those, as `generate()` does."""
        gc = generation_config
        defaults = _generate_defaults()

        def pick(value, name):
            for found in (value, getattr(gc, name, None) if gc is not None else None, defaults.get(name)):
                if found is not None:
                    return found
            return getattr(cls, name, None)  # the dataclass default

        if temperature is None:
            temperature = pick(None, "temperature") if pick(None, "do_sample") else 0.0
            given = {k: v for k, v in (("top_p", top_p), ("top_k", top_k), ("min_p", min_p)) if v is not None}
            if not temperature and given:
                logger.warning("decoding greedily (the target's generation_config has do_sample off): %s apply only "
                               "when sampling; give a temperature > 0 to sample", ", ".join(given))
        sampling = float(temperature) > 0
        s = cls(temperature=float(temperature),
                top_p=float(pick(top_p, "top_p")) if sampling else cls.top_p,
                top_k=int(pick(top_k, "top_k")) if sampling else cls.top_k,
                min_p=float(pick(min_p, "min_p")) if sampling else cls.min_p,
                repetition_penalty=float(pick(repetition_penalty, "repetition_penalty")))
        ignored = [k for k in _NOT_APPLIED if gc is not None and getattr(gc, k, None) not in (None, 0, 0.0, 1.0, [])]
        if ignored:
            logger.warning("the target's generation_config sets %s, which `generate` applies and eyas does not",
                           ", ".join(ignored))
        return s

    def replace(self, **changes) -> "Sampling":
        return dataclasses.replace(self, **changes)


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty: logits [..., V] of the tokens marked in seen [..., V] (bool) are divided by
    `penalty` where positive and multiplied where negative."""
    if penalty == 1.0:
        return logits
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def distribution(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] (already penalized) -> p [..., V]: temperature, then top-k, top-p and min-p, renormalised."""
    x = logits.float() / s.temperature
    if s.top_k > 0:
        kth = x.topk(min(s.top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the tokens ranked above it already cover top_p (the top one always stays)
        drop = probs.cumsum(-1) - probs >= s.top_p
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    p = x.softmax(-1)
    if s.min_p > 0:
        p = p.masked_fill(p < s.min_p * p.amax(-1, keepdim=True), 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def choose(logits: torch.Tensor, s: Sampling,
           generator: torch.Generator | list[torch.Generator | None] | None = None) -> torch.Tensor:
    """The target's choice at each position: argmax (greedy) or a draw from p. logits [..., V] -> [...].

    generator: one for all rows, or one per row of a [B, V] input (each row reproducible on its own);
    generators must live on the logits' device."""
    if s.greedy:
        # max's indices are argmax's (the first of equal maxima; a NaN's where a row holds one), 3-5x faster on CPU
        # over a vocabulary (49152 bf16 logits: 36 vs 156 us a row), which a verify pays at every node
        return logits.max(-1).indices
    p = distribution(logits, s)
    flat = p.reshape(-1, p.shape[-1])
    if isinstance(generator, list):
        picks = torch.cat([torch.multinomial(row[None], 1, generator=g)[0] for row, g in zip(flat, generator)])
    else:
        picks = torch.multinomial(flat, 1, generator=generator)[:, 0]
    return picks.view(p.shape[:-1])
