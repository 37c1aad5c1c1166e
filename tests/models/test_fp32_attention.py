"""bf16 attention runs in fp32 on CPUs without bf16 units (`cpu_kernels.attends_in_fp32`), where torch's bf16
attention emulates bf16 products: in an eager forward (`_sdpa`) and in a compiled step's graph (the step pass). Each
test plays both kinds of CPU; the results are held to an fp64 reference or to the model's own forward up to bf16
rounding."""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from eyas.models import Target, cpu_kernels, row_gemv
from eyas.models.step_pass import step_pass
from tests.helpers.machine import skip_unless_runs_bf16_units
from tests.helpers.tiny import tiny_target

NATIVE = {"avx2": True, "avx512_bf16": True, "amx_bf16": True}
VECTOR_BF16 = {"avx2": True, "avx512_bf16": True}  # bf16 units without AMX tiles: eyas's kernel takes more rows
EMULATED = {"avx2": True}
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


@pytest.fixture
def cpu(monkeypatch, request):
    """Play a CPU with the given capabilities (native bf16 is read once per process: cleared before and after)."""
    def play(capabilities: dict) -> None:
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
        cpu_kernels.native_bf16.cache_clear()

    request.addfinalizer(cpu_kernels.native_bf16.cache_clear)
    return play


def _attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)


def _inputs(dtype: torch.dtype, rows: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 4, rows, 16), (1, 2, 40, 16), (1, 2, 40, 16), (1, 1, rows, 40)]  # GQA, an additive mask
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


@pytest.mark.parametrize("capabilities", [EMULATED, VECTOR_BF16, NATIVE],
                         ids=["emulated-bf16", "avx512-bf16", "native-bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 8, 20])
def test_graph_attention_of_few_rows_runs_eyas_kernel_and_other_bf16_runs_in_fp32_without_bf16_units(
        cpu, capabilities, dtype, rows):
    """A graph's attention: a few query rows through eyas's kernel (fp32 and bf16, bf16 units or not), other bf16
    attention in fp32 without bf16 units, the rest as it was; every result that of an fp64 reference."""
    cpu(capabilities)
    args = _inputs(dtype, rows)
    gm = make_fx(_attention, tracing_mode="fake")(*args)
    rewrites = cpu_kernels.rewrite_attention(gm.graph)
    gm.graph.lint()
    gm.recompile()
    emulated = dtype == torch.bfloat16 and capabilities is EMULATED
    kernel = rows <= cpu_kernels.attention_rows() and row_gemv.available()
    assert rewrites == int(kernel or emulated)
    flash = [n for n in gm.graph.nodes if n.target is _FLASH]
    ours = [n for n in gm.graph.nodes if n.target is torch.ops.eyas.attend.default] if kernel else []
    assert (len(flash), len(ours)) == ((0, 1) if kernel else (1, 0))
    if not kernel:
        ran_in = {a.meta["val"].dtype for a in flash[0].args[:3]} | {flash[0].kwargs["attn_mask"].meta["val"].dtype}
        assert ran_in == {torch.float32 if emulated else dtype}
    got, want = gm(*args), _attention(*[a.double() for a in args])
    assert got.dtype == dtype and got.shape == want.shape
    eps = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=eps, atol=eps * float(want.abs().max()))


def _repeated_attention(q, k, v, mask):
    """Attention as transformers' sdpa path runs it with a mask: each key/value head repeated per query head first."""
    def repeat(x):
        b, g, s, d = x.shape
        return x[:, :, None].expand(b, g, q.shape[1] // g, s, d).reshape(b, q.shape[1], s, d)

    return F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=mask, scale=0.25)


@pytest.mark.skipif(not row_gemv.available(), reason="eyas::attend needs an x86 CPU with AVX2")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graph_attention_reads_repeated_key_value_heads_once(cpu, dtype):
    """Where the model repeated each key/value head per query head before its attention, eyas's kernel takes the
    heads unrepeated (it reads each once for its query heads) and the repeated copy is left to nothing; the result is
    that of an fp64 reference."""
    cpu(NATIVE)
    args = _inputs(dtype)
    gm = make_fx(_repeated_attention, tracing_mode="fake")(*args)
    assert cpu_kernels.rewrite_attention(gm.graph) == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    ours = [n for n in gm.graph.nodes if n.target is torch.ops.eyas.attend.default]
    assert [tuple(a.meta["val"].shape) for a in ours[0].args[1:3]] == [tuple(args[1].shape)] * 2
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
    got, want = gm(*args), _attention(*[a.double() for a in args])
    eps = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=eps, atol=eps * float(want.abs().max()))


@pytest.mark.parametrize("capabilities", [EMULATED, NATIVE], ids=["emulated-bf16", "native-bf16"])
def test_eager_bf16_attention_runs_in_fp32_without_bf16_units(cpu, monkeypatch, capabilities):
    """A prefill, a plain step and a masked verify of a bf16 target: attention in fp32 only where the CPU has no bf16
    units, and the logits those of the model's own forward up to bf16 rounding."""
    cpu(capabilities)
    skip_unless_runs_bf16_units()
    target = tiny_target("llama", dtype=torch.bfloat16)
    plain = Target(target.model, target.tokenizer, "as-is", cpu_kernels=False)
    for t in (target, plain):
        t.verify_mode()  # checked once per Target against the model's own forward (its own SDPA calls)
    seen = []  # the query dtype of every SDPA call
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append(q.dtype)
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    logits = []
    for t in (target, plain):
        cache = t.new_cache(1, 16)
        steps = [t(torch.tensor([[5, 9, 17, 30]]), cache=cache)]
        cache.commit([4])
        steps.append(t(torch.tensor([[41]]), cache=cache))
        cache.commit([1])
        steps.append(t(torch.tensor([[7, 8]]), torch.tensor([[5, 6]]), cache,
                       torch.ones(1, 2, 7, dtype=torch.bool).tril(5)))
        logits.append([s.logits.float() for s in steps])
        if t is target:
            ours, seen[:] = set(seen), []
    assert ours == {torch.float32 if capabilities is EMULATED else torch.bfloat16}
    assert set(seen) == {torch.bfloat16}  # the model's own attention
    for got, want in zip(*logits):
        torch.testing.assert_close(got, want, rtol=2 ** -5, atol=2 ** -5 * float(want.abs().max()))


def test_step_pass_keys_compiled_graphs_on_native_bf16(cpu):
    """A graph rewritten for a CPU without bf16 units is never taken from inductor's cache on one with them."""
    keys = []
    for capabilities in (EMULATED, NATIVE):
        cpu(capabilities)
        keys.append(step_pass().uuid())
    assert keys[0] != keys[1]
