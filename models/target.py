"""The frozen target: any unmodified transformers causal LM, seen through what a draft head needs.

- features: the inputs of chosen decoder layers (EAGLE-3) and the final normed hidden state
  (EAGLE-1), in HF `hidden_states` numbering: id i < N is the input of layer i, id N the final
  normed state. Captured with forward pre-hooks, so no other layer's activations are kept.
- the borrowed modules: input embedding and lm_head.
- one forward over new tokens with a boolean tree mask, explicit position ids and a
  transformers Cache, plus `keep_cache` to retain only chosen cache positions.
- the logits of only the positions asked for; on CPU, eyas's kernels for the few-row forwards a
  tree verify makes and for batches of rows of different lengths (`cpu_kernels.py`: linear layers,
  GQA attention, ragged rows).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from transformers import AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from .config import TargetIdentity
from .cpu_kernels import CpuLinear, cpu_linears, gqa_attention, ragged_rows
from .masks import additive_mask

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 over the sorted (token, id) pairs: equal iff the vocabularies agree exactly."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return "sha256:" + hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [B, T, V]
    hidden: torch.Tensor  # [B, T, H] final normed hidden state (EAGLE-1 feature)
    features: torch.Tensor | None  # [B, T, len(layer_ids) * H] concatenated layer inputs (EAGLE-3)
    cache: DynamicCache | None


def _decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    n = model.config.get_text_config().num_hidden_layers
    for module in model.get_decoder().modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"could not find the {n} decoder layers of {type(model).__name__}")


class Target(nn.Module):
    """Frozen wrapper; never trained, never holds gradients."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, name_or_path: str,
                 cpu_kernels: bool = True) -> None:
        """cpu_kernels: on CPU, run eyas's kernels for few-row forwards (`models/cpu_kernels.py`: the linear
        layers through copies of their weights in fp32, GQA attention without repeated keys; faster
        multi-token verifies for one extra copy of the weights in memory); False runs the modules as they are."""
        super().__init__()
        model.eval().requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.name_or_path = name_or_path
        text = model.config.get_text_config()
        self.hidden_size: int = text.hidden_size
        self.vocab_size: int = text.vocab_size
        self.num_layers: int = text.num_hidden_layers
        self._layers = _decoder_layers(model)
        self._fingerprint: str | None = None
        self.cpu_kernels = cpu_kernels
        self.logit_projection = CpuLinear(self.lm_head, row_copy=True, enabled=cpu_kernels)  # every logit eyas computes
        self._linears = [CpuLinear(m, enabled=cpu_kernels) for m in self._layers.modules() if type(m) is nn.Linear]

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

    # ---- forward -----------------------------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        layer_ids: Sequence[int] = (),
        logits: bool = True,
        logits_to_keep: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run the target over new tokens.

        input_ids [B, T]; position_ids [B, T] (default: continue after the cache);
        attention_mask: bool [B, T, past+T] tree mask (True = may attend), or bool/int [B, past+T]
        padding mask, or None for plain causal; cache is extended in place.
        logits_to_keep [B, K] (optional) index of the positions whose logits are needed.
        """
        past = cache.get_seq_length() if cache is not None else 0
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=input_ids.device).expand(b, -1)
        if attention_mask is not None and attention_mask.dim() == 3:
            if attention_mask.shape != (b, t, past + t):
                raise ValueError(f"tree mask must be [B, T, past+T] = {(b, t, past + t)}, got {tuple(attention_mask.shape)}")
            attention_mask = additive_mask(attention_mask, self.dtype)
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        for i in layer_ids:
            if not 0 <= i <= self.num_layers:
                raise ValueError(f"layer id {i} out of range 0..{self.num_layers}")
            if i < self.num_layers:
                hooks.append(self._layers[i].register_forward_pre_hook(_capture(captured, i), with_kwargs=True))
        try:
            with (cpu_linears(self._linears, b * t), gqa_attention(self.model, self.cpu_kernels),
                  ragged_rows(attention_mask, self.cpu_kernels)):
                out = self.model.get_decoder()(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    cache=cache,
                    use_cache=cache is not None,
                )
        finally:
            for h in hooks:
                h.remove()
        hidden = out.last_hidden_state
        captured[self.num_layers] = hidden
        features = torch.cat([captured[i] for i in layer_ids], dim=-1) if layer_ids else None
        logit_out = None
        if logits:
            h = hidden if logits_to_keep is None else hidden.gather(
                1, logits_to_keep[..., None].expand(-1, -1, hidden.shape[-1]))
            logit_out = self.logit_projection(h)
        return TargetOutput(logits=logit_out, hidden=hidden, features=features, cache=cache)

    @staticmethod
    def keep_cache(cache: DynamicCache, index: torch.Tensor) -> None:
        """Keep only cache positions `index` [B, L'] (per row, ascending), e.g. prefix + accepted path.

        Columns that stay in place (the prefix) are not copied: only the tail is gathered, written
        over its new place and the rest cut off, so a cycle costs its tree, not the whole context."""
        n = index.shape[1]
        moved = (index != torch.arange(n, device=index.device)).any(0)  # [L']
        first = int(moved.nonzero()[0]) if bool(moved.any()) else n
        for layer in cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            k, v = layer.keys, layer.values
            if first < n:
                idx = index[:, None, first:, None].to(k.device).expand(-1, k.shape[1], -1, k.shape[3])
                k[:, :, first:n], v[:, :, first:n] = k.gather(2, idx), v.gather(2, idx)  # gathered before written
            if hasattr(layer, "cumulative_length"):  # sliding-window layers count tokens seen
                layer.cumulative_length -= k.shape[2] - n
            layer.keys, layer.values = k[:, :, :n], v[:, :, :n]

    # ---- loading -----------------------------------------------------------------------------
    @classmethod
    def load(cls, spec: str, dtype: str | torch.dtype = "fp32", device: str | torch.device = "cpu",
             cpu_kernels: bool = True) -> "Target":
        """From a local HF folder, a `.gguf` file, the alias `smollm2-135m`, or a hub id."""
        from .loading import load_model_and_tokenizer

        model, tokenizer, name = load_model_and_tokenizer(spec, resolve_dtype(dtype))
        return cls(model.to(device), tokenizer, name, cpu_kernels=cpu_kernels)


def _capture(store: dict[int, torch.Tensor], i: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        store[i] = args[0] if args else kwargs["hidden_states"]

    return hook
