"""eyas's CPU kernels for a decoding step's few rows (`row_gemv.cpp`): the product of one or a few rows by bf16 or fp32
weights, the attention of a few query rows over the cache (`attend`), and the graph rewrite that runs a compiled step's
products through the first.

A decoding step multiplies one row by every weight once, so its cost is the weights' read. torch's products are shaped
for many rows: at one row they read the weight well below the memory bandwidth (oneDNN's bf16 product and inductor's
GEMM templates 70-80 % of it; on CPUs without bf16 instructions torch's one-row bf16 product is slower than an fp32 one
although it reads half the bytes). eyas's kernel reads each thread's share of the rows as several far-apart streams with
prefetches ahead, and takes the products that share an input (q/k/v, gate/up) in one call; a few rows (a verify's) read
each weight row once, in blocks of rows that load each weight vector once for the block. torch's CPU flash attention,
built for blocks of many query rows, costs several times the work of one row's attention; `attend` computes it in fp32
over the keys and values in place. Both are built on first use by torch's C++ extension loader
(the compiler a compiled step needs anyway, and ninja) for the best of the CPU's AVX512-BF16, AVX-512 and AVX2
(`isa()`), once per machine, instruction set, torch release and source; on other CPUs, or where the build fails (logged
once), `available()` is False and every product and attention runs torch's kernels as before."""

from __future__ import annotations

import copyreg
import ctypes
import fcntl
import functools
import logging
import os
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import fx

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("row_gemv.cpp")
_aten = torch.ops.aten
DTYPES = (torch.bfloat16, torch.float32)  # what the kernel multiplies (x and the weights alike)
MAX_ROWS = 32  # the most input rows the kernel takes; a call with more runs F.linear (kMaxRows in row_gemv.cpp)


# per instruction set the kernel is built for (row_gemv.cpp): the capability flags it needs and its compiler flags
_ISAS = {
    "avx512_bf16": (("avx512_f", "avx512_bw", "avx512_bf16"), ("-mavx512f", "-mavx512bw", "-mavx512bf16")),
    "avx512": (("avx512_f", "avx512_bw"), ("-mavx512f", "-mavx512bw")),
    "avx2": (("avx2", "fma3"), ("-mavx2", "-mfma")),
}


def runnable() -> list[str]:
    """The instruction sets of `_ISAS` this CPU runs, best first (none on non-x86 CPUs)."""
    # the machine's own flags, read where tests that play other CPUs (monkeypatching torch.cpu) do not reach
    probe = getattr(torch._C._cpu, "_get_cpu_capability", None)
    flags = probe() if probe is not None else {}
    return [name for name, (needs, _) in _ISAS.items() if all(flags.get(f) for f in needs)]


@functools.cache
def isa() -> str | None:
    """The instruction set eyas::row_gemv is built for on this CPU (the best it runs), None where it runs none."""
    return next(iter(runnable()), None)


def build(name: str, source: Path, directory: Path) -> str:
    """Build (or load, where built) the kernels of `source` for this CPU's instruction set (`isa()`) as library
    `name` in `directory`, registering the ops it defines; returns the library's path."""
    from torch.utils import cpp_extension

    return cpp_extension.load(name, [str(source)], build_directory=str(directory), is_python_module=False,
                       extra_cflags=["-O3", "-fopenmp", *_ISAS[isa()][1]], extra_ldflags=["-fopenmp"])


def build_directory() -> Path:
    """Where the kernel for this CPU's instruction set (`isa()`) is built and cached (under TORCH_EXTENSIONS_DIR where
    set, as torch's own extensions are): one build per instruction set (a build directory shared by machines of other
    CPUs must not hand one a kernel its CPU cannot run), torch release (a cached library links against the torch that
    built it) and Python."""
    from torch.utils import cpp_extension

    name = f"eyas_row_gemv_{isa()}_" + re.sub(r"\W", "_", torch.__version__)
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()  # as torch's loader
    return Path(root) / "eyas" / f"{name}_{python}"


@functools.cache
def available() -> bool:
    """Whether eyas::row_gemv runs here: a CPU with one of its instruction sets, and the kernel built for it (on the
    first call)."""
    if isa() is None:
        return False
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    # torch's loader waits for a build directory's lock without end, and a process killed while it built (a build
    # takes ~10-60 s) leaves one. eyas's own loads take turns on a lock the system drops when its holder dies, so a
    # build lock found while holding it is left by a process that died building.
    with open(directory / "eyas.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # dropped when the file closes, or by the system if this process dies
        lock = directory / "lock"
        if lock.exists():
            logger.warning("removing %s, left by a build of eyas's kernels that did not finish", lock)
            lock.unlink(missing_ok=True)
        logger.info("loading eyas's row kernel for %s (built once per machine, instruction set, torch release and "
                    "source, ~10 s)", isa())
        try:
            library = build(directory.name, SOURCE, directory)
            # its C entry points (C_SHIMS) visible to the libraries inductor builds for compiled steps, which call them
            ctypes.CDLL(library, mode=os.RTLD_GLOBAL)
        except Exception as e:  # no compiler or ninja, a failed build: torch's products stay
            logger.warning("eyas's row kernel is not available (%s); steps use torch's products",
                           str(e).splitlines()[0] if str(e) else type(e).__name__)
            return False
    torch.library.register_fake("eyas::row_gemv")(_row_gemv_shape)
    torch.library.register_fake("eyas::row_gemv_at")(_row_gemv_at_shape)
    torch.library.register_fake("eyas::attend")(_attend_shape)
    return True


# The kernels' C entry points (row_gemv.cpp), by op: inductor's C++ wrapper calls an op listed in its
# aot_inductor.custom_ops_to_c_shims as this C function rather than through the dispatcher's boxed call.
C_SHIMS = {
    "row_gemv": "AOTITorchError aoti_torch_cpu_row_gemv(AtenTensorHandle x, const AtenTensorHandle* weights, "
                "int64_t count, AtenTensorHandle* out)",
    "row_gemv_at": "AOTITorchError aoti_torch_cpu_row_gemv_at(AtenTensorHandle x, AtenTensorHandle arena, "
                   "const int64_t* offsets, int64_t offsets_len, const int64_t* rows, int64_t rows_len, "
                   "AtenTensorHandle* out)",
    "attend": "AOTITorchError aoti_torch_cpu_attend(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, "
              "AtenTensorHandle* mask, double scale, int64_t most_rows, AtenTensorHandle* out)",
}


def c_shims() -> dict:
    """inductor's `aot_inductor.custom_ops_to_c_shims` for eyas's ops; empty where the kernel is not `available()`."""
    if not available():
        return {}
    # inductor's cache of compiled graphs keys each graph by its settings, pickled; an op overload (this setting's keys)
    # does not pickle, which made every compiled step bypass the cache and compile anew in each process (~35 s a kind
    # of step for SmolLM2-135M). Pickled by name, a process compiles a step once per machine.
    copyreg.pickle(torch._ops.OpOverload, _pickle_overload)
    return {getattr(torch.ops.eyas, op).default: [shim] for op, shim in C_SHIMS.items()}


def _pickle_overload(op: torch._ops.OpOverload) -> tuple:
    return _overload, (op._schema.name, op._overloadname)


def _overload(name: str, overload: str) -> torch._ops.OpOverload:
    """The op overload `overload` ("" for the default) of op `name` ("namespace::op")."""
    namespace, op = name.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


def _row_gemv_shape(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def _row_gemv_at_shape(x: torch.Tensor, arena: torch.Tensor, offsets: Sequence[int], rows: Sequence[int]
                       ) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(rows)))


def row_gemv(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """x [..., K] holding M rows (past MAX_ROWS F.linear computes them), weights [N_i, K] contiguous in x's dtype (one
    of DTYPES) -> [..., sum N_i]: x times each weight, in order (what `torch.cat([F.linear(x, w) for w in weights], -1)`
    computes, accumulated in fp32). Needs `available()`."""
    return torch.ops.eyas.row_gemv(x, list(weights))


def row_gemv_at(x: torch.Tensor, arena: torch.Tensor, offsets: Sequence[int], rows: Sequence[int]) -> torch.Tensor:
    """`row_gemv` of weights given by where they lie in `arena` (a 1-D uint8 tensor: the buffer an arranged model's
    weights live in, weight_arena.py): weight i is [rows[i], K] in x's dtype from byte offsets[i] on. A compiled step
    takes the arena as one tensor instead of a tensor per weight. Needs `available()`."""
    return torch.ops.eyas.row_gemv_at(x, arena, list(offsets), list(rows))


def _attend_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float, most_rows: int = -1) -> torch.Tensor:
    b, h, t, d = q.shape
    return q.new_empty((b, t, h, d)).transpose(1, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           most_rows: int = -1) -> torch.Tensor:
    """The attention of q [B, H, T, D] over k, v [B, G, S, D] (H a multiple of G), an additive or boolean mask None or
    [B|1, H|1, T, S], scores scaled by `scale` -> [B, H, T, D] in q's dtype (laid out [B, T, H, D]), computed in fp32
    reading the keys and values in place (row_gemv.cpp). More than `most_rows` query rows (where that is not -1) take
    torch's CPU flash attention of the same arguments instead (a graph whose row count varies, past the rows the kernel
    is the faster attention of). Needs `available()`."""
    return torch.ops.eyas.attend(q, k, v, mask, scale, most_rows)


ATTEND_MAX_VECTORS = 16  # the widest head eyas::attend takes, in vector registers (kMaxVectors in row_gemv.cpp)


def attend_takes(head_dim: int) -> bool:
    """Whether eyas::attend takes heads of this size on this CPU: whole vector registers of fp32 (16 lanes with
    AVX-512, 8 with AVX2), at most ATTEND_MAX_VECTORS of them."""
    lanes = 8 if isa() == "avx2" else 16
    return isa() is not None and head_dim % lanes == 0 and 0 < head_dim // lanes <= ATTEND_MAX_VECTORS


def one_row(dtype: torch.dtype, rows: int | None) -> bool:
    """The products `rewrite_products` gives the kernel by default: those of one row."""
    return rows == 1


def _product(node: fx.Node, takes: Callable[[torch.dtype, int | None], bool]
             ) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """(x, weight, bias) of a graph node computing rows times a transposed [N, K] weight of the same dtype, one of
    DTYPES (`mm(x [M, K], permute(w))`, `addmm(bias, x, permute(w))`), the form a linear layer takes in an aten
    graph, where takes(dtype, M) holds (M None: a row count the graph leaves to run time); else None."""
    if node.target is _aten.mm.default:
        (x, wt), bias = node.args, None
    elif node.target is _aten.addmm.default and not node.kwargs:
        bias, x, wt = node.args
    else:
        return None
    if not (isinstance(x, fx.Node) and isinstance(wt, fx.Node) and wt.target in (_aten.permute.default, _aten.t.default)
            and (wt.target is _aten.t.default or list(wt.args[1]) == [1, 0])):
        return None
    weight = wt.args[0]
    # weights (and biases) the graph takes as inputs: the parameters, which freezing makes constants
    if not all(isinstance(n, fx.Node) and n.op == "placeholder" for n in (weight, bias or weight)):
        return None
    xv, wv = x.meta.get("val"), weight.meta.get("val")
    if xv is None or wv is None:
        return None
    if not (xv.dim() == 2 and wv.dim() == 2 and all(isinstance(s, int) for s in (xv.shape[1], *wv.shape))):
        return None
    rows = xv.shape[0] if isinstance(xv.shape[0], int) else None
    if not (xv.dtype in DTYPES and wv.dtype == xv.dtype and xv.device.type == "cpu" and wv.is_contiguous()
            and (rows is None or 1 <= rows <= MAX_ROWS) and takes(xv.dtype, rows)):
        return None
    return x, weight, bias


def _viewed(node: fx.Node) -> fx.Node:
    """The node whose data `node` views through reshapes (each linear layer reshapes its input itself)."""
    while node.op == "call_function" and node.target in VIEWS:
        node = node.args[0]
    return node


VIEWS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)  # the aten ops of a reshape


Locate = Callable[[Sequence[torch.Tensor]], "tuple[torch.Tensor, list[int]] | None"]


def rewrite_products(graph: fx.Graph, takes: Callable[[torch.dtype, int | None], bool] = one_row,
                     locate: Locate | None = None) -> int:
    """Replace the graph's products of M rows by eyas::row_gemv where takes(dtype, M) holds (M up to MAX_ROWS, or None
    where the graph leaves the row count to run time), one call per input shared by several products (its output sliced
    per product, a bias added after); returns how many products it replaced. Run before inductor freezes the weights: a
    product there still reads its weight as an input.
    locate(weights) -> (arena, byte offsets) or None: where the graph is compiled with frozen weights, products whose
    weights all lie in one buffer (weight_arena.arena_of) take them as eyas::row_gemv_at of that buffer, so the graph
    holds one constant for all of them instead of one per weight."""
    groups: dict[fx.Node, list] = defaultdict(list)  # by the tensor each product's row is a view of
    for node in graph.nodes:
        if node.op == "call_function" and (found := _product(node, takes)) is not None:
            groups[_viewed(found[0])].append((node, *found))
    if not groups or not available():
        return 0
    fake_mode = torch._guards.detect_fake_mode([products[0][1].meta["val"] for products in groups.values()])
    held = _frozen_weights(graph) if locate is not None else {}
    arenas: dict[int, fx.Node] = {}  # by the arena's id: its node in the graph
    replaced = 0
    for products in groups.values():
        x = products[0][1]  # each product's own view of the rows: any of them reads the same data
        weights = [weight for _, _, weight, _ in products]
        rows = [w.meta["val"].shape[0] for w in weights]
        found = locate([held[w] for w in weights]) if all(w in held for w in weights) else None
        with graph.inserting_before(products[0][0]), fake_mode:
            if found is None:
                y = graph.call_function(torch.ops.eyas.row_gemv.default, (x, weights))
                y.meta["val"] = row_gemv(x.meta["val"], [w.meta["val"] for w in weights])
            else:
                arena, offsets = found
                held_in = _arena_node(graph, arena, arenas, fake_mode)
                y = graph.call_function(torch.ops.eyas.row_gemv_at.default, (x, held_in, offsets, rows))
                y.meta["val"] = row_gemv_at(x.meta["val"], held_in.meta["val"], offsets, rows)
            start = 0
            for (node, _, _, bias), n in zip(products, rows):
                out = graph.call_function(_aten.slice.Tensor, (y, 1, start, start + n))
                out.meta["val"] = y.meta["val"][:, start:start + n]
                if bias is not None:
                    out_val = out.meta["val"] + bias.meta["val"]
                    out = graph.call_function(_aten.add.Tensor, (out, bias))
                    out.meta["val"] = out_val
                node.replace_all_uses_with(out)
                start += n
        for node, *_ in products:  # after the insertions, which go before the first of them
            graph.erase_node(node)
        replaced += len(products)
    graph.eliminate_dead_code()
    return replaced


def _frozen_weights(graph: fx.Graph) -> dict[fx.Node, torch.Tensor]:
    """The graph's inputs that inductor's freezing makes constants, by node: the parameters (the first inputs of a graph
    being compiled with freezing on, the tracing context holding their values); empty where it does not freeze."""
    from torch._inductor import config

    context = torch._guards.TracingContext.try_get()
    params = getattr(context, "params_flat_unwrap_subclasses", None) if context is not None else None
    if not (config.freezing and params and graph.owning_module is not None):
        return {}
    return dict(zip(graph.find_nodes(op="placeholder"), params))


def _arena_node(graph: fx.Graph, arena: torch.Tensor, nodes: dict[int, fx.Node], fake_mode) -> fx.Node:
    """The graph's node reading `arena`, as an attribute of the graph's module (one per arena)."""
    if id(arena) not in nodes:
        name = f"_eyas_weights_{len(nodes)}"
        # a plain attribute, as freezing holds its constants: a buffer's name would enter a set, whose order varies by
        # process, and give the graph another cache key in about every other process
        setattr(graph.owning_module, name, arena)
        # inductor's mark of a frozen weight: its cache of compiled graphs takes such a constant from the module it
        # compiles, by name, rather than storing a copy of it (the whole model's weights) with each graph
        arena._is_frozen_param = True
        with graph.inserting_before(next(iter(graph.nodes))):
            node = graph.create_node("get_attr", name)
        node.meta["val"] = fake_mode.from_tensor(arena, static_shapes=True)
        nodes[id(arena)] = node
    return nodes[id(arena)]
