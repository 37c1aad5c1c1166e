"""eyas's own kernels for the frozen target's few-row forwards on CPU, where the stock path is slow.

A tree verify runs the target over 2..32 new tokens; on CPU in fp32 two of transformers' stock paths
make that cost far more than one token although the weights and the cache are read once either way:
- F.linear repacks its weight on every call with more than one row (`CpuLinear`, `cpu_linears`);
- sdpa attention with a mask repeats a GQA layer's keys and values for every query head, a copy of
  the whole cache in every layer (`gqa_attention`).
Both take effect only for the duration of a Target forward and only where they apply (CPU, fp32 for
the linears); anywhere else the model's own code runs, so every target still works unmodified.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


class CpuLinear:
    """eyas's own kernel for one of the target's nn.Linear layers: x [..., in] -> [..., out].

    On CPU in fp32, F.linear repacks the weight on every call with more than one row, so a verify
    over 2..16 tokens costs far more than one token although the weights are read once either way
    (SmolLM2-135M, decoder layers alone: 2 rows 1.35-1.7x one row; its 49152x576 lm_head 2 rows
    76 -> 35 ms). A oneDNN-prepacked copy of the weight keeps a few rows near the cost of one.
    One row stays with F.linear (a GEMV) or, with `row_copy`, a contiguous [in, out] copy (~2x
    faster than F.linear for the lm_head's one-row product). Copies are built on first use
    (one extra copy of the weight each) and rebuilt when the weight changes place, version or
    shape. Anywhere else (GPU, bf16, a hooked or sharded layer, a torch without oneDNN) the
    module itself runs, so every target still works unmodified.
    """

    def __init__(self, module: nn.Module, row_copy: bool = False, enabled: bool = True) -> None:
        self.module = module
        self.row_copy = row_copy
        self.enabled = enabled
        self._key: tuple | None = None
        self.weight_t: torch.Tensor | None = None  # [in, out] contiguous (row_copy only)
        self.packed: torch.Tensor | None = None  # oneDNN layout of the [out, in] weight

    def applies(self) -> bool:
        if not self.enabled:
            return False
        m = self.module
        w = getattr(m, "weight", None)
        # Sharded weights (DeepSpeed ZeRO-3, FSDP2) are only whole inside the module's own call.
        return (type(m) is nn.Linear and w is not None and w.device.type == "cpu"
                and w.dtype == torch.float32 and torch.backends.mkldnn.is_available()
                and type(w.data) is torch.Tensor and not hasattr(w, "ds_id")
                # hooks (accelerate offloading, user hooks) expect the module to be called
                and not (m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m)))

    def prepare(self) -> None:
        """Build the copies, or rebuild them if the weight changed since."""
        w = self.module.weight
        key = (w.data_ptr(), w._version, w.shape)
        if key != self._key:
            self.weight_t = w.detach().t().contiguous() if self.row_copy else None
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._key = key

    def kernel(self, rows: int):
        """eyas's product for an input of `rows` rows (x -> y, a drop-in for the module's forward), or None
        where the module itself is best or must run: prepacked for several rows, the [in, out] copy for
        one row of a row_copy layer; otherwise F.linear's GEMV."""
        if not ((rows > 1 or self.row_copy) and self.applies()):
            return None
        self.prepare()
        if rows > 1:
            return functools.partial(_packed_linear, packed=self.packed, bias=self.module.bias)
        return functools.partial(_row_product, weight_t=self.weight_t, bias=self.module.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel(x[..., 0].numel())
        return self.module(x) if kernel is None else kernel(x)


_PACKED = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None


@contextlib.contextmanager
def cpu_linears(linears: Sequence[CpuLinear], rows: int):
    """Run the layers' own calls through eyas's copies of their weights for the duration of the block: the
    prepacked ones when they see more than one row; with one row only the `row_copy` layers change (to
    their [in, out] copy), the rest keep F.linear, the fastest there. The model's code is untouched: only
    the bound forward of each applicable instance is shadowed."""
    active = []
    for lin in linears:
        if (kernel := lin.kernel(rows)) is not None:
            lin.module.forward = kernel
            active.append(lin)
    try:
        yield
    finally:
        for lin in active:
            del lin.module.forward


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _PACKED(x, packed, bias, "none", [], "")


def _row_product(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] holding one row, weight_t [in, out] contiguous -> [..., out]."""
    rows = x.reshape(1, -1)
    y = rows @ weight_t if bias is None else torch.addmm(bias, rows, weight_t)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# ---- attention ----------------------------------------------------------------------------------
GQA_SDPA = "eyas_sdpa"


def _sdpa_gqa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except for a masked forward of several query rows in a GQA layer on CPU:
    query [B, heads, T, D], key/value [B, kv_heads, S, D], mask [B, 1, T, S] -> ([B, T, heads, D], None).
    There transformers repeats key and value per query head (SDPA's own GQA falls back to its slow kernel
    with a mask on CUDA); torch's CPU kernel reads each key/value head once instead, with the same result
    (SmolLM2, 9 query / 3 kv heads, one layer, 500 cached tokens, 4 new: 364 -> 166 us; a whole verify of
    2-32 tokens over that cache 0.90-0.93x the time)."""
    if (getattr(module, "num_key_value_groups", 1) == 1 or attention_mask is None or query.shape[2] == 1
            or query.device.type != "cpu" or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_SDPA, _sdpa_gqa)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)  # the same masks as sdpa


@contextlib.contextmanager
def gqa_attention(model: PreTrainedModel, enabled: bool = True):
    """For the duration of the block, a model running transformers' sdpa attention runs `_sdpa_gqa` instead
    (the model's own attention modules pick their function from the config at call time)."""
    config = model.config.get_text_config()
    if not enabled or config._attn_implementation != "sdpa":
        yield
        return
    config._attn_implementation = GQA_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
