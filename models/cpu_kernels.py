"""eyas's own kernels for the frozen target's forwards on CPU, where the stock path is slow.

A tree verify runs the target over 2..32 new tokens; on CPU in fp32 two of transformers' stock paths
make that cost far more than one token although the weights and the cache are read once either way:
- F.linear repacks its weight on every call with more than one row (`CpuLinear`, `cpu_linears`);
- sdpa attention with a mask repeats a GQA layer's keys and values for every query head, a copy of
  the whole cache in every layer (`gqa_attention`).
A batch of sequences of different lengths (regeneration's slots) pays a third: every row's attention
reads the cache up to the longest row. With a padding mask, rows are attended in groups, each group
over only the columns some row of it can see (`ragged_spans`, `ragged_rows`).
All take effect only for the duration of a Target forward and only where they apply (CPU, fp32 for
the linears); anywhere else the model's own code runs, so every target still works unmodified.
"""

from __future__ import annotations

import contextlib
import contextvars
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
    """transformers' sdpa attention, with two changes on CPU where a mask is given:
    query [B, heads, T, D], key/value [B, kv_heads, S, D], mask [B, 1, T, S] -> ([B, T, heads, D], None).
    - Inside `ragged_rows`, each span of rows attends only over the last columns its rows can see.
    - A masked forward of several query rows in a GQA layer reads each key/value head once, where
      transformers repeats key and value per query head (SDPA's own GQA falls back to its slow kernel
      with a mask on CUDA) - the same result (SmolLM2, 9 query / 3 kv heads, one layer, 500 cached
      tokens, 4 new: 364 -> 166 us; a whole verify of 2-32 tokens over that cache 0.90-0.93x the time)."""
    spans = _SPANS.get()
    if (spans is not None and attention_mask is not None and query.device.type == "cpu"
            and attention_mask.shape[0] == query.shape[0] and attention_mask.shape[-1] == key.shape[2]):
        parts = [_sdpa_gqa_dense(module, query[a:b], key[a:b, :, -m:], value[a:b, :, -m:],
                                 attention_mask[a:b, ..., -m:], dropout, scaling, is_causal, **kwargs)[0]
                 for a, b, m in spans]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), None
    return _sdpa_gqa_dense(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def _sdpa_gqa_dense(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """`_sdpa_gqa` over all the rows it is given at once (the GQA change only)."""
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


# ---- ragged rows ---------------------------------------------------------------------------------
# One more attention call costs about as much as reading this many more (row, column)s: ~20 us per SDPA call
# against ~0.15-0.25 us per row and column (SmolLM2's 3 kv heads of 64, one thread).
SPAN_CALL_COST = 128
_SPANS: contextvars.ContextVar[list[tuple[int, int, int]] | None] = contextvars.ContextVar("eyas_spans", default=None)


def ragged_spans(need: Sequence[int], call_cost: int) -> list[tuple[int, int, int]]:
    """Split rows 0..B-1, where row r attends only to the last need[r] key columns, into contiguous spans
    (first, end, columns = the most any row in it needs) minimizing sum(rows x columns) + call_cost per span:
    the attention of a span reads `columns` for each of its rows, and each span is one more kernel call.
    Exact dynamic program, O(B^2) for B rows (64 rows: ~1 ms of Python per forward)."""
    n = len(need)
    best, cut = [0] + [None] * n, [0] * (n + 1)  # best[j]: cheapest split of rows [0, j); cut[j]: its last span's start
    for j in range(1, n + 1):
        widest = 0
        for i in range(j - 1, -1, -1):
            widest = max(widest, need[i])
            cost = best[i] + (j - i) * widest + call_cost
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    spans, j = [], n
    while j:
        spans.append((cut[j], j, max(need[cut[j]: j])))
        j = cut[j]
    return spans[::-1]


@contextlib.contextmanager
def ragged_rows(padding_mask: torch.Tensor | None, enabled: bool = True):
    """For the duration of the block, `_sdpa_gqa` attends each span of rows (`ragged_spans`) only over the
    key columns to the right of its rows' first visible one. padding_mask [B, S] (True/1 = visible),
    the 2D mask of a forward whose S key columns end with its new tokens; rows whose visible columns
    start at different places (left padding, right-aligned caches) read less. Anything else: no change."""
    if not enabled or padding_mask is None or padding_mask.dim() != 2 or padding_mask.device.type != "cpu":
        yield
        return
    visible = padding_mask.bool()
    need = (visible.shape[1] - visible.int().argmax(1)).tolist()  # columns from each row's first visible one
    spans = ragged_spans(need, SPAN_CALL_COST) if min(need) < visible.shape[1] else None
    token = _SPANS.set(spans)
    try:
        yield
    finally:
        _SPANS.reset(token)
