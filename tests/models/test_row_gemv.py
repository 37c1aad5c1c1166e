"""eyas's one-row kernel (models/row_gemv.py): what it computes, and the graph pass that hands it a compiled
step's one-row products. The kernel runs on x86 CPUs with AVX2 or better (built for the best instruction set the CPU
has); elsewhere those tests skip and the pass must leave every graph as it is."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from eyas.models import row_gemv

needs_kernel = pytest.mark.skipif(not row_gemv.available(), reason="eyas::row_gemv needs an x86 CPU with AVX2")


def _reference(x: torch.Tensor, weights) -> torch.Tensor:
    return torch.cat([x.float() @ w.float().T for w in weights], -1)


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal up to the rounding of the result in `dtype` (the sums are fp32 in another order than torch's)."""
    eps = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=eps * float(want.abs().max()))


@needs_kernel
@pytest.mark.parametrize("dtype", row_gemv.DTYPES)
@pytest.mark.parametrize("k", [576, 40, 1000, 31])  # a multiple of every step's width, and tails of each length class
@pytest.mark.parametrize("rows", [(7, 192, 1, 33), (1500, 3, 700)])  # a few rows a thread; many, over both threads
# a step's row; a verify's few, in every mix of the kernel's blocks of rows (4, 2, 1); more than it takes
@pytest.mark.parametrize("inputs", [1, 3, 7, row_gemv.MAX_ROWS, row_gemv.MAX_ROWS + 1])
def test_row_gemv_equals_the_products_it_replaces(k, dtype, rows, inputs):
    gen = torch.Generator().manual_seed(k)
    weights = [torch.randn(n, k, generator=gen).to(dtype) for n in rows]
    x = torch.randn(1, inputs, k, generator=gen).to(dtype)
    y = row_gemv.row_gemv(x, weights)
    _assert_close(y, _reference(x, weights), dtype)
    # a weight's rows land in its own columns, in order, whichever streams read them
    _assert_close(row_gemv.row_gemv(x, weights[1:2]), y[..., rows[0]:rows[0] + rows[1]], dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", row_gemv.DTYPES)
def test_a_rows_products_are_the_same_among_any_other_rows(dtype):
    """The kernel takes a verify's rows in blocks that share each load of a weight vector, and computes each output by
    the same FMAs in the same order whatever block its row is in: a row's products among any others are the ones it
    gets alone (a plain step's), bit for bit."""
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(n, 1000, generator=gen).to(dtype) for n in (7, 1500)]
    x = torch.randn(row_gemv.MAX_ROWS, 1000, generator=gen).to(dtype)
    alone = torch.cat([row_gemv.row_gemv(x[i:i + 1], weights) for i in range(len(x))])
    for n in (2, 3, 5, 6, 8, 13, row_gemv.MAX_ROWS):
        assert torch.equal(row_gemv.row_gemv(x[:n], weights), alone[:n]), n


@needs_kernel
@pytest.mark.parametrize("dtype", row_gemv.DTYPES)
def test_threads_that_take_each_others_rows_compute_every_row_once(dtype):
    """A thread done with its share of the rows takes the back half of what another has left. More threads than cores
    are descheduled mid-share, so shares are taken from often; every output must still be computed, once, with the
    sums one thread gets (each call's input new, so a row left out would hold the last call's output)."""
    gen = torch.Generator().manual_seed(2)
    weights = [torch.randn(n, 1000, generator=gen).to(dtype) for n in (5, 2100, 900)]
    inputs = [torch.randn(rows, 1000, generator=gen).to(dtype) for rows in (1, 3, 1, 4, 1) * 8]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = [row_gemv.row_gemv(x, weights) for x in inputs]
        for threads in (2, 3, 8):
            torch.set_num_threads(threads)
            for x, y in zip(inputs, want):
                assert torch.equal(row_gemv.row_gemv(x, weights), y), threads
    finally:
        torch.set_num_threads(before)


# each build in its own process: a process loads one build of the kernel's op library
_EVERY_BUILD = """
import sys, torch
from eyas.models import row_gemv
row_gemv.isa = lambda: sys.argv[1]
assert row_gemv.available()
gen = torch.Generator().manual_seed(0)
for dtype, eps in ((torch.bfloat16, 2 ** -7), (torch.float32, 1e-5)):
    for k in (576, 31, 1000):
        weights = [torch.randn(n, k, generator=gen).to(dtype) for n in (3, 64, 900)]
        x = torch.randn(7, k, generator=gen).to(dtype)  # blocks of 4, 2 and 1 rows
        want = torch.cat([x.float() @ w.float().T for w in weights], -1)
        torch.testing.assert_close(row_gemv.row_gemv(x, weights).float(), want, rtol=eps,
                                   atol=eps * float(want.abs().max()))
    q, k, v = (torch.randn(s, generator=gen).to(dtype) for s in ((1, 4, 2, 64), (1, 2, 50, 64), (1, 2, 50, 64)))
    mask = torch.zeros(1, 1, 2, 50).masked_fill(torch.rand(1, 1, 2, 50, generator=gen) > 0.8, float("-inf"))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), attn_mask=mask.double(),
        scale=0.2)
    got = row_gemv.attend(q, k, v, mask, 0.2)
    torch.testing.assert_close(got.double(), want, rtol=eps, atol=eps * float(want.abs().max()))
"""


@needs_kernel
@pytest.mark.parametrize("isa", list(row_gemv._ISAS))
def test_every_build_this_cpu_runs_computes_the_products(isa):
    """The kernels' builds for the instruction sets below the CPU's best (what other machines run) compute the same
    products and attention: a CPU with AVX512-BF16 checks all three."""
    if isa not in row_gemv.runnable():
        pytest.skip(f"this CPU lacks {isa}")
    run = subprocess.run([sys.executable, "-c", _EVERY_BUILD, isa], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]


_STALE_LOCK = """
from eyas.models import row_gemv
lock = row_gemv.build_directory() / "lock"
lock.parent.mkdir(parents=True)
lock.touch()
assert row_gemv.available()
"""


@needs_kernel
def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_start(tmp_path):
    """torch's loader waits for a build directory's lock forever; a lock no live eyas build holds is debris, however
    fresh, and eyas removes it."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", _STALE_LOCK], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and "removing" in run.stderr, run.stderr[-2000:]


@needs_kernel
@pytest.mark.parametrize("dtype", row_gemv.DTYPES)
@pytest.mark.parametrize("inputs", [1, 3, row_gemv.MAX_ROWS + 1])
def test_row_gemv_at_reads_each_weight_where_it_lies_in_the_buffer(dtype, inputs):
    """Weights given as byte offsets into one buffer (as a model's weights lie in weight_arena's) give the products of
    the same weights given as tensors, bit for bit, whatever lies between them and in whichever order they lie."""
    gen = torch.Generator().manual_seed(inputs)
    k, rows = 40, (7, 192, 33)
    weights = [torch.randn(n, k, generator=gen).to(dtype) for n in rows]
    arena = torch.randint(0, 256, (100_000,), dtype=torch.uint8, generator=gen)  # noise around the weights
    offsets = [70_000, 448, 40_064]  # out of order, apart, not all on cache lines
    for w, at in zip(weights, offsets):
        arena[at:at + w.nbytes].view(dtype).copy_(w.flatten())
    x = torch.randn(1, inputs, k, generator=gen).to(dtype)
    assert torch.equal(row_gemv.row_gemv_at(x, arena, offsets, rows), row_gemv.row_gemv(x, weights))
    assert torch.equal(row_gemv.row_gemv_at(x, arena, offsets[1:2], rows[1:2]), row_gemv.row_gemv(x, weights[1:2]))


@needs_kernel
def test_row_gemv_at_rejects_weights_outside_the_buffer():
    x, arena = torch.randn(1, 64).bfloat16(), torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="does not lie in the arena"):
        row_gemv.row_gemv_at(x, arena, [4096 - 64], [8])
    with pytest.raises(RuntimeError, match="one offset and one row count per weight"):
        row_gemv.row_gemv_at(x, arena, [0, 128], [1])
    with pytest.raises(RuntimeError, match="1-D uint8"):
        row_gemv.row_gemv_at(x, arena.view(torch.bfloat16), [0], [1])


@needs_kernel
def test_row_gemv_rejects_what_it_cannot_compute():
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="at least one row"):
        row_gemv.row_gemv(x[:0], [torch.randn(8, 64).bfloat16()])
    with pytest.raises(RuntimeError, match="contiguous"):
        row_gemv.row_gemv(x[:1], [torch.randn(64, 8).bfloat16().T])
    with pytest.raises(RuntimeError, match="x's dtype"):
        row_gemv.row_gemv(x[:1], [torch.randn(8, 64)])
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        row_gemv.row_gemv(x[:1].half(), [torch.randn(8, 64).half()])


def _layer(x, w_q, w_k, w_o, bias):
    """Two products of one row (one with a bias) and a third of another: a layer's shape in miniature."""
    h = F.linear(x, w_q) + F.linear(x, w_k, bias)
    return F.linear(torch.tanh(h), w_o)


def _traced(dtype: torch.dtype, rows: int):
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(rows, 64, generator=gen), torch.randn(48, 64, generator=gen),
            torch.randn(48, 64, generator=gen), torch.randn(24, 48, generator=gen), torch.randn(48, generator=gen)]
    args = [a.to(dtype) for a in args]
    return make_fx(_layer, tracing_mode="fake")(*args), args


def _products(gm) -> int:
    return sum(n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) for n in gm.graph.nodes)


@needs_kernel
@pytest.mark.parametrize("dtype", row_gemv.DTYPES)
def test_pass_rewrites_one_row_products_one_call_per_shared_input(dtype):
    gm, args = _traced(dtype, rows=1)
    want = _layer(*args)
    assert _products(gm) == 3
    assert row_gemv.rewrite_products(gm.graph) == 3
    gm.recompile()
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.eyas.row_gemv.default]
    assert _products(gm) == 0 and len(calls) == 2  # x's two products in one call, tanh(h)'s in another
    _assert_close(gm(*args), want, dtype)


@pytest.mark.parametrize("dtype,rows", [(torch.float16, 1), (torch.bfloat16, 3), (torch.float32, 3)])
def test_pass_leaves_other_products_alone(dtype, rows):
    """Products of several rows (a verify's), and of dtypes the kernel does not take, keep torch's kernels, on every
    CPU."""
    gm, _ = _traced(dtype, rows)
    assert row_gemv.rewrite_products(gm.graph) == 0
    assert _products(gm) == 3


@needs_kernel
@pytest.mark.parametrize("dtype", row_gemv.DTYPES)
def test_pass_rewrites_the_row_counts_it_is_told_to(dtype):
    """A verify's few rows go to the kernel where the caller's rule takes them (cpu_kernels.row_kernel_takes), with the
    products' results; other row counts stay with torch."""
    gm, args = _traced(dtype, rows=3)
    want = _layer(*args)
    assert row_gemv.rewrite_products(gm.graph, lambda dtype, rows: rows == 2) == 0
    assert row_gemv.rewrite_products(gm.graph, lambda dtype, rows: rows == 3) == 3
    gm.recompile()
    assert _products(gm) == 0
    _assert_close(gm(*args), want, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", row_gemv.DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("mask_kind", ["none", "additive", "bool", "per_head"])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (4, 4)])
def test_attend_equals_attention_over_cache_slices(dtype, head_dim, rows, mask_kind, heads, kv_heads):
    """eyas::attend over a slice of a wider cache (keys and values strided, as a step reads them), one or two
    sequences, GQA groups of 3 and 8 query heads and plain multi-head attention, a mask per sequence or per head (a row
    that sees nothing gives zeros, one that sees only the last keys), against fp64 attention. One sequence of 3
    key/value heads on 2 threads splits each head's keys in chunks (merged after)."""
    if not row_gemv.attend_takes(head_dim):
        pytest.skip(f"heads of {head_dim} are not whole vector registers here")
    gen = torch.Generator().manual_seed(head_dim + rows + heads)
    group = heads // kv_heads
    batch = 1 if rows == 1 else 2
    q = torch.randn(batch, heads, rows, head_dim, generator=gen).to(dtype)
    cache = torch.randn(2, batch, kv_heads, 90, head_dim, generator=gen).to(dtype)  # [k|v, B, G, capacity, D]
    k, v = cache[0, :, :, :75], cache[1, :, :, :75]
    seen = torch.rand(batch, heads if mask_kind == "per_head" else 1, rows, 75, generator=gen) > 0.3
    seen[0, 0, 0] = torch.arange(75) >= 60  # a row that sees only the last keys
    if batch * rows > 1:
        seen[-1, 0, -1] = False  # one that sees none
    additive = torch.zeros(seen.shape).masked_fill(~seen, float("-inf")).to(dtype)
    mask = {"none": None, "bool": seen, "additive": additive, "per_head": additive}[mask_kind]
    got = row_gemv.attend(q, k, v, mask, 0.3)
    scores = 0.3 * q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2)
    if mask is not None:
        scores = scores.masked_fill(~seen, float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)  # no key seen: zeros
    want = weights @ v.double().repeat_interleave(group, 1)
    assert got.stride() == got.transpose(1, 2).contiguous().transpose(1, 2).stride()  # laid out [B, T, H, D]
    _assert_close(got, want, dtype)



@needs_kernel
@pytest.mark.parametrize("dtype", row_gemv.DTYPES)
@pytest.mark.parametrize("mask_kind", ["none", "additive", "bool"])
def test_attend_hands_more_rows_than_it_is_told_to_torchs_attention(dtype, mask_kind):
    """A graph whose row count varies calls eyas::attend with the most rows it is the faster attention of: more rows
    run torch's CPU flash attention of the same arguments (its output exactly, laid out as the kernel's); as many, the
    kernel."""
    if not row_gemv.attend_takes(64):
        pytest.skip("heads of 64 are not whole vector registers here")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, generator=gen).to(dtype) for s in ((1, 6, 5, 64), (1, 2, 40, 64), (1, 2, 40, 64)))
    seen = torch.rand(1, 1, 5, 40, generator=gen) > 0.3
    mask = {"none": None, "bool": seen,
            "additive": torch.zeros(seen.shape).masked_fill(~seen, float("-inf")).to(dtype)}[mask_kind]
    additive = mask if mask_kind != "bool" else torch.zeros(seen.shape).masked_fill(~seen, float("-inf")).to(dtype)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=additive,
                                                                       scale=0.3)[0]
    handed, kernel = (row_gemv.attend(q, k, v, mask, 0.3, most_rows=most) for most in (4, 5))
    assert torch.equal(handed, flash) and handed.stride() == kernel.stride()  # the layout the graph was told of
    assert torch.equal(kernel, row_gemv.attend(q, k, v, mask, 0.3))
    _assert_close(kernel, flash, dtype)

def _shim(op: str, *argtypes):
    """The C function inductor's C++ wrapper calls for `op` (row_gemv.C_SHIMS), looked up among the process's global
    symbols, as the libraries inductor builds find it."""
    import ctypes

    fn = getattr(ctypes.CDLL(None), f"aoti_torch_cpu_{op}")
    fn.argtypes, fn.restype = argtypes, ctypes.c_int32
    return fn


@needs_kernel
@pytest.mark.parametrize("dtype", row_gemv.DTYPES)
def test_c_entry_points_compute_what_the_ops_compute(dtype):
    """The C functions a compiled step calls instead of the dispatched ops take their tensors as handles and compute
    what the ops compute (the same kernels: bit for bit), with and without a mask; a bad input comes back as an error
    code, not a crash."""
    import ctypes

    api = ctypes.pythonapi
    api.PyCapsule_GetPointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_New.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    api.PyCapsule_New.restype = ctypes.py_object

    def handles(ts):  # new handles (at::Tensor*) to ts, as inductor passes them
        return [api.PyCapsule_GetPointer(c, None) for c in torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(ts)]

    def tensors(hs):  # the tensors of handles a function returned, taking them over
        return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs([api.PyCapsule_New(h, None, None) for h in hs])

    ptr, ptrs = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 576, generator=gen).to(dtype)
    weights = [torch.randn(n, 576, generator=gen).to(dtype) for n in (192, 64)]
    gemv = _shim("row_gemv", ptr, ptrs, ctypes.c_int64, ptrs)
    x_h, *w_h = handles([x, *weights])
    out = ptr()
    assert gemv(x_h, (ctypes.c_void_p * 2)(*w_h), 2, ctypes.byref(out)) == 0
    assert torch.equal(tensors([out.value])[0], row_gemv.row_gemv(x, weights))
    assert gemv(x_h, (ctypes.c_void_p * 1)(handles([weights[0][:, :100].contiguous()])[0]), 1, ctypes.byref(out)) != 0

    q = torch.randn(1, 6, 1, 64, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, 40, 64, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(1, 1, 1, 40, generator=gen) > 0.5
    attend = _shim("attend", ptr, ptr, ptr, ptrs, ctypes.c_double, ctypes.c_int64, ptrs)
    for m, most in ((None, -1), (mask, -1), (mask, 0)):  # 0: handed to torch's attention
        q_h, k_h, v_h, *m_h = handles([q, k, v, *([] if m is None else [m])])
        masked = ctypes.byref(ctypes.c_void_p(m_h[0])) if m_h else None
        assert attend(q_h, k_h, v_h, masked, 0.125, most, ctypes.byref(out)) == 0
        assert torch.equal(tensors([out.value])[0], row_gemv.attend(q, k, v, m, 0.125, most))
        tensors([q_h, k_h, v_h, *m_h])
    tensors([x_h, *w_h])
