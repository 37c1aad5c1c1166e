"""What every drafter algorithm is made of: `Algorithm` (its settings, head, target reads, training unroll,
drafting style and memory model) and `DraftHead`, the nn.Module base of every head.

A head borrows the frozen target's token embedding (and, where it predicts through it, the lm_head): borrowed
modules are kept in a plain dict, so they are not parameters of the head and never enter its state dict.
`DraftHead(config)` builds the head class of `config.head_type`.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

from ..config import HeadConfig, check_head_matches
from ..errors import InputError
from ..kv_cache import KVCache
from ..masks import additive, windowed
from ..ttt import TTTAttention

if TYPE_CHECKING:
    from ..target import Target


@dataclass
class HeadOutput:
    logits: torch.Tensor | None  # [B, T, draft_vocab_size]; None when forward(logits=False)
    hidden: torch.Tensor  # [B, T, H], the head's state (fed back, after `feedback`, as the next step's hidden)


@dataclass
class Predictions:
    """What a head predicted in a training unroll, for the distillation loss (train/losses.py).

    hidden [P, H]: the head's states at the rows that carry loss, depth by depth (depth i = draft position i + 1);
    teacher [P] (host, long): the flat row b * T + t of the batch whose target distribution each row learns;
    sizes: rows per depth (they sum to P). regression: (head states, target states) [R, H] each, for a
    feature-regression term (EAGLE-1), else None. blocks [P] (host, long): the block each row drafts in, where
    the algorithm weighs a row by the others of its block (DFlash's D-PACE), else None. per_depth: what each
    depth's sum is divided by, where it is not its own row count (a sampled depth: the count it is drawn to have,
    so the loss does not depend on which sequences share a micro-batch), else None."""

    hidden: torch.Tensor
    teacher: torch.Tensor
    sizes: list[int]
    regression: tuple[torch.Tensor, torch.Tensor] | None = None
    blocks: torch.Tensor | None = None
    per_depth: list[float] | None = None


class Algorithm:
    """One drafter algorithm. Subclasses set the class attributes and override what differs."""

    name: ClassVar[str]
    title: ClassVar[str]  # the paper, for help texts and reports
    Options: ClassVar[type]  # a frozen dataclass: the algorithm's own head settings, each field described
    head_class: ClassVar[type["DraftHead"]]
    # "tree": the head drafts level by level, each level one forward over the frontier (EAGLE);
    # "parallel": one forward proposes a distribution at every position of a block (P-EAGLE, DFlash)
    drafting: ClassVar[Literal["tree", "parallel"]]
    # an lm_head of its own over a draft vocabulary that may be smaller than the target's (d2t / t2d)
    reduced_vocab: ClassVar[bool] = False
    default_num_layers: ClassVar[int] = 1  # decoder layers of a new head

    def options_from_dict(self, raw: dict[str, Any]) -> Any:
        """The Options a config.json / YAML dict names; an unknown key is named with the nearest valid one."""
        known = [f.name for f in dataclasses.fields(self.Options)]
        for key in raw:
            if key not in known:
                near = difflib.get_close_matches(key, known, n=1)
                hint = (f" (did you mean {near[0]!r}?)" if near
                        else f"; {self.name} options: {', '.join(known) or 'none'}")
                raise InputError(f"{self.name} heads have no option {key!r}{hint}")
        return self.Options(**raw)

    def check(self, config: HeadConfig) -> None:
        """Raise InputError naming what this algorithm cannot run in `config`."""
        if not self.reduced_vocab and config.draft_vocab_size != config.vocab_size:
            raise InputError(f"a {self.name} head predicts through the target's lm_head: draft_vocab_size must equal "
                             f"vocab_size ({config.vocab_size})")

    def default_layers(self, num_target_layers: int, num_layers: int) -> tuple[int, ...]:
        """The target layers a new head of `num_layers` decoder layers fuses by default (HF hidden_states ids)."""
        return ()

    def default_options(self, target: "Target") -> dict[str, Any]:
        """Options a new head for `target` gets unless given (a mask token from its tokenizer, say)."""
        return {}

    def reads(self, config: HeadConfig, num_target_layers: int) -> tuple[int, ...]:
        """Which target states feed the head, as HF hidden_states ids (id N: the decoder's normed output)."""
        return config.fused_layer_ids

    def unroll(self, head: "DraftHead", input_ids: torch.Tensor, valid: torch.Tensor, states: torch.Tensor,
               settings: Any, generators: list[torch.Generator | None] | None = None) -> Predictions:
        """The training forward: input_ids, valid [B, T] (valid: the token carries loss), states [B, T, F] (what
        `reads` names, concatenated), settings: the run's loss settings (train.config.LossConfig); generators: one
        per row (CPU) for the unroll's random choices, so a row draws the same whatever else the batch holds (None:
        the global generator)."""
        raise NotImplementedError

    def depth_weights(self, head: "DraftHead", settings: Any, sizes: list[int]) -> list[float]:
        """The loss weight of each depth (draft position) of `unroll`'s predictions (sizes: rows per depth); the
        loss is the weighted sum of each depth's mean. Constants, not row counts: a micro-batch's loss must not
        depend on which sequences it holds beside each other (several processes then train as one)."""
        return [settings.step_decay ** i for i in range(len(sizes))]

    def row_weights(self, head: "DraftHead", pred: Predictions, ce: torch.Tensor) -> torch.Tensor | None:
        """A weight per prediction row [P] given each row's cross-entropy ce [P] (no gradient flows through it), or
        None: the depth weights alone."""
        return None

    def training_activations(self, config: HeadConfig, seq_len: int, loss_fraction: float, settings: Any,
                             itemsize: int, batch: int) -> tuple[dict[str, float], int]:
        """(bytes a micro-batch's unroll keeps for the backward, by part; the rows per sequence whose logits the loss
        takes) for `batch` sequences of seq_len tokens whose last loss_fraction carry loss, activations of `itemsize`
        bytes (models/memory.py adds weights, optimizer state, logits and the teacher)."""
        raise NotImplementedError


class DraftHead(nn.Module):
    """Base of every head. A subclass per algorithm; `DraftHead(config, target)` builds the one config names."""

    algorithm: ClassVar[Algorithm]

    def __new__(cls, config: HeadConfig, *args, **kwargs):
        if cls is DraftHead:
            from . import algorithm

            cls = algorithm(config.head_type).head_class
        return super().__new__(cls)

    def __init__(self, config: HeadConfig, target: "Target | None" = None) -> None:
        super().__init__()
        self.config = config
        # Borrowed, frozen target modules: kept in a plain dict so nn.Module does not register them.
        self.shared: dict[str, nn.Module | None] = {"embed_tokens": None, "lm_head": None}
        if target is not None:
            self.bind(target)

    @property
    def options(self) -> Any:
        return self.config.options

    def bind(self, target: "Target") -> None:
        """Borrow the target's embedding and lm_head after checking the head fits it."""
        check_head_matches(self.config, target)
        self.shared["embed_tokens"] = target.embed_tokens
        self.shared["lm_head"] = target.lm_head

    @classmethod
    def from_pretrained(cls, folder: str, target: "Target | None" = None, **kw) -> "DraftHead":
        from ..layouts import load_head

        return load_head(folder, target, **kw)

    def save_pretrained(self, folder: str) -> None:
        from ..layouts import save_head

        save_head(self, folder)

    def reads(self, num_target_layers: int) -> tuple[int, ...]:
        """The target states this head reads (HF hidden_states ids)."""
        return self.algorithm.reads(self.config, num_target_layers)

    @property
    def own_tokens(self) -> tuple[int, ...]:
        """Token ids the head reads beyond the text it is given (a mask token)."""
        return ()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shared["embed_tokens"] is None:
            raise RuntimeError("the head is not bound to a target: call head.bind(target) first")
        return self.shared["embed_tokens"](input_ids).to(self.fc.weight.dtype)

    # ---- the draft vocabulary: the target's whole vocabulary unless the algorithm has its own (DraftVocab) -------
    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        raise InputError(f"a {self.config.head_type} head predicts over the target's whole vocabulary: it takes no "
                         "draft vocabulary map")

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def can_propose(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Bool, same shape as target_ids: the token is in the draft vocabulary."""
        return torch.ones_like(target_ids, dtype=torch.bool)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab_size] target id of each draft id."""
        return self.to_target_ids(torch.arange(self.config.draft_vocab_size, device=self.fc.weight.device))

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head states [..., H] -> logits [..., draft_vocab_size]."""
        raise NotImplementedError

    def feedback(self, hidden: torch.Tensor) -> torch.Tensor:
        """The state a drafting step hands the next one, from its output state (tree drafters)."""
        return hidden

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """The head's KV cache while drafting: the same kind as the target's, slot for slot."""
        return KVCache(self.config.num_layers, batch, capacity, self.fc.weight.device)

    # ---- the decoder stack ----------------------------------------------------------------------------------------
    def run_layers(self, x: torch.Tensor, emb: torch.Tensor | None, position_ids: torch.Tensor,
                   allowed: torch.Tensor | None, cache: KVCache | TTTAttention | None) -> torch.Tensor:
        """x [B, T, H] through the decoder layers (the first also reads emb [B, T, H] where it fuses the embedding).
        allowed [B, T, cache.width + T] bool: which cache columns each position may see (masks.after_history), or
        None for causal attention within this block (an empty cache, or training's TTTAttention). A KVCache gets
        this block's keys/values as pending entries (the caller commits or rolls back)."""
        dtype = self.fc.weight.dtype
        rope = self.rotary(position_ids, dtype)
        if isinstance(cache, KVCache):
            with cache.writing(position_ids):
                mask = None if allowed is None else self.cache_mask(allowed, position_ids, cache)
                for i, layer in enumerate(self.layers):
                    x = layer(x, rope, mask, cache, i, emb=emb if i == 0 else None)
            return x
        mask = None if allowed is None else additive(allowed, dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, mask, cache, i, emb=emb if i == 0 else None)
        return x

    def outputs(self, x: torch.Tensor, logits: bool | torch.Tensor) -> HeadOutput:
        """The head's states x [B, T, H] and their logits: at every position (True), none (False: training projects
        only the rows that carry loss) or at positions [B, K] of each row (a drafter needs each row's root alone)."""
        if isinstance(logits, torch.Tensor):
            return HeadOutput(logits=self.project(x.gather(1, logits[..., None].expand(-1, -1, x.shape[-1]))),
                              hidden=x)
        return HeadOutput(logits=self.project(x) if logits else None, hidden=x)

    def cache_mask(self, allowed: torch.Tensor, position_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The additive mask over the cache: `allowed`, narrowed to the head's own window if it has one."""
        key_pos = cache.key_positions(allowed.shape[2])  # the block's own entries are recorded already
        return self.window_mask(allowed, position_ids, key_pos)

    def window_mask(self, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """`allowed` [B, T, S] narrowed to the head's own window if it has one, as an additive mask; query_pos [B, T]
        and key_pos [B, S] the positions of its rows and columns."""
        kind = ("sliding", self.config.sliding_window) if self.config.sliding_window else ("full", None)
        return additive(windowed(allowed, kind, query_pos, key_pos), self.fc.weight.dtype)


class DraftVocab:
    """A head with an lm_head of its own over a draft vocabulary (EAGLE-3's reduced vocabulary): draft id i stands
    for target id i + d2t[i] (the SGLang / speculators convention); t2d marks target ids the draft vocabulary holds.
    Identity maps until a vocab map is installed."""

    def init_vocab(self, config: HeadConfig) -> None:
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """Install the draft vocabulary: draft id i stands for target id draft_to_target[i]."""
        ids = draft_to_target.to(self.d2t.device, torch.long)
        if ids.shape != self.d2t.shape:
            raise InputError(f"vocab map has {ids.numel()} ids, head draft_vocab_size is {self.d2t.numel()}")
        if ids.unique().numel() != ids.numel() or ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise InputError("vocab map must hold distinct target ids in range")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def can_propose(self, target_ids: torch.Tensor) -> torch.Tensor:
        return self.t2d[target_ids.to(self.t2d.device)]


def feature_noise(hidden: torch.Tensor, scale: float) -> torch.Tensor:
    """EAGLE reference augmentation: uniform noise (U-0.5) * scale * 512 / T on the input feature."""
    if scale <= 0:
        return hidden
    return hidden + (torch.rand_like(hidden) - 0.5) * (scale * 512 / hidden.shape[1])


def window_mask(window: int | None, b: int, n: int, device: torch.device) -> torch.Tensor | None:
    """The causal mask [B, n, n] of a head with an attention window; None (plain causal) without one."""
    if window is None:
        return None
    i = torch.arange(n, device=device)
    return ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)).expand(b, n, n)
