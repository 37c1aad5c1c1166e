"""eyas's own kernels for the frozen target's forwards on CPU, where the stock path is slow.

A tree verify runs the target over 2..32 new tokens; on CPU in fp32 two of transformers' stock paths
make that cost far more than one token although the weights and the cache are read once either way:
- F.linear repacks its weight on every call with more than one row (`CpuLinear`, `cpu_linears`);
- sdpa attention with a mask repeats a GQA layer's keys and values for every query head, a copy of
  the whole cache in every layer (`cpu_attention`).
A batch of sequences of different lengths (regeneration's slots) pays a third: every row's attention
reads the cache up to the longest row. Rows are attended in groups, each over only the columns some
row of it can see (`ragged_spans`, `cpu_attention(need=...)`).
At one row torch's products read the weight below the memory bandwidth (in bf16 slower than fp32 although they read
half the bytes: on CPUs with native bf16 instructions, AMX or AVX512-BF16, they do not use them); eyas's row kernel
(row_gemv.py, any x86 CPU with AVX2) reads it nearer the bandwidth, and takes a verify's few rows where torch's
products are slower (`row_kernel_takes`, `kernel_rows`); past them a oneDNN-prepacked copy runs, which on a CPU with
AMX multiplies even a few bf16 rows with its tiles. Without bf16 units, bf16 products of more rows than that kernel
takes (a prefill) run in fp32 (`_bf16_in_fp32`): torch emulates bf16 products there.
Attention over bf16 runs in fp32 where the CPU has no bf16 units (`attends_in_fp32`): torch's bf16 attention
emulates bf16 products there, several times slower than fp32. A compiled step's attention of a few query rows runs
eyas's attention kernel (`attention_kernel_takes`, up to `attention_rows`; `rewrite_attention`).
All take effect only for the duration of a Target forward and only where they apply (CPU, fp32 or bf16 for the
linears, the model's attention going through transformers' "sdpa" entry); anywhere else the
model's own code runs, so every target still works unmodified. The model's configuration is never
touched: models that branch on `config._attn_implementation` keep their own code path.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import operator
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import row_gemv


@functools.cache
def native_bf16() -> str | None:
    """The instructions this CPU multiplies bf16 matrices with ("AMX-BF16", "AVX512-BF16"), None where it has none
    (AVX2-only CPUs emulate bf16 through fp32, slower than fp32 itself)."""
    capabilities = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")):
        if capabilities.get(flag):
            return name
    return None


class CpuLinear:
    """eyas's own kernel for one of the target's nn.Linear layers: x [..., in] -> [..., out].

    On CPU in fp32, F.linear repacks the weight on every call with more than one row, so a verify
    over 2..16 tokens costs far more than one token although the weights are read once either way
    (SmolLM2-135M, decoder layers alone: 2 rows 1.35-1.7x one row; its 49152x576 lm_head 2 rows
    76 -> 35 ms). A oneDNN-prepacked copy of the weight keeps a few rows near the cost of one.
    One row, and the few rows it is faster at (`row_kernel_takes`: up to `kernel_rows`; one bf16 row with AMX), run
    eyas's row kernel (row_gemv.py) on the weight itself on any x86 CPU with AVX2; elsewhere one fp32 row stays with
    F.linear (a GEMV) or, with `row_copy`, a contiguous [in, out] copy (~2x faster than F.linear for the lm_head's
    one-row product). Copies are built on first use
    (one extra copy of the weight each) and rebuilt when the weight changes place, version or
    shape. Without native bf16 units, more bf16 rows than the row kernel takes are multiplied in fp32. Anywhere else
    (GPU, a hooked or sharded layer, a torch without oneDNN) the module itself runs, so every target still works
    unmodified.
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
        return (type(m) is nn.Linear and w is not None and w.device.type == "cpu"
                and w.dtype in (torch.float32, torch.bfloat16)
                and torch.backends.mkldnn.is_available() and whole(w)
                # hooks (accelerate offloading, user hooks) expect the module to be called
                and not (m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m)))

    def prepare(self) -> None:
        """Build the copies, or rebuild them if the weight changed since."""
        w = self.module.weight
        key = (w.data_ptr(), w._version, w.shape)
        if key != self._key:
            # the [in, out] copy serves one row only where eyas's row kernel does not
            row_t = self.row_copy and w.dtype == torch.float32 and not self._row_kernel()
            self.weight_t = w.detach().t().contiguous() if row_t else None
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._key = key

    def _row_kernel(self) -> bool:
        """Whether eyas's row kernel is built for this CPU and takes this weight (it reads the weight in place)."""
        return self.module.weight.is_contiguous() and row_gemv.available()

    def kernel(self, rows: int):
        """eyas's product for an input of `rows` rows (x -> y, a drop-in for the module's forward), or None
        where the module itself is best or must run: eyas's row kernel for one row and for the few rows it is faster
        at (`row_kernel_takes`), prepacked for more (bf16 without bf16 units: in fp32 past row_gemv.MAX_ROWS rows);
        where that kernel is not built, prepacked for one bf16 row, the [in, out] copy for one row of an fp32 row_copy
        layer, otherwise F.linear's GEMV."""
        bf16 = self.module.weight.dtype == torch.bfloat16
        if not self.applies():
            return None
        if self._row_kernel() and row_kernel_takes(self.module.weight.dtype, rows):
            return functools.partial(_through_row_kernel, weight=self.module.weight.detach(), bias=self.module.bias)
        if not (rows > 1 or self.row_copy or bf16):
            return None
        if bf16 and native_bf16() is None:  # oneDNN and F.linear would emulate bf16 products
            if rows <= row_gemv.MAX_ROWS:  # the row kernel where built; else torch, at a few rows cheaper than a cast
                return None
            return functools.partial(_bf16_in_fp32, weight=self.module.weight.detach(), bias=self.module.bias)
        self.prepare()
        if rows > 1 or bf16:
            return functools.partial(_packed_linear, packed=self.packed, bias=self.module.bias)
        return functools.partial(_row_product, weight_t=self.weight_t, bias=self.module.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel(x[..., 0].numel())
        return self.module(x) if kernel is None else kernel(x)


def whole(weight: torch.Tensor) -> bool:
    """Whether a weight is a plain tensor held whole: a sharded one (DeepSpeed ZeRO-3, FSDP2) is whole only inside its
    module's own call, so only that call may read it."""
    return type(weight.data) is torch.Tensor and not hasattr(weight, "ds_id")


_PACKED = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None


@contextlib.contextmanager
def cpu_linears(linears: Sequence[CpuLinear], rows: int):
    """Run the layers' own calls through eyas's kernels for the duration of the block (`CpuLinear.kernel`):
    eyas's row kernel at one row and the few rows it takes (`row_kernel_takes`), the prepacked copies at more (where
    the row kernel is not built, one row changes only the `row_copy` layers, to their [in, out] copy; the rest keep
    F.linear). The model's code is untouched: only the bound forward of each applicable instance is shadowed."""
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


def row_kernel_takes(dtype: torch.dtype, rows: int | None) -> bool:
    """Whether eyas's row kernel (row_gemv.py, where it is built) is the product of `rows` input rows by `dtype`
    weights on this CPU: up to `kernel_rows(dtype)` rows. rows None (a compiled graph whose row count varies: a
    verify's after the first change of tree size): where the kernel is the faster product up to at least half of
    row_gemv.MAX_ROWS rows (it hands rows past MAX_ROWS to F.linear)."""
    if dtype not in row_gemv.DTYPES:
        return False
    most = kernel_rows(dtype)
    return most >= row_gemv.MAX_ROWS // 2 if rows is None else rows <= most


def kernel_rows(dtype: torch.dtype) -> int:
    """The most input rows eyas's row kernel is the faster product of on this CPU, against oneDNN's prepacked one. The
    kernel reads each weight once for all rows and loads each weight vector once per block of rows, so it is a read of
    the weights up to a few rows and its FMAs past them, where oneDNN's blocked products gain on it by the CPU's
    vector units: `benchmarks/kernel_variants.py --rows ... --onednn` times both over SmolLM2-135M's products.
    - bf16 on CPUs with AMX: 1 (its tiles multiply several rows far faster than vector instructions).
    - bf16 with AVX512-BF16 and no AMX, and fp32 there: 16 (2-core Zen 4 EPYC, bf16: 8 rows 12.7 against 16.5 ms,
      16 rows 16.3 against 19.8, 32 rows 32.3 against 30.3; fp32: 8 rows 23.5 against 30.4, 16 rows 31.2 against
      37.4, 32 rows 61.2 against 59.5).
    - bf16 without bf16 units: row_gemv.MAX_ROWS (torch emulates bf16 products there, several times slower: Ice Lake
      Xeon, 16 rows 54.3 against F.linear's 128.0 ms).
    - fp32 on other AVX-512 CPUs (two 512-bit FMA units a core, where Zen 4 has one): 8 (Ice Lake Xeon, before the
      kernel's blocks of rows: 4 rows 34.7 against 40.3 ms, 8 rows 57.2 against 48.9, which the blocks make 1.36x
      faster on Zen 4); on AVX2 (blocks of two fp32 rows): 4."""
    units = native_bf16()
    if dtype == torch.bfloat16:
        return 1 if units == "AMX-BF16" else 16 if units else row_gemv.MAX_ROWS
    if units == "AVX512-BF16":
        return 16
    return 8 if row_gemv.isa() in ("avx512", "avx512_bf16") else 4


def _through_row_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in], weight [out, in] -> [..., out] through eyas's row kernel. A layer may see more rows than the
    forward has tokens (MLA expands every cached latent): those take F.linear where the kernel does not take them."""
    if not row_kernel_takes(x.dtype, x.numel() // x.shape[-1]):
        return F.linear(x, weight, bias)
    y = row_gemv.row_gemv(x, [weight])
    return y if bias is None else y + bias


def _bf16_in_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bf16 x [..., in] by a bf16 weight [out, in] -> bf16 [..., out], multiplied in fp32: on CPUs without bf16 units
    torch emulates bf16 products, and past a few rows (a prefill) the fp32 product with the weight cast for the call
    is several times faster (SmolLM2-135M, a compiled Target's 120-token prefill on an AVX2-only Zen 3 EPYC: 1.43 s
    with torch's bf16 products, 0.41 s this way, 0.28 s with fp32 weights). It accumulates in fp32 and rounds once to
    bf16, as torch's bf16 product does."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def _row_product(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in], weight_t [in, out] contiguous -> [..., out] (one row, or more in a layer that sees more rows than
    the forward has tokens)."""
    rows = x.reshape(-1, x.shape[-1])
    y = rows @ weight_t if bias is None else torch.addmm(bias, rows, weight_t)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# ---- attention ----------------------------------------------------------------------------------
# Set only inside `cpu_attention`: (the function the "sdpa" entry held before, the ragged spans or None).
_ACTIVE: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("eyas_cpu_attention", default=None)


def _sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
          is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' "sdpa" attention while a Target forward runs, with two changes on CPU where a mask is given:
    query [B, heads, T, D], key/value [B, kv_heads, S, D], mask [B, 1, T, S] -> ([B, T, heads, D], None).
    - With ragged spans, each span of rows attends only over the first columns its rows can see.
    - A masked forward of several query rows in a GQA layer reads each key/value head once, where
      transformers repeats key and value per query head (SDPA's own GQA falls back to its slow kernel
      with a mask on CUDA) - the same result (SmolLM2, 9 query / 3 kv heads, one layer, 500 cached
      tokens, 4 new: 364 -> 166 us; a whole verify of 2-32 tokens over that cache 0.90-0.93x the time).
    Outside a Target forward (another thread, another model) the stock function runs."""
    state = _ACTIVE.get()
    stock = state[0] if state is not None else sdpa_attention_forward
    args = (dropout, scaling, is_causal)
    if state is None or query.device.type != "cpu":
        return stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                     **kwargs)
    if attends_in_fp32(query.dtype):
        mask = attention_mask.float() if attention_mask is not None and attention_mask.is_floating_point() else None
        out, _ = _sdpa(module, query.float(), key.float(), value.float(), attention_mask if mask is None else mask,
                       *args, **kwargs)
        return out.to(query.dtype), None
    spans = state[1]
    if (spans is not None and attention_mask is not None and attention_mask.shape[0] == query.shape[0]
            and attention_mask.shape[-1] == key.shape[2]):
        parts = [_sdpa_gqa(stock, module, query[a:b], key[a:b, :, :m], value[a:b, :, :m],
                           attention_mask[a:b, ..., :m], *args, **kwargs)[0] for a, b, m in spans]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), None
    return _sdpa_gqa(stock, module, query, key, value, attention_mask, *args, **kwargs)


def _sdpa_gqa(stock, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, is_causal: bool | None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """`_sdpa` over all the rows it is given at once (the GQA change only)."""
    if (getattr(module, "num_key_value_groups", 1) == 1 or attention_mask is None or query.shape[2] == 1
            or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
            or kwargs.get("s_aux") is not None):
        return stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                     **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def attends_in_fp32(dtype: torch.dtype) -> bool:
    """Whether eyas runs attention over `dtype` queries, keys and values in fp32 on this CPU (and casts the output
    back): bf16 where the CPU has no bf16 units. torch's CPU attention multiplies bf16 through MKL's emulated bf16
    products there, ~5x slower than fp32 although it reads half the bytes (a decoding step's attention, 9 query heads
    over 3 key/value heads of 200 cached tokens: 263 against 52 us on an Ice Lake Xeon, casts not counted; 1000
    tokens: 1265 against 138 us). The fp32 products accumulate as torch's bf16 ones do, in fp32; the softmax weights
    stay fp32 where torch's bf16 kernel rounds them to bf16 before the product with the values."""
    return dtype == torch.bfloat16 and native_bf16() is None


def attention_rows() -> int:
    """The most query rows eyas's attention kernel (`row_gemv.attend`) is the faster attention of on this CPU, within
    a compiled verify, against torch's flash attention, whose blocked products gain on it as rows grow
    (`benchmarks/kernel_rows_ab.py --hold attention` times the two, SmolLM2-135M over 200 cached tokens):
    - AVX512-BF16 without AMX: 16 (2-core Zen 4 EPYC, verifies with the kernel against torch's past 4 rows, per-round
      ratios: bf16 8 tokens 1.110, 16 tokens 1.065 (1.183 over 1000 cached tokens), in the graph of any size 1.099
      and 1.059; fp32 16 tokens 1.060; with the bound raised to 32, 32 tokens 1.008). torch's bf16 attention there
      runs oneDNN's AVX512-BF16 products in small per-head blocks, which a few rows do not fill.
    - elsewhere: 4 (a plain step's row, a small verify's few). On an Ice Lake Xeon (no bf16 units) torch's kernel alone
      was the faster at 16 rows (130.5 against 159.5 us); with AMX its tiles multiply blocks of rows far faster."""
    return 16 if native_bf16() == "AVX512-BF16" else 4


def attention_kernel_takes(dtype: torch.dtype, rows: int | None, head_dim: int) -> bool:
    """Whether eyas's attention kernel (`row_gemv.attend`, where it is built) is the attention of `rows` query rows of
    `head_dim` over `dtype` (fp32 or bf16) keys on this CPU: up to `attention_rows()` rows; `rows` None (a graph whose
    row count varies): the kernel, which hands a call of more rows to torch's attention as it comes. bf16 on every
    CPU: the kernel reads bf16 keys and values in place and computes in fp32, where torch's flash attention at a few
    rows spends more on its per-head blocks than on the reads, bf16 units or not. 9 query heads over 3 key/value heads
    of 64, 200 cached tokens, cold (benchmarks/attention.py): an Ice Lake Xeon (no bf16 units), one row 23.6 against
    flash attention's 52.7 us in fp32 and 24.5 against 132.5 in bf16; a Zen 4 EPYC (AVX512-BF16), one row 34.1
    against 166.7 us in bf16 and 26.9 against 45.1 in fp32, four rows 53.3 against 94.9 in bf16
    (docs/design/cpu-kernels.md)."""
    return (row_gemv.attend_takes(head_dim) and dtype in row_gemv.DTYPES
            and (rows is None or 1 <= rows <= attention_rows()))


def rewrite_attention(graph: fx.Graph) -> int:
    """In an aten graph of a CPU forward, run each attention (`_scaled_dot_product_flash_attention_for_cpu`, what SDPA
    lowers to there) through eyas's kernel where `attention_kernel_takes` says so, else over bf16 in fp32 where
    `attends_in_fp32` (queries, keys, values and a float mask cast up, the output cast back: the compiled step's form of
    what `_sdpa` does in an eager forward); returns how many it rewrote."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _FLASH_CPU:
            continue
        vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:3]]
        if (any(v is None for v in vals) or vals[0].device.type != "cpu"
                or not all(user.target is operator.getitem for user in node.users)):
            continue
        fake_mode = torch._guards.detect_fake_mode(vals)
        with graph.inserting_before(node), fake_mode:
            done = (_through_attention_kernel(graph, node, vals)
                    or attends_in_fp32(vals[0].dtype) and _in_fp32(graph, node, vals[0].dtype))
        if not done:
            continue
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def _through_attention_kernel(graph: fx.Graph, node: fx.Node, vals: list[torch.Tensor]) -> bool:
    """Replace a flash-attention node by eyas::attend where the kernel takes it (no dropout, no causal flag: eyas's
    steps pass masks; the log-sum-exp unread); False where it does not."""
    q = vals[0]
    dropout = node.args[3] if len(node.args) > 3 else 0.0
    causal = node.args[4] if len(node.args) > 4 else False
    rows = q.shape[2] if isinstance(q.shape[2], int) else None
    if (dropout != 0.0 or causal or any(user.args[1] != 0 and user.users for user in node.users)
            or not isinstance(q.shape[3], int) or not row_gemv.available()
            or not attention_kernel_takes(q.dtype, rows, q.shape[3])):
        return False
    mask = node.kwargs.get("attn_mask")
    scale = node.kwargs.get("scale")
    scale = float(scale) if scale is not None else q.shape[3] ** -0.5
    k, v = node.args[1:3]
    heads = _unrepeated(k), _unrepeated(v)
    if all(heads) and statically_known_true(heads[0].meta["val"].shape[1] == heads[1].meta["val"].shape[1]):
        (k, v), vals = heads, [q, heads[0].meta["val"], heads[1].meta["val"]]
    most = attention_rows()
    out = graph.call_function(torch.ops.eyas.attend.default, (node.args[0], k, v, mask, scale, most))
    out.meta["val"] = row_gemv.attend(*vals, mask.meta["val"] if isinstance(mask, fx.Node) else None, scale, most)
    for user in list(node.users):  # the output, and the log-sum-exp nothing reads
        if user.args[1] == 0:
            user.replace_all_uses_with(out)
        graph.erase_node(user)
    return True


def _unrepeated(node: object) -> fx.Node | None:
    """The key or value heads [B, G, S, D] that a GQA model repeated once per query head before its attention
    (transformers' `repeat_kv`: unsqueeze at 2, expand to [B, G, n, S, D], clone, view as [B, G * n, S, D]), or None.
    eyas's kernel reads each key/value head once for all the query heads that read it, so it takes them unrepeated,
    and the copy of the cache in every layer goes with the clone nothing reads then."""
    view = node
    if not (isinstance(view, fx.Node) and view.target in row_gemv.VIEWS and len(view.args[1]) == 4):
        return None
    clone = view.args[0]
    if not (isinstance(clone, fx.Node) and clone.target is _CLONE):
        return None
    expand = clone.args[0]
    if not (isinstance(expand, fx.Node) and expand.target is _EXPAND):
        return None
    unsqueeze = _under_whole_slices(expand.args[0])
    if not (isinstance(unsqueeze, fx.Node) and unsqueeze.target is _UNSQUEEZE and unsqueeze.args[1] in (2, -3)):
        return None
    heads, repeated, out = (n.meta["val"].shape for n in (unsqueeze.args[0], expand, view))
    same = [heads[0] == repeated[0], heads[1] == repeated[1], heads[2] == repeated[3], heads[3] == repeated[4],
            out[0] == heads[0], out[1] == heads[1] * repeated[2], out[2] == heads[2], out[3] == heads[3]]
    return unsqueeze.args[0] if all(statically_known_true(x) for x in same) else None


def _under_whole_slices(node: object) -> object:
    """The tensor under slices that keep all of it: `x[:, :, None, :, :]` (repeat_kv's unsqueeze) traces with a
    dynamic sequence length as an unsqueeze between slices of whole dimensions, which a fixed length drops. A slice
    as long as its dimension is the whole of it."""
    while isinstance(node, fx.Node) and node.target is _SLICE and isinstance(node.args[0], fx.Node):
        whole, part = node.args[0].meta["val"].shape, node.meta["val"].shape
        if len(whole) != len(part) or not all(statically_known_true(a == b) for a, b in zip(whole, part)):
            break
        node = node.args[0]
    return node


def _in_fp32(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> bool:
    """Replace a bf16 flash-attention node by the same over fp32 casts of its inputs, its output cast back."""
    def up(n: fx.Node) -> fx.Node:
        cast = graph.call_function(_CONVERT, (n, torch.float32))
        cast.meta["val"] = n.meta["val"].float()
        return cast

    args = [up(a) for a in node.args[:3]] + list(node.args[3:])
    kwargs = dict(node.kwargs)
    mask = kwargs.get("attn_mask")
    if isinstance(mask, fx.Node) and mask.meta["val"].is_floating_point():
        kwargs["attn_mask"] = up(mask)
    fp32 = graph.call_function(_FLASH_CPU, tuple(args), kwargs)
    fp32.meta["val"] = _FLASH_CPU(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args],
                                  **{k: v.meta["val"] if isinstance(v, fx.Node) else v for k, v in kwargs.items()})
    for user in list(node.users):  # getitem(node, 0): the output; getitem(node, 1): the log-sum-exp
        index = user.args[1]
        part = graph.call_function(operator.getitem, (fp32, index))
        part.meta["val"] = fp32.meta["val"][index]
        if index == 0:
            part = graph.call_function(_CONVERT, (part, dtype))
            part.meta["val"] = fp32.meta["val"][0].to(dtype)
        user.replace_all_uses_with(part)
        graph.erase_node(user)
    return True


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_CLONE, _EXPAND, _UNSQUEEZE, _SLICE = (torch.ops.aten.clone.default, torch.ops.aten.expand.default,
                                       torch.ops.aten.unsqueeze.default, torch.ops.aten.slice.Tensor)
_CONVERT = torch.ops.prims.convert_element_type.default


@contextlib.contextmanager
def cpu_attention(enabled: bool = True, need: Sequence[int] | None = None):
    """For the duration of the block, models whose attention goes through transformers' "sdpa" entry run `_sdpa`.
    need[b]: the key columns row b can see, counted from the first (rows of different lengths, left-aligned in
    the cache); rows are then attended in spans (`ragged_spans`) when that reads less."""
    if not enabled:
        yield
        return
    spans = ragged_spans(need, SPAN_CALL_COST) if need and min(need) < max(need) else None
    mapping = AttentionInterface._global_mapping
    previous = mapping.get("sdpa", sdpa_attention_forward)
    token = _ACTIVE.set((previous if previous is not _sdpa else sdpa_attention_forward, spans))
    mapping["sdpa"] = _sdpa
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        if _ACTIVE.get() is None:  # the outermost block restores the entry
            mapping["sdpa"] = previous if previous is not _sdpa else sdpa_attention_forward


# ---- ragged rows ---------------------------------------------------------------------------------
# One more attention call costs about as much as reading this many more (row, column)s: ~20 us per SDPA call
# against ~0.15-0.25 us per row and column (SmolLM2's 3 kv heads of 64, one thread).
SPAN_CALL_COST = 128


def ragged_spans(need: Sequence[int], call_cost: int) -> list[tuple[int, int, int]]:
    """Split rows 0..B-1, where row r attends only to the first need[r] key columns, into contiguous spans
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
