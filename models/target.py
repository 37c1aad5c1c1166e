"""The frozen target: any unmodified transformers causal LM, seen through what a draft head needs.

- features: the inputs of chosen decoder layers (EAGLE-3) and the final hidden state (EAGLE-1), in HF
  `hidden_states` numbering: id i < N is the input of layer i, id N the decoder's output. Captured with
  forward pre-hooks, so no other layer's activations are kept.
- logits: computed by the model's own CausalLM forward from the decoder's output (`logits`), so whatever
  the model does after its decoder (soft-capping, logit scales, hidden-state scaling) is done as the model
  does it, for every model, and only for the rows asked for.
- one forward over new tokens into the KV cache (kv_cache.py) with a boolean mask of what each token may
  see; eyas narrows it per layer to the model's own attention kinds (full, sliding window, chunked).
- `verify_mode`: whether the model verifies a draft tree in one forward exactly, checked once against
  the model's own forward; models that take positions from their mask (ALiBi) verify chains instead.
- on CPU, eyas's kernels for the few-row forwards a tree verify makes and for batches of rows of
  different lengths (`cpu_kernels.py`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import get_layer_types_and_kwargs

from . import row_gemv
from .config import TargetIdentity
from .cpu_kernels import CpuLinear, cpu_attention, cpu_linears, whole
from .errors import InputError, Unsupported
from .kv_cache import KVCache
from .masks import Kind, additive, after_history, causal, windowed
from .step_pass import step_pass
from .weight_arena import arrange_weights

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
# transformers' layer types -> the attention kind eyas masks them with (masks.windowed)
_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}
# transformers' cache layer types that hold a state carried from token to token (Mamba, RWKV-like, convolutions)
_STATEFUL = {"linear_attention", "conv", "mamba", "recurrent", "hybrid", "hybrid_sliding"}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 over the sorted (token, id) pairs: equal iff the vocabularies agree exactly."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return "sha256:" + hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [B, T, V] or [B, K, V] at the rows asked for
    hidden: torch.Tensor  # [B, T, H] the decoder's output (EAGLE-1 feature)
    features: torch.Tensor | None  # [B, T, len(layer_ids) * H] concatenated layer inputs (EAGLE-3)


def _decoder(model: PreTrainedModel) -> nn.Module:
    """The CausalLM's decoder: the model without its head, found through get_decoder() down to a module without an
    lm_head (a multimodal model may hold a whole CausalLM as its language model: Llama 4). Where get_decoder()
    returns a CausalLM itself (its base_model_prefix names no attribute: Llama4ForCausalLM), the one child model."""
    decoder = model
    for _ in range(8):
        inner = decoder.get_decoder() if hasattr(decoder, "get_decoder") else decoder
        if inner is decoder:
            if decoder.get_output_embeddings() is None:
                return decoder
            children = [m for m in decoder.children() if isinstance(m, PreTrainedModel)]
            if len(children) != 1:
                break
            inner = children[0]
        decoder = inner
    raise Unsupported(f"could not find the decoder of {type(model).__name__}")


def _decoder_layers(decoder: nn.Module, n: int) -> nn.ModuleList:
    for module in decoder.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise Unsupported(f"could not find the {n} decoder layers of {type(decoder).__name__}")


class _GivenOutput:
    """The decoder output a CausalLM reads: the given hidden states, nothing else (router logits, caches: None)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getitem__(self, i: int) -> torch.Tensor | None:
        return self.last_hidden_state if i == 0 else None

    def __getattr__(self, name: str) -> None:  # only for attributes not set above
        return None


class _Given(nn.Module):
    """Stands in for the decoder while the CausalLM turns given hidden states into logits."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs) -> _GivenOutput:
        return _GivenOutput(self.hidden)


class Target(nn.Module):
    """Frozen wrapper; never trained, never holds gradients."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, name_or_path: str,
                 cpu_kernels: bool = True, compile: bool = False, fixed_shapes: bool | None = None) -> None:
        """cpu_kernels: on CPU, run eyas's kernels for few-row forwards (`models/cpu_kernels.py`: the linear
        layers through copies of their weights in fp32, GQA attention without repeated keys; faster
        multi-token verifies for one extra copy of the weights in memory) and the weights moved into one buffer of
        huge pages in the order a step reads them (`models/weight_arena.py`: the same Parameters, values and
        shapes); False runs the modules as they are, where they are.
        compile: decode steps (forwards into a cache that already holds tokens: plain steps, tree verifies,
        regeneration's steps) run through `torch.compile` of the decoder with frozen weights (`compile_options`):
        the small ops between the weight reads fuse, the products that share an input are fused, and each product
        runs the fastest of inductor's GEMM templates and aten's for its shape, or on CPU a one-row product (bf16
        or fp32) eyas's own kernel (`models/row_gemv.py`, on x86 CPUs with AVX2 or better). A kind of step
        compiles at its first call and once more when a size first changes (it is dynamic from then on: context
        length, tree size, rows), about 35-60 s each for SmolLM2-135M on 2 CPU cores; a later process takes the
        compiled graphs from inductor's cache on disk (~15 s each: the trace and the rewrites). Prefills and the
        verify-mode check stay eager.
        The graphs assume the model's modules and the libraries' globals stay as they were traced (eyas swaps parts
        only inside its eager calls; the weights are frozen into the graphs): a step checks its inputs, the
        interpreter's state and one weight's identity, not the modules or the globals (`_frozen_module_guards`).
        fixed_shapes (default: compiled on a GPU): decode steps of fixed shapes, compiled as one graph per (rows,
        size bucket, cache capacity) that never follows the context: a step attends over its cache's whole capacity
        (a power of two) under an explicit mask, writes the cache through column indices held in a tensor, and pads
        its tokens to a power of two. On CUDA each graph is captured once as a CUDA graph and replayed: a small
        batch's step is bound by kernel launches there, not by its weights. Off on CPU, where attending over the
        unused columns costs more than dynamic shapes do (eager, the same steps check the mechanism on any model);
        models whose attention takes no explicit mask exactly (verify_mode "chain") keep dynamic shapes."""
        super().__init__()
        model.eval().requires_grad_(False)
        self.model = model
        if cpu_kernels and self.device.type == "cpu":  # each step reads them in this order (weight_arena.py)
            arrange_weights(model, last=getattr(self.lm_head, "weight", None))
        self.tokenizer = tokenizer
        self.name_or_path = name_or_path
        text = model.config.get_text_config()
        self.hidden_size: int = text.hidden_size
        self.vocab_size: int = text.vocab_size
        self.num_layers: int = text.num_hidden_layers
        self.decoder = _decoder(model)
        self._layers = _decoder_layers(self.decoder, self.num_layers)
        self._fingerprint: str | None = None
        self._kinds: dict[str, Kind] | None = None
        self._verify_mode: str | None = None
        self._logits_slot: tuple[nn.Module, str] | None = None  # found by the first `logits` call
        self._head_only = False  # decided at the first `logits` call
        self._checking = False
        self.cpu_kernels = cpu_kernels
        self.logit_projection = CpuLinear(self.lm_head, row_copy=True, enabled=cpu_kernels)  # every logit eyas computes
        self._linears = [CpuLinear(m, enabled=cpu_kernels) for m in self._layers.modules() if type(m) is nn.Linear]
        self._linears.append(self.logit_projection)
        self._compiled = None
        self.fixed_shapes = compile and self.device.type == "cuda" if fixed_shapes is None else fixed_shapes
        self._captured: dict[int, torch.Tensor] = {}  # the inputs of the layers asked for, when compiled (see forward)
        if compile:
            # A compiled graph does not see hooks added after it was traced (dynamo does not guard the modules'
            # hooks), so the per-call hooks that capture the fused layers' states would be silently left out of a
            # graph traced without them: compiled, hooks that stay capture the inputs of the layers a forward's cache
            # asks for (`_capture`), a graph per set of layers.
            self._captured = _layer_inputs(self._layers)
            # Dynamo's recompile limit counts the graphs of every compiled Target in the process (each kind of step,
            # static then dynamic, per model); past its default of 8 a new kind would silently run eager. The step's
            # forward is compiled, not the module: a call then skips nn.Module's call path (its hook checks), ~0.7 %
            # of a bf16 SmolLM2-135M step on the caches its weight reads leave.
            self._compiled = torch.compile(
                _Step(self.decoder, self.lm_head).forward, recompile_limit=RECOMPILE_LIMIT,
                dynamic=False if self.fixed_shapes else None,
                options={"guard_filter_fn": _frozen_module_guards,
                         **compile_options(self.device, cuda_graphs=self.fixed_shapes)})

    # ---- identity and borrowed modules ----------------------------------------------------------
    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def config(self):
        return self.model.config.get_text_config()

    def identity(self) -> TargetIdentity:
        if self._fingerprint is None:
            self._fingerprint = tokenizer_fingerprint(self.tokenizer) if self.tokenizer is not None else ""
        return TargetIdentity(self.name_or_path, self.hidden_size, self.vocab_size, self.num_layers, self._fingerprint)

    def eos_ids(self) -> list[int]:
        """The ids that end generation: the generation config's eos ids (where `generate` stops) and the tokenizer's
        eos token (a chat template's end of turn, where a config names only another id)."""
        ids = getattr(self.model.generation_config, "eos_token_id", None)
        ids = set([ids] if isinstance(ids, int) else ids or [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    @property
    def max_length(self) -> int | None:
        """The most tokens a sequence may hold (the model's position limit), None where the config names none."""
        for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
            if isinstance(value := getattr(self.config, name, None), int):
                return value
        return None

    def check_length(self, tokens: int) -> None:
        """Raise if eyas cannot decode a sequence of `tokens` tokens (prompt + new) exactly for this target."""
        limit = self.max_length
        if limit is not None and tokens > limit:
            raise InputError(f"prompt + max_new_tokens = {tokens} tokens exceeds the target's max_position_embeddings "
                             f"({limit}); shorten the prompt or lower max_new_tokens")
        for rope_type, switch in self._length_dependent_rope():
            if tokens > switch:
                raise Unsupported(
                    f"target {self.name_or_path!r} uses rope_type {rope_type!r}, whose frequencies change with the "
                    f"length of a forward once a sequence passes {switch} tokens: keys cached before then no longer "
                    f"match the model's own forward (a batch's longest row would change the others'), so prompt + "
                    f"max_new_tokens = {tokens} cannot be decoded exactly; keep it <= {switch}")

    def _length_dependent_rope(self) -> list[tuple[str, int]]:
        """(rope type, length beyond which its frequencies depend on the forward's length) of every rope setting
        transformers recomputes per forward (dynamic_rope_update: "dynamic" types, "longrope")."""
        c = self.config
        params = getattr(c, "rope_parameters", None) or {}
        sets = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
        found = []
        for p in sets:
            rope_type = p.get("rope_type", "default")
            if "dynamic" in rope_type or rope_type == "longrope":
                switch = (p.get("original_max_position_embeddings")
                          or getattr(c, "original_max_position_embeddings", None) or self.max_length)
                if switch is not None:
                    found.append((rope_type, int(switch)))
        return found

    def attention_kinds(self) -> dict[str, Kind]:
        """transformers' layer type -> its attention kind, for every type of attention layer the decoder uses
        (the keys the model reads its masks under)."""
        if self._kinds is not None:
            return self._kinds
        config = self.model.config.get_text_config(decoder=True)
        types, kwargs = get_layer_types_and_kwargs(config)
        own = getattr(config, "layer_types", None) or types
        kinds: dict[str, Kind] = {}
        for i, (layer_type, kw) in enumerate(zip(types, kwargs)):
            if layer_type == "dummy":  # keeps no cache of its own (reads another layer's, or attends to nothing)
                layer_type = own[i]
                if layer_type not in _KINDS:
                    continue
                kw = {"sliding_window": getattr(config, "sliding_window", None) if layer_type == "sliding_attention"
                      else getattr(config, "attention_chunk_size", None) if layer_type == "chunked_attention" else None}
            if layer_type not in _KINDS:
                what = ("which carry a recurrent or convolutional state from token to token" if layer_type in _STATEFUL
                        else "a kind of attention eyas does not mask")
                raise Unsupported(
                    f"target {self.name_or_path!r} has {layer_type!r} layers, {what}: eyas verifies drafts over full, "
                    "sliding-window and chunked attention layers only (their keys and values are kept per token, so "
                    "a rejected draft is dropped)")
            kind = (_KINDS[layer_type], kw.get("sliding_window"))
            if kinds.setdefault(layer_type, kind) != kind:
                raise Unsupported(f"target {self.name_or_path!r} has {layer_type!r} layers with different windows "
                                  f"({kinds[layer_type][1]} and {kind[1]})")
        self._kinds = kinds
        return kinds

    @property
    def compiled(self) -> bool:
        """Whether decode steps run through torch.compile (`compile=True`)."""
        return self._compiled is not None

    # ---- forward -----------------------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache for `batch` rows of up to `capacity` tokens each (with fixed-shape steps, a power of two:
        caches of one bucket share their steps' graphs)."""
        if self.fixed_shapes:
            capacity = _bucket(max(capacity, 64))
        return KVCache(self.num_layers, batch, capacity, self.device)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        allowed: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        layer_ids: Sequence[int] = (),
        logits: bool | torch.Tensor = True,
    ) -> TargetOutput:
        """Run the target over new tokens.

        input_ids [B, T]; position_ids [B, T] (default 0..T-1 after what a uniform cache holds).
        cache: the new tokens are written after its pending entries (and stay pending until commit/rollback).
        allowed [B, T, cache.width + T] bool: which columns each new token may see (masks.after_history);
        None: the model's own causal masks, which needs every cache row as long (or no cache).
        padding_mask [B, T] (without a cache): 1 for real tokens, 0 for padding.
        logits: True for every position, False for none, or positions [B, K] of each row.
        """
        b, t = input_ids.shape
        start = None  # where tokens without explicit positions begin
        if position_ids is None:
            start = 0 if cache is None else cache.uniform
            if start is None:
                raise ValueError("rows of different lengths need explicit position_ids")
            start += cache.pending if cache is not None else 0
        mask, need = padding_mask, None
        if allowed is not None:
            if cache is None:
                raise ValueError("an explicit mask needs the cache it indexes")
            width = cache.width + t
            if allowed.shape != (b, t, width):
                raise ValueError(f"mask must be [B, T, width] = {(b, t, width)}, got {tuple(allowed.shape)}")
            need = [n + cache.pending + t for n in cache.host_lengths]
            if not self._checking and self.verify_mode() == "chain":
                raise Unsupported(
                    f"target {self.name_or_path!r} does not attend exactly through eyas's explicit masks (it takes "
                    "positions or windows from masks of its own: ALiBi, windows by cache column), which rows of "
                    "different lengths, draft trees and packed prompts need; it runs one row at a time with its own "
                    "masks (speculative generation does so by itself; regeneration: a serving engine, --server)")
        elif cache is not None and cache.uniform is None:
            raise ValueError("cache rows have different lengths: give the mask of what each token sees (allowed)")
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        for i in layer_ids:
            if not 0 <= i <= self.num_layers:
                raise ValueError(f"layer id {i} out of range 0..{self.num_layers}")
            if i < self.num_layers and self._compiled is None:
                hooks.append(self._layers[i].register_forward_pre_hook(_capture(captured, i), with_kwargs=True))
        if cache is not None and cache.owner is None:
            cache.owner = self.model
            if self._compiled is not None and not self.fixed_shapes:
                cache.make_capacity_symbolic()  # one graph for caches of every capacity
        # compiled, fixed shapes: decode steps only (into a cache of this model's that holds tokens); a prefill's
        # shape is new every time and runs once
        step = not self._checking and cache is not None and cache.layers[0].is_initialized
        compiled = step and self._compiled is not None and cache.owner is self.model
        fixed = step and self.fixed_shapes and self.verify_mode() == "tree"
        # positions that follow on from the cache: a compiled step's graph makes them (KVCache.next_positions)
        follow_on = start is not None and compiled and not fixed and allowed is None
        if start is not None and not follow_on:
            position_ids = torch.arange(start, start + t, device=input_ids.device).expand(b, -1)
        if position_ids is not None:
            position_ids = position_ids.expand(b, t)
        if fixed:
            input_ids, position_ids, allowed = self._fixed_inputs(input_ids, position_ids, cache, allowed)
            if compiled and self.device.type == "cuda":
                # each step is an iteration of its own: no output of the previous replay is read after this one
                torch.compiler.cudagraph_mark_step_begin()
        asked = [i for i in layer_ids if i < self.num_layers]
        # a compiled step computes the logits in its graph where they are the lm_head's output alone
        project = None
        if compiled and logits is not False and self._head_in_graph():
            project = logits if isinstance(logits, torch.Tensor) else True
        writing = contextlib.nullcontext() if cache is None else cache.writing(
            t if follow_on else position_ids, fixed=fixed, keep=t, capture=asked)
        # a compiled step's graph holds eyas's kernels already: it only marks itself in progress
        outer, inner = (_IN_STEP, contextlib.nullcontext()) if compiled else (
            cpu_linears(self._linears, b * t), cpu_attention(self.cpu_kernels and self.device.type == "cpu", need))
        try:
            with writing, outer, inner:
                if allowed is not None:
                    mask = self._layer_masks(allowed, position_ids, cache.key_positions(allowed.shape[2]))
                inputs = dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, cache=cache,
                              use_cache=cache is not None)
                if compiled:
                    last, projected = self._compiled(project, **inputs)
                else:
                    last = self.decoder(**inputs).last_hidden_state
        finally:
            for h in hooks:
                h.remove()
            captured.update({i: self._captured[i] for i in layer_ids if i in self._captured})
            self._captured.clear()
        captured[self.num_layers] = last
        if fixed:  # the real tokens' states, out of memory the next replay of a CUDA graph overwrites
            captured = {i: x[:, :t].clone() for i, x in captured.items()}
        hidden = captured[self.num_layers]
        if any(captured[i].shape != hidden.shape for i in layer_ids):
            shape = next(tuple(captured[i].shape) for i in layer_ids if captured[i].shape != hidden.shape)
            raise Unsupported(f"target {self.name_or_path!r} passes its hidden state between decoder layers as "
                              f"{shape} (several streams, as Gemma 3n's AltUp), not [B, T, H]: EAGLE-3 features are "
                              "one stream per layer; use an eagle1 head, which reads the decoder's output")
        features = torch.cat([captured[i] for i in layer_ids], dim=-1) if layer_ids else None
        logit_out = None
        if project is not None:
            logit_out = projected
            if fixed:  # as the states above; every position's: the real tokens' only
                logit_out = (logit_out[:, :t] if project is True else logit_out).clone()
        elif isinstance(logits, torch.Tensor):
            logit_out = self.logits(_at(hidden, logits))
        elif logits:
            logit_out = self.logits(hidden)
        return TargetOutput(logits=logit_out, hidden=hidden, features=features)

    def _head_in_graph(self) -> bool:
        """Whether a compiled step computes its logits in its graph: where they are the lm_head's output alone
        (`logits` decides at its first call, made here with a stand-in state where none came yet). The step then
        needs no call after its graph: ~0.25 ms of Python and dispatch around a bf16 SmolLM2-135M step's lm_head."""
        if self._logits_slot is None:
            self.logits(torch.zeros(1, 1, self.hidden_size, dtype=self.dtype, device=self.device))
        return self._head_only

    def _fixed_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                      allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fixed-shape step's inputs: the T tokens padded to a power of two T' with copies of the last one (at its
        position, seeing what the first token sees: finite states, beyond the columns in use, never seen), and the
        mask over every column of the cache (None: the causal one of a uniform cache).
        -> input_ids [B, T'], position_ids [B, T'], allowed [B, T', capacity]"""
        b, t = input_ids.shape
        size, width, dev = _bucket(t), cache.width + t, input_ids.device
        cache.reserve(cache.width + size)
        if allowed is None:
            allowed = after_history(cache.lengths + cache.pending, causal(t, dev).expand(b, t, t), width)
        full = torch.zeros(b, size, cache.capacity, dtype=torch.bool, device=dev)
        full[:, :t, :width] = allowed
        full[:, t:, :width] = allowed[:, :1]
        pad = size - t
        return (torch.cat([input_ids, input_ids[:, -1:].expand(b, pad)], 1),
                torch.cat([position_ids, position_ids[:, -1:].expand(b, pad)], 1), full)

    def _layer_masks(self, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor):
        """The additive mask of each of the decoder's layer types (one tensor when all layers are alike)."""
        masks = {name: additive(windowed(allowed, kind, query_pos, key_pos), self.dtype)
                 for name, kind in self.attention_kinds().items()}
        return next(iter(masks.values())) if len(masks) == 1 else masks

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Decoder outputs [..., H] -> the model's logits [..., V], computed by the model's own CausalLM forward
        (the module it calls for its hidden states stood in for by the given states), so any post-processing of
        the logits is the model's.

        Which module stands in is found at the first call: on the way from the model to its decoder, the deepest
        whose stand-in the model's forward runs with. The decoder itself where the CausalLM reaches into its
        model for it (OPT); a module around it where that module does more first (a multimodal model embeds and
        merges images before it calls the decoder: Gemma 3, Mistral 3). verify_mode() then checks the logits
        against the model's own forward. Where the model's forward proves to add nothing to its lm_head's output
        (`_head_is_the_logits`), later calls run the lm_head alone: the CausalLM's Python costs ~0.7 ms a call on
        a 2-core CPU, 4 % of a bf16 SmolLM2-135M step."""
        if self._logits_slot is None:
            self._logits_slot = self._find_logits_slot(hidden)
            self._head_only = self._head_is_the_logits(hidden)
        if self._head_only:
            return self._head(hidden)
        return self._logits_through(*self._logits_slot, hidden)

    def _find_logits_slot(self, hidden: torch.Tensor) -> tuple[nn.Module, str]:
        names = {m: n for n, m in self.model.named_modules(remove_duplicate=False)}
        if self.decoder not in names:
            raise Unsupported(f"{type(self.model).__name__} holds no decoder that eyas can read the logits after")
        parts = names[self.decoder].split(".")
        path = [self.model]
        for part in parts:
            path.append(path[-1]._modules[part])
        for i in reversed(range(len(parts))):
            try:
                self._logits_through(path[i], parts[i], hidden)
            except Exception:  # noqa: BLE001 - the model's forward does not run with this stand-in: the next one out
                if i == 0:
                    raise
                continue
            return path[i], parts[i]

    def _head_is_the_logits(self, like: torch.Tensor) -> bool:
        """Whether the model's logits are exactly its lm_head's output (no cap, scale or cast after it), checked
        bit for bit on a probe whose largest logit is 64, far enough out that a softcap (Gemma 2's is 30) or a
        scale shows past the dtype's rounding. Never for a sharded lm_head, which only the model's forward may
        gather."""
        weight = getattr(self.lm_head, "weight", None)
        if weight is None or not whole(weight):
            return False
        probe = torch.randn(1, 4, self.hidden_size, generator=torch.Generator().manual_seed(0))
        probe = probe.to(device=like.device, dtype=like.dtype)
        peak = self._head(probe).abs().amax().float().clamp(min=1e-6)
        probe = (probe.float() * (64 / peak)).to(like.dtype)
        own, head = self._logits_through(*self._logits_slot, probe), self._head(probe)
        return own.dtype == head.dtype and own.shape == head.shape and torch.equal(own, head)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> the lm_head's output [..., V], through the product `_logits_through` gives it."""
        flat = hidden.reshape(1, -1, hidden.shape[-1])
        return self.logit_projection(flat).reshape(*hidden.shape[:-1], -1)

    def _logits_through(self, parent: nn.Module, name: str, hidden: torch.Tensor) -> torch.Tensor:
        """The model's forward with parent.<name> standing in for hidden [..., H] -> logits [..., V]."""
        flat = hidden.reshape(1, -1, hidden.shape[-1])
        body = parent._modules[name]
        parent._modules[name] = _Given(flat)
        try:
            with cpu_linears([self.logit_projection], flat.shape[1]):
                out = self.model(input_ids=torch.zeros(flat.shape[:2], dtype=torch.long, device=flat.device),
                                 use_cache=False, logits_to_keep=0)
        finally:
            parent._modules[name] = body
        return out.logits.reshape(*hidden.shape[:-1], out.logits.shape[-1])

    # ---- can it verify a tree in one forward? --------------------------------------------------
    def verify_mode(self) -> str:
        """"tree": a forward with eyas's masks and positions gives the model's own logits at every node of a draft
        tree, in rows of different lengths; "chain": it does not (ALiBi models, say, take positions from a 2D mask;
        GPT-Neo masks its local layers by cache column), so drafts are chains, verified as plain continuations one
        row at a time, where cache columns are positions and the model builds its own masks. Checked once, against
        the model's own forward, on short random sequences longer than the shortest declared window, with one row
        followed by GAP unused cache columns (as a row beside much longer ones has), so a model that masks or
        positions by cache column shows it. Raises Unsupported if even a plain continuation through eyas's cache
        disagrees with the model."""
        if self._verify_mode is None:
            self._checking = True  # the check's own forwards take explicit masks
            try:
                with torch.no_grad():
                    self._verify_mode = self._check_verify_mode()
            finally:
                self._checking = False
        return self._verify_mode

    GAP = 1024  # unused cache columns after one row's history in the check (at most up to the model's length limit)

    def _check_verify_mode(self) -> str:
        gen = torch.Generator().manual_seed(0)
        window = min([k[1] for k in self.attention_kinds().values() if k[1]] or [12])
        n = min(window + 4, 48)
        vocab = _safe_vocab(self.vocab_size)
        rows = [torch.randint(0, vocab, (n - r,), generator=gen).tolist() for r in range(2)]
        branches = torch.randint(0, vocab, (2, 2), generator=gen).tolist()
        # the tree: the root (each row's last token), a1 a2 and b1 b2 below it (two branches of depth 2)
        parents_depth = [0, 1, 2, 1, 2]
        ancestors = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]],
                                 dtype=torch.bool, device=self.device)
        dev = self.device

        def own(ids: list[int]) -> torch.Tensor:  # the model's own logits, one plain forward
            return self.model(torch.tensor([ids], device=dev), use_cache=False).logits[0].float()

        reference = [torch.cat([own(r + branches[0])[-3:], own(r + branches[1])[-2:]]) for r in rows]  # [5, V] per row
        tolerance = 1e-3 if self.dtype == torch.float32 else 3e-2

        def close(logits: torch.Tensor, ref: torch.Tensor) -> bool:
            return bool((logits.float() - ref).abs().amax() <= tolerance * ref.abs().amax().clamp(min=1e-6))

        def prefilled(batch: list[list[int]], gap: int = 0) -> KVCache:
            cache = self.new_cache(len(batch), n + gap + 8)
            width = max(map(len, batch)) - 1
            ids = torch.tensor([r[:-1] + [0] * (width - len(r) + 1) for r in batch], device=dev)
            self.forward(ids, cache=cache, logits=False)  # right-padded: causal attention never reaches the padding
            if not any(layer.is_initialized for layer in cache.layers):
                raise Unsupported(f"target {self.name_or_path!r} keeps no keys and values in a transformers Cache (a "
                                  "recurrent model?): eyas verifies drafts over attention layers only")
            cache.commit([len(r) - 1 for r in batch])
            cache.commit([gap] + [0] * (len(batch) - 1))  # row 0: `gap` columns no token may see
            return cache

        limit = self.max_length
        gap = self.GAP if limit is None else max(0, min(self.GAP, limit - n - 8))
        try:
            cache = prefilled(rows, gap)
            history = torch.tensor([len(r) - 1 for r in rows], device=dev)
            tokens = torch.tensor([[r[-1], *branches[0], *branches[1]] for r in rows], device=dev)
            positions = history[:, None] + torch.tensor(parents_depth, device=dev)
            width = cache.width + 5
            col = torch.arange(width, device=dev)
            gap = (col >= history[:1]) & (col < cache.lengths[:1])  # row 0's unused columns
            allowed = after_history(cache.lengths, ancestors.expand(2, -1, -1), width)
            allowed[0] &= ~gap
            out = self.forward(tokens, positions, cache, allowed).logits
            if all(close(out[b], reference[b]) for b in range(2)):
                return "tree"
            reason = "its logits differ from its own forward's"
        except Unsupported:
            raise
        except Exception as e:  # noqa: BLE001 - any failure means trees cannot be verified this way
            reason = f"{type(e).__name__}: {e}"
        cache = prefilled(rows[:1])
        out = self.forward(torch.tensor([[rows[0][-1], *branches[0]]], device=dev), cache=cache).logits[0]
        if not close(out, reference[0][:3]):
            raise Unsupported(f"target {self.name_or_path!r}: a continuation through eyas's KV cache does not "
                              "reproduce the model's own logits, so eyas cannot verify drafts for it")
        logger.warning("target %s cannot verify a draft tree in one forward (%s): eyas drafts chains for it, one row "
                       "at a time", self.name_or_path, reason)
        return "chain"

    # ---- loading -----------------------------------------------------------------------------
    @classmethod
    def load(cls, spec: str, dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
             cpu_kernels: bool = True, decoder: bool = True, compile: bool = False) -> "Target":
        """From a local HF folder, a `.gguf` file, the alias `smollm2-135m`, or a hub id, loaded straight onto
        `device` (None: CUDA when visible, else CPU; `auto`: split over every visible GPU) in `dtype` (`auto`: bf16
        on a GPU and on a CPU with native bf16, else fp32). decoder=False leaves the decoder layers unloaded, on the
        meta device: enough for the embedding, the lm_head and `logits` (offline training), not for `forward`.
        compile: decode steps through `torch.compile` (see __init__)."""
        from .loading import load_model_and_tokenizer, placement

        device, dtype = placement(device, dtype)
        model, tokenizer, name = load_model_and_tokenizer(spec, resolve_dtype(dtype), device, decoder=decoder)
        return cls(model, tokenizer, name, cpu_kernels=cpu_kernels, compile=compile)


def _safe_vocab(vocab_size: int) -> int:
    """Checks draw token ids below this: low ids are ordinary tokens in every tokenizer, where the top of a
    vocabulary holds special ones (a multimodal model's image token would make its forward expect an image)."""
    return min(vocab_size, 1000)


RECOMPILE_LIMIT = 64  # dynamo graphs of every compiled Target in a process (`_Step.forward`, see Target)


def _bucket(n: int) -> int:
    """The power of two at or above n: the sizes fixed-shape steps are compiled for."""
    return 1 << (n - 1).bit_length()


def compile_options(device: torch.device, cuda_graphs: bool = False) -> dict[str, Any]:
    """Inductor's settings for a Target's compiled steps, given to `torch.compile(options=...)`, which applies them
    to every graph it compiles. Freezing turns the frozen target's weights into constants, which lets inductor
    prepack them and fuse the products that share an input (q/k/v, gate/up); max-autotune then times its own
    GEMM templates (on CPU micro-kernels on AMX / AVX-512 / AVX2, which use the bf16 units where aten's one-row bf16
    product does not) against aten's and keeps the faster, per shape; before freezing, eyas's pass gives the one-row
    products to its own kernel on x86 CPUs with AVX2 or better and bf16 attention to fp32 where the CPU has no bf16
    units (step_pass.py). Freezing is also read by dynamo as it traces (`_freeze_while_tracing`). cuda_graphs: on a
    GPU, each graph (of fixed shapes) is captured as a CUDA graph at its first calls and replayed from then on."""
    settings: dict[str, Any] = {
        "freezing": True, "max_autotune": True, "cpp.enable_concat_linear": True,
        # the timings of every choice, printed to stderr for each product shape otherwise
        "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
    if device.type == "cpu":
        # cpp_wrapper: the graph's ~10 kernel calls per layer are made from C++, not Python (~1.3 ms of a
        # SmolLM2-135M step)
        settings.update(max_autotune_gemm_backends="CPP,ATEN", cpp_wrapper=True)
        # no size and stride checks in the graph: of its inputs, dynamo's guards check them already; of its kernels'
        # outputs, each builds a C++ stringstream even when it holds (214 a SmolLM2-135M step, ~0.1 ms)
        settings["size_asserts"] = False
        # small elementwise kernels (a plain step's SiLU-and-multiply over 1536 values) on one thread: inductor splits
        # from 512 values a thread, where a parallel region's fork, join and libgomp's two futex calls cost more than
        # the half of the work they save
        settings["cpp.min_chunk_size"] = 4096
        # one-row products (a plain step's) through eyas's kernel on x86 CPUs with AVX2 or better, bf16 attention in
        # fp32 on CPUs without bf16 units (step_pass.py)
        settings["joint_custom_pre_pass"] = step_pass()
        # eyas's kernels called as C functions, not through the dispatcher (row_gemv.C_SHIMS)
        settings["aot_inductor.custom_ops_to_c_shims"] = row_gemv.c_shims()
    elif device.type == "cuda" and cuda_graphs:
        settings["triton.cudagraphs"] = True
    return settings


class _Steps(threading.local):
    """Per thread: how many compiled Target calls are in progress, and whether a compile they started turned
    inductor's freezing switch on (`_freeze_while_tracing`)."""

    depth = 0
    froze = False


_STEPS = _Steps()


class _InStep:
    """Marks a compiled Target call in progress on this thread (re-entrant). That is all a call does: inductor's
    config is Python code (each write marks its hash stale), and switching freezing on and off around every call cost
    ~1 % of a bf16 SmolLM2-135M step, 0.6 % fp32, on the caches its weight reads leave. The outermost call checks that
    dynamo still calls `_freeze_while_tracing` (`torch._dynamo.reset()` drops every callback): a list's few items.
    Only compiled calls enter it, so dynamo is imported by then."""

    def __enter__(self) -> None:
        handler = torch._dynamo.callback_handler
        if not _STEPS.depth and _freeze_while_tracing not in handler.start_callbacks:
            handler.register_start_callback(_freeze_while_tracing)
            handler.register_end_callback(_thaw)
        _STEPS.depth += 1

    def __exit__(self, *exc: object) -> None:
        _STEPS.depth -= 1


_IN_STEP = _InStep()


def _freeze_while_tracing(_: object) -> None:
    """Dynamo reads inductor's freezing switch as it traces a graph, to hold the weights as constants guarded by
    their identity, before `torch.compile`'s options reach inductor: on for the compiles that start inside a
    Target's compiled call (a first call, a recompile), left alone for every other compile and where it is on
    already (set by the user)."""
    import torch._inductor.config as inductor

    if _STEPS.depth and not inductor.freezing:
        inductor.freezing = True
        _STEPS.froze = True


def _thaw(_: object) -> None:
    """Puts the freezing switch back after a compile `_freeze_while_tracing` turned it on for."""
    if _STEPS.froze:
        import torch._inductor.config as inductor

        inductor.freezing = False
        _STEPS.froze = False


_CACHE = "inputs['cache']"  # where dynamo finds the cache in a compiled step (`_Step.forward`'s keyword inputs)
_CACHE_BUFFER = re.compile(re.escape(_CACHE) + r"\.(key_buffers|value_buffers)\[\d+\]")


def _frozen_module_guards(entries: Sequence) -> list[bool]:
    """Which of dynamo's guards a compiled step keeps: every guard on its inputs (the tokens, positions, masks, the
    cache and its tensors) and on the interpreter's state (grad mode, autocast, function modes, default device), of
    the guards on the frozen target's modules one: the identity of one of its weights, and none on global variables.
    The frozen graphs hold the weights as constants, so a weight's identity tells one model's graphs from another's of
    the same class (each recompiles, none runs another's weights); dynamo drops a graph whose guarded object is freed,
    so a model later built at a freed one's address never runs its graphs. The thousands of other guards on the
    modules (every weight's identity, hook dicts, attribute types, config values) check what a Target never changes;
    the ~500 on globals (the identity of every module and function the trace went through, transformers' attention
    and mask registries, torch's global hooks) check libraries the graphs assume stay as they were when traced.
    Evaluating them all cost ~0.9 ms of a ~14 ms bf16 SmolLM2-135M decoding step, the weights' identities ~0.4 ms,
    the globals ~0.1 ms. Of the cache's guards two kinds go as well: those on all but one of its key buffers and of
    its value buffers (a compiled step runs only over a cache of its own model's, `KVCache.owner`, whose buffers
    share their rows, columns, dtype and device and differ otherwise only as that model's layers do), and those that
    no attribute of the cache object shadows its class's (it never sets one).
    They cost ~1.4 % of a bf16 SmolLM2-135M step, checked on the caches its weight reads leave."""
    keep, weight, buffers = [], False, set()
    for e in entries:
        if e.is_global:
            keep.append(False)
            continue
        if e.name.startswith(_CACHE):
            buffer = _CACHE_BUFFER.fullmatch(e.name)
            if e.guard_type == "TENSOR_MATCH" and buffer:
                keep.append(buffer[1] not in buffers)
                buffers.add(buffer[1])
                continue
            if e.guard_type == "NOT_PRESENT_IN_GENERIC_DICT":
                keep.append(False)
                continue
        if not e.orig_guard.source.is_unspecialized_nn_module():
            keep.append(True)
            continue
        first = (not weight and e.guard_type == "ID_MATCH" and e.has_value
                 and isinstance(e.value, torch.nn.Parameter))
        weight = weight or first
        keep.append(first)
    return keep


class _Step(nn.Module):
    """What a compiled Target compiles: the decoder, then the lm_head at the positions asked for, so that a step whose
    logits are the lm_head's output alone (`Target._head_in_graph`) computes them in the same graph as its states.
    forward(rows, **decoder inputs) -> (the decoder's last states [B, T, H], the lm_head's output at rows [B, K]
    of each row, or at every position where rows is True; None where rows is None)."""

    def __init__(self, decoder: nn.Module, head: nn.Module | None) -> None:
        super().__init__()
        self.decoder, self.head = decoder, head

    def forward(self, rows: torch.Tensor | bool | None, **inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        if inputs["position_ids"] is None:  # tokens that follow on from the cache (Target.forward)
            inputs["position_ids"] = inputs["cache"].next_positions(inputs["input_ids"].shape[1])
        hidden = self.decoder(**inputs).last_hidden_state
        if rows is None:
            return hidden, None
        return hidden, self.head(hidden if rows is True else _at(hidden, rows))


def _at(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """hidden [B, T, H] at positions [B, K] of each row -> [B, K, H]."""
    return hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))


_LAYER_INPUTS: "weakref.WeakKeyDictionary[nn.Module, dict[int, torch.Tensor]]" = weakref.WeakKeyDictionary()


def _layer_inputs(layers: nn.ModuleList) -> dict[int, torch.Tensor]:
    """Where hooks that stay capture the decoder layers' inputs a forward's cache asks for: one store and one set of
    hooks per model, so that every compiled Target over a model (which share its graphs, hooks included) reads what
    its forward captured."""
    if layers not in _LAYER_INPUTS:
        store: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(_capture(store, i), with_kwargs=True)
        _LAYER_INPUTS[layers] = store
    return _LAYER_INPUTS[layers]


def _capture(store: dict[int, torch.Tensor], i: int):
    """A forward pre-hook that stores layer i's input in `store`, where the eyas cache the layer was called with asks
    for it (`KVCache.capture`) or there is none: a compiled step traces the hook into its graph, which then
    outputs only the states asked for (each output held, each stored by Python after the graph: ~75 us of a bf16
    SmolLM2-135M step for all 30 layers)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        cache = next((a for a in (*kwargs.values(), *args) if isinstance(a, KVCache)), None)  # the layer's, if any
        if cache is None or not cache.capture or cache.capture[i]:
            store[i] = args[0] if args else kwargs["hidden_states"]

    return hook
