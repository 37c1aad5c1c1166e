"""A Target with compiled decode steps (`compile=True`) computes what the eager one does: the same step logits and
features, greedy output token-identical to the model's own `generate` (fp32), samples from its distribution, and
no new graph once warm, whatever the context length or the tree size; with fixed shapes (a GPU's CUDA graphs) the
same, with one graph per size bucket. One compiled target for the module:
compiling costs seconds per graph even for a tiny model."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from eyas.inference import SpeculativeGenerator, TreeOptions
from eyas.inference.bench import plain_decode
from eyas.models import cpu_kernels, row_gemv, weight_arena
from eyas.models import target as target_module
from eyas.models.masks import after_history
from eyas.models.sampling import Sampling
from eyas.models.target import Target
from tests.helpers.families import family_target
from tests.helpers.inference import always_accept_first_child, assert_drafts_verified, greedy
from tests.helpers.tiny import tiny_target
from tests.inference.test_sampling import (
    PROMPT,
    SETTINGS,
    TREE,
    VOCAB,
    _setup,
    min_p_value,
    reference_samples,
    settings_of,
    speculative_samples,
)

PROMPTS = [PROMPT, [3, 4], [(7 * i) % 16 for i in range(13)]]


@pytest.fixture(scope="module")
def pair():
    """(eager, compiled, head): two Targets over one tiny model (the sampling tests' target, vocabulary 16)."""
    eager, head = _setup()
    compiled = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)
    return eager, compiled, head


def _steps(target: Target, layer_ids=(1, 3), logits: bool | torch.Tensor = True) -> list:
    """A prefill, a plain step and a three-node tree verify (root, two children): each step's logits (every
    position's, or at the positions `logits` gives: [1, K], the verify's from its last node back) and features."""
    cache = target.new_cache(1, 32)
    out = [target(torch.tensor([PROMPT]), cache=cache, layer_ids=layer_ids)]
    cache.commit([len(PROMPT)])
    out.append(target(torch.tensor([[11]]), cache=cache, layer_ids=layer_ids, logits=logits))
    cache.commit([1])
    n = len(PROMPT) + 1
    allowed = after_history(torch.tensor([n]), torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool),
                            n + 3)
    verified = logits if logits is True else 2 - logits
    out.append(target(torch.tensor([[12, 13, 14]]), torch.tensor([[n, n + 1, n + 1]]), cache, allowed,
                      layer_ids=layer_ids, logits=verified))
    return out


def test_compiled_steps_equal_eager_steps(pair):
    """Graphs traced without fused layers first (plain decoding), then steps that ask for some, then for others: each
    set of layers gets graphs whose captured states are the ones asked for."""
    eager, compiled, _ = pair
    _steps(compiled, layer_ids=())
    for layer_ids in ((1, 3), (2,), (3, 0)):
        for want, got in zip(_steps(eager, layer_ids), _steps(compiled, layer_ids)):
            torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.features, want.features, rtol=1e-5, atol=1e-5)


def test_compiled_plain_steps_record_the_positions_their_graphs_make(pair):
    """A compiled step of tokens that follow on from the cache makes their positions in its graph
    (KVCache.next_positions): the cache records them as an eager step does, after the pending entries too, for the
    masks of what follows (windows go by position)."""
    eager, compiled, _ = pair
    caches = []
    for target in (eager, compiled):
        cache = target.new_cache(1, 32)
        target(torch.tensor([PROMPT]), cache=cache, logits=False)
        cache.commit([len(PROMPT)])
        for token in (11, 12):  # the second after the first's pending entry
            target(torch.tensor([[token]]), cache=cache)
        cache.commit([2])
        caches.append(cache)
    width = len(PROMPT) + 2
    assert torch.equal(caches[1].key_positions(), torch.arange(width)[None])
    assert torch.equal(caches[1].positions, caches[0].positions)


def test_compiled_steps_run_only_over_caches_their_own_model_wrote(pair, monkeypatch):
    """A compiled step checks one key and one value buffer of the cache (`_frozen_module_guards`): the rest are laid
    out as its model's layers lay them out only where that model wrote them. A cache another model's forwards wrote
    (`KVCache.owner`) takes eager steps, with the eager logits; the target's own caches take compiled ones."""
    eager, compiled, _ = pair
    calls = []
    graph = compiled._compiled
    monkeypatch.setattr(compiled, "_compiled", lambda *a, **kw: calls.append(1) or graph(*a, **kw))
    for writer, expect in ((tiny_target("llama", vocab_size=VOCAB, seed=3), 0), (eager, 1)):
        cache = writer.new_cache(1, 32)
        writer(torch.tensor([PROMPT]), cache=cache, logits=False)
        cache.commit([len(PROMPT)])
        want = eager(torch.tensor([[11]]), cache=cache).logits
        cache.rollback()
        calls.clear()
        got = compiled(torch.tensor([[11]]), cache=cache).logits
        assert len(calls) == expect
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama-tied", "granite"])
def test_compiled_steps_compute_their_logits_in_the_graph_where_the_lm_head_alone_gives_them(family, monkeypatch):
    """A model whose logits are its lm_head's output gets them from its compiled steps' graphs, with no logits call
    after them; one whose forward scales them (Granite) from its forward, as an eager step does. Either way a plain
    step's and a verify's logits (at given positions and at every node) equal the eager steps'."""
    eager = family_target(family)
    compiled = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)
    compiled.verify_mode()  # its check, at the first verify, calls `logits`
    calls = []
    logits = compiled.logits
    monkeypatch.setattr(compiled, "logits", lambda hidden: calls.append(1) or logits(hidden))
    for picked in (torch.tensor([[0]]), True):
        calls.clear()
        for want, got in zip(_steps(eager, (1,), picked), _steps(compiled, (1,), picked)):
            torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        after_prefill = len(calls) - 1  # the prefill runs eager
        assert after_prefill == (0 if family == "llama-tied" else 2)


def test_compiled_targets_share_graphs_only_where_they_share_weights(pair):
    """Models of one class share dynamo's graphs per code; a frozen graph holds one model's weights, so a second model
    of the class (same shapes, other weights) runs graphs of its own, not the first one's, and two compiled Targets
    over one model share its graphs and read their own steps' features."""
    _, compiled, _ = pair
    _steps(compiled)
    other = tiny_target("llama", vocab_size=VOCAB, seed=1)
    want = _steps(other)
    for _ in range(2):
        got = _steps(Target(other.model, other.tokenizer, other.name_or_path, compile=True))
        for w, g in zip(want, got):
            torch.testing.assert_close(g.logits, w.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(g.features, w.features, rtol=1e-5, atol=1e-5)


def test_compiled_steps_keep_the_interpreter_state_guards_and_drop_the_library_globals(monkeypatch):
    """The guards a compiled step keeps (`_frozen_module_guards`), read on a real compile: none on library globals,
    but grad mode, the global state (autocast, ...) and the inputs' tensors stay guarded, so a call in another state
    or with other tensors compiles anew rather than running a graph traced for something else."""
    seen = []
    keeps = target_module._frozen_module_guards

    def recording(entries):
        keep = keeps(entries)
        seen.extend(zip(entries, keep))
        return keep

    monkeypatch.setattr(target_module, "_frozen_module_guards", recording)
    model = tiny_target("llama", vocab_size=VOCAB, seed=2)
    _steps(Target(model.model, model.tokenizer, model.name_or_path, compile=True))
    assert any(e.is_global for e, _ in seen), "the trace went through no global: nothing was tested"
    kept = {e.guard_type for e, keep in seen if keep}
    assert {"GRAD_MODE", "GLOBAL_STATE", "TENSOR_MATCH"} <= kept
    assert not any(keep and e.is_global for e, keep in seen)


def test_compiled_steps_trace_with_inductors_freezing_on_and_leave_it_as_they_found_it(monkeypatch):
    """Dynamo reads inductor's freezing switch as it traces (the weights become the graph's constants), so a compile
    that starts inside a compiled Target call turns it on: on while a step's graph compiles, after
    `torch._dynamo.reset()` too (which drops dynamo's compile callbacks), off after the call and for a compile of the
    user's own, and still on where the user had it on."""
    import torch._inductor.config as inductor

    during = []
    keeps = target_module._frozen_module_guards

    def recording(entries):  # runs as dynamo compiles a graph
        during.append(inductor.freezing)
        return keeps(entries)

    monkeypatch.setattr(target_module, "_frozen_module_guards", recording)
    model = tiny_target("llama", vocab_size=VOCAB, seed=3)
    compiled = Target(model.model, model.tokenizer, model.name_or_path, compile=True)
    assert inductor.freezing is False
    want = _steps(compiled)
    assert during and all(during)
    assert inductor.freezing is False

    seen = []

    def backend(gm, example_inputs):  # a compile outside any Target call
        seen.append(inductor.freezing)
        return gm.forward

    torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))
    assert seen == [False]

    torch._dynamo.reset()
    during.clear()
    again = _steps(compiled)
    assert during and all(during)
    assert inductor.freezing is False
    with inductor.patch(freezing=True):
        got = _steps(compiled)
        assert inductor.freezing is True
    for w, a, g in zip(want, again, got):
        torch.testing.assert_close(a.logits, w.logits, rtol=0, atol=0)
        torch.testing.assert_close(g.logits, w.logits, rtol=0, atol=0)


def test_compiled_greedy_is_token_identical_and_compiles_nothing_once_warm(pair):
    eager, compiled, head = pair

    def run(options: TreeOptions, prompts) -> list:
        gen = SpeculativeGenerator(compiled, head, options)
        results = []
        for prompt in prompts:
            results.append(gen.generate(prompt, max_new_tokens=12, eos_token_id=[]))
            assert results[-1].tokens == greedy(eager, prompt, 12)
            assert plain_decode(compiled, prompt, 12, [], Sampling(0.0), 0) == results[-1].tokens
        return results

    warm = run(TreeOptions(total_tokens=8), PROMPTS[:1])
    graphs = counters["stats"]["unique_graphs"]
    # other context lengths, other tree sizes and depths: shapes the graphs already cover
    results = warm + run(TreeOptions(total_tokens=5, depth=3), PROMPTS[1:]) + run(TreeOptions(total_tokens=12),
                                                                                  PROMPTS)
    assert_drafts_verified(results)
    assert counters["stats"]["unique_graphs"] == graphs, "a warm compiled target compiled a new graph"


@pytest.fixture(scope="module")
def fixed(pair):
    """A Target over the same model whose compiled steps have fixed shapes (the GPU's default, played on the CPU)."""
    eager, _, head = pair
    return Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True, fixed_shapes=True), head


def test_fixed_shape_steps_equal_eager_steps(pair, fixed):
    """A fixed-shape step attends over the whole cache under its mask, writes rows of different lengths through
    per-row columns and pads a 3-token chain to 4 tokens: the real tokens' logits and features are the eager steps',
    and the padding never shows (the next step is exact too)."""
    outs = []
    for target in (pair[0], fixed[0]):
        cache = target.new_cache(2, 32)
        target(torch.tensor([PROMPTS[2], PROMPTS[2][:9] + [0] * 4]), cache=cache, logits=False)
        cache.commit([13, 9])
        steps = []
        for ids, keep in (([[5, 6, 7], [8, 9, 10]], [3, 1]), ([[11], [12]], [1, 1])):
            k = len(ids[0])
            allowed = after_history(cache.lengths, torch.ones(2, k, k, dtype=torch.bool).tril(), cache.width + k)
            steps.append(target(torch.tensor(ids), cache.lengths[:, None] + torch.arange(k), cache, allowed,
                                layer_ids=(1, 3)))
            cache.commit(keep)
        outs.append(steps)
    for want, got in zip(*outs):
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.features, want.features, rtol=1e-5, atol=1e-5)


def test_fixed_shape_greedy_is_token_identical_and_compiles_nothing_at_other_lengths(pair, fixed):
    """Fixed shapes: one graph per size bucket, whatever the context length (with dynamic shapes off, a shape that
    followed the context would compile a graph at every new length)."""
    eager, (compiled, head) = pair[0], fixed
    gen = SpeculativeGenerator(compiled, head, TreeOptions(kind="chain", depth=3))
    before = counters["stats"]["unique_graphs"]
    warm = [gen.generate(PROMPTS[0], max_new_tokens=12, eos_token_id=[]),
            plain_decode(compiled, PROMPTS[0], 12, [], Sampling(0.0), 0)]
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > before, "the warm-up compiled nothing: the steps ran eager"
    results = [gen.generate(p, max_new_tokens=12, eos_token_id=[]) for p in PROMPTS[1:]]
    for prompt, result in zip(PROMPTS, [warm[0], *results]):
        assert result.tokens == greedy(eager, prompt, 12)
        assert plain_decode(compiled, prompt, 12, [], Sampling(0.0), 0) == result.tokens
    assert_drafts_verified(results)
    assert counters["stats"]["unique_graphs"] == graphs, "a fixed-shape step compiled a graph at a new context length"


@pytest.mark.parametrize("verifier", [None, always_accept_first_child], ids=["exact", "biased-control"])
def test_compiled_sampling_matches_generate(pair, verifier):
    _, compiled, head = pair
    kw = {"verifier": verifier} if verifier else {}
    spec = speculative_samples(compiled, head, 1500, 3, 1, TREE, **kw, **settings_of(SETTINGS[0]))
    if verifier is None:
        assert min_p_value(spec, reference_samples(0)) > 1e-3
    else:
        assert min_p_value(spec, reference_samples(0)) < 1e-6


def test_compiled_step_runs_no_aten_products(pair):
    """eyas's inductor settings reach the compile (they are read when a graph compiles, at a call): a step's
    products run inductor's GEMM templates, prepacked products or eyas's one-row kernel, never aten's products over
    the weights, which is what a graph compiled with inductor's defaults runs."""
    _, compiled, _ = pair
    cache = compiled.new_cache(1, 32)
    compiled(torch.tensor([PROMPT]), cache=cache, logits=False)
    cache.commit([len(PROMPT)])
    for _ in range(2):  # compiled (or taken from the module's earlier graphs), then profiled
        with torch.profiler.profile() as prof:
            compiled(torch.tensor([[11]]), cache=cache)
        cache.rollback()
    ran = {event.key for event in prof.key_averages()}
    assert not ran & {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul"}, sorted(ran)


ROW_KERNEL = {"eyas::row_gemv", "eyas::row_gemv_at"}  # eyas's row kernel, its weights as tensors or in their buffer


@pytest.mark.skipif(not row_gemv.available(), reason="eyas::row_gemv needs an x86 CPU with AVX2")
@pytest.mark.parametrize("dtype", row_gemv.DTYPES)
def test_compiled_step_runs_one_row_products_through_eyas_kernel(dtype, monkeypatch):
    """On an x86 CPU with AVX2 or better a compiled plain step's products run eyas's one-row kernel (the inductor
    pass in row_gemv.py reaches the compile), and the step computes what the eager one does up to the dtype's
    rounding. Where the model's weights lie in one buffer (a CPU Target's, weight_arena.py) every product takes them
    as offsets into it (eyas::row_gemv_at); a copy of the model whose buffer the pass is not shown takes them as
    tensors (eyas::row_gemv), and computes the same logits bit for bit."""
    eager = tiny_target("llama", vocab_size=VOCAB, dtype=dtype)
    compiled = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)
    scattered = Target(copy.deepcopy(eager.model), eager.tokenizer, eager.name_or_path, compile=True)
    steps = []
    for target in (eager, compiled, scattered):
        if target is scattered:  # its graphs compile at its first step
            monkeypatch.setattr(weight_arena, "arena_of", lambda tensors: None)
        cache = target.new_cache(1, 32)
        target(torch.tensor([PROMPT]), cache=cache, logits=False)
        cache.commit([len(PROMPT)])
        out = target(torch.tensor([[11]]), cache=cache)
        cache.rollback()
        with torch.profiler.profile() as prof:  # the step again: its graph, the lm_head's product in it, compiled
            target(torch.tensor([[11]]), cache=cache)
        cache.rollback()
        steps.append((out.logits.float(), {event.key for event in prof.key_averages()}))
    (want, _), (got, ran), (also, ran_scattered) = steps
    assert not (ran | ran_scattered) & {"aten::mm", "aten::addmm", "aten::linear"}, sorted(ran | ran_scattered)
    assert ran & ROW_KERNEL == {"eyas::row_gemv_at"}, sorted(ran)
    assert ran_scattered & ROW_KERNEL == {"eyas::row_gemv"}, sorted(ran_scattered)
    eps = 2 ** -5 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, want, rtol=eps, atol=eps * float(want.abs().max()))
    assert torch.equal(got, also)


@pytest.mark.skipif(not row_gemv.available(), reason="eyas::row_gemv needs an x86 CPU with AVX2")
def test_compiled_step_calls_eyas_kernels_as_c_functions():
    """A compiled step's C++ wrapper calls eyas's kernels as the C functions row_gemv.C_SHIMS declares, not through the
    dispatcher's boxed calls."""
    from torch._inductor.utils import run_and_get_cpp_code

    eager = tiny_target("llama", vocab_size=VOCAB, dtype=torch.float32)
    compiled = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)
    cache = compiled.new_cache(1, 32)
    compiled(torch.tensor([PROMPT]), cache=cache, logits=False)
    cache.commit([len(PROMPT)])
    with torch._inductor.config.patch(fx_graph_cache=False):  # the code of a compile, not of a cached graph
        _, code = run_and_get_cpp_code(compiled, torch.tensor([[11]]), cache=cache, logits=False)
    assert "aoti_torch_cpu_row_gemv_at(" in code and 'findSchemaOrThrow("eyas::row_gemv' not in code, code[-3000:]


_CACHED_STEP = """
import sys, torch
from torch._dynamo.utils import counters
from eyas.models.target import Target
from tests.helpers.tiny import tiny_target
eager = tiny_target("llama", vocab_size=16, seed=int(sys.argv[1]))
logits = []
for target in (eager, Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)):
    cache = target.new_cache(1, 32)
    target(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache, logits=False)
    cache.commit([5])
    logits.append(target(torch.tensor([[11]]), cache=cache).logits)
torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
print("cache", counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
"""


_OTHER_CAPACITY = """
import torch
from torch._dynamo.utils import counters
from eyas.inference.bench import plain_decode
from eyas.models.sampling import Sampling
from eyas.models.target import Target
from tests.helpers.tiny import tiny_target
eager = tiny_target("llama", vocab_size=16)
compiled = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)
greedy = Sampling(0.0)
plain_decode(compiled, [1, 2, 3, 4, 5], 6, [], greedy, 0)  # the warm-up: caches of one capacity only
graphs = counters["stats"]["unique_graphs"]
for prompt in ([1, 2, 3], list(range(1, 12))):
    assert plain_decode(compiled, prompt, 6, [], greedy, 0) == plain_decode(eager, prompt, 6, [], greedy, 0)
print("graphs", graphs, counters["stats"]["unique_graphs"] - graphs)
"""


def test_plain_decoding_compiles_nothing_for_a_cache_of_another_capacity():
    """Compiled plain steps warmed up over caches of one capacity compile no graph for the next prompt's cache of
    another (a benchmark's timed runs would include it): the capacity is a symbol from the first graph
    (KVCache.make_capacity_symbolic). A process of its own: dynamo remembers, per code, the sizes it has seen change."""
    run = subprocess.run([sys.executable, "-c", _OTHER_CAPACITY], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    warm, new = (int(n) for n in run.stdout.split("graphs")[-1].split())
    assert warm > 0 and new == 0, (warm, new)


def test_a_later_process_takes_compiled_steps_from_inductors_cache(tmp_path):
    """A compiled step's graph is stored in inductor's cache of compiled graphs (its settings pickle, eyas's op
    overloads among them) and a later process takes it from there instead of compiling it anew (~35 s a kind of step
    for SmolLM2-135M); the graph it takes computes that process's eager logits, reading the weights' buffer of that
    process's model, which the stored graph names rather than holds."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    counts = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", _CACHED_STEP, "0"], capture_output=True, text=True,
                             env=env, timeout=600, cwd=Path(__file__).parents[2])
        assert run.returncode == 0, run.stderr[-3000:]
        counts.append([int(n) for n in run.stdout.split("cache")[-1].split()])
    (first_hits, first_misses), (hits, misses) = counts
    assert first_hits == 0 and first_misses > 0 and hits > 0 and misses == 0, counts


def _prefilled(*targets: Target, capacity: int = 32) -> dict:
    """Per target, a cache of `capacity` tokens holding PROMPT."""
    caches = {}
    for target in targets:
        caches[target] = target.new_cache(1, capacity)
        target(torch.tensor([PROMPT]), cache=caches[target], logits=False)
        caches[target].commit([len(PROMPT)])
    return caches


def _chain(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify of a chain of k tokens after PROMPT: ids, positions and the tree mask."""
    n = len(PROMPT)
    allowed = after_history(torch.tensor([n]), torch.ones(1, k, k, dtype=torch.bool).tril(), n + k)
    return (torch.arange(k) % (VOCAB - 1) + 1)[None], torch.arange(n, n + k)[None], allowed


@pytest.mark.skipif(not row_gemv.available(), reason="eyas::row_gemv needs an x86 CPU with AVX2")
def test_compiled_bf16_verifies_run_the_row_kernel_without_bf16_units(monkeypatch):
    """On a CPU without bf16 units (played here) a compiled bf16 verify's products run eyas's row kernel, in the graph
    compiled for the first tree size and in the one that takes any size after it, and compute the eager verify's
    logits up to bf16 rounding."""
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: None)  # not torch's reading: inductor's own choices stay
    eager = tiny_target("llama", vocab_size=VOCAB, dtype=torch.bfloat16, seed=2)  # weights of its own: its own graphs
    compiled = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)
    caches = _prefilled(eager, compiled)
    for k in (3, 5, 4):  # 5: the size changed, the graph that takes any size compiles; 4: it runs
        ids, pos, allowed = _chain(k)
        logits = []
        for target in (eager, compiled):  # compiled (autotuning runs aten's products) or reused at the first call
            logits.append(target(ids, pos, caches[target], allowed).logits.float())
            caches[target].rollback()
            with torch.profiler.profile() as prof:  # the verify again: its graph (the lm_head in it), compiled
                target(ids, pos, caches[target], allowed)
            caches[target].rollback()
        ran = {event.key for event in prof.key_averages()}
        assert ran & ROW_KERNEL and not ran & {"aten::mm", "aten::addmm", "aten::linear"}, (k, sorted(ran))
        want, got = logits
        torch.testing.assert_close(got, want, rtol=2 ** -5, atol=2 ** -5 * float(want.abs().max()))


@pytest.mark.skipif(not row_gemv.available(), reason="eyas::attend needs an x86 CPU with AVX2")
def test_compiled_verifies_of_any_size_attend_through_eyas_kernel_up_to_its_rows():
    """The graph a verify runs once its tree size has changed takes any size: its attention is eyas's kernel, which
    hands the calls of more query rows than `attention_rows()` to torch's flash attention as they come; the logits are
    the eager verify's."""
    most = cpu_kernels.attention_rows()
    eager = tiny_target("llama", vocab_size=VOCAB, seed=3)  # weights of its own: its own graphs
    compiled = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)
    caches = _prefilled(eager, compiled)
    flash = "aten::_scaled_dot_product_flash_attention_for_cpu"
    with torch._inductor.config.patch(fx_graph_cache=False):  # compiled here, not taken from another test's cache
        for k in (most - 1, most + 1, most, most + 2):  # the second: the size changed, the graph of any size compiles
            ids, pos, allowed = _chain(k)
            want, got = (target(ids, pos, caches[target], allowed).logits for target in (eager, compiled))
            for target in (eager, compiled):
                caches[target].rollback()
            with torch.profiler.profile() as prof:
                compiled(ids, pos, caches[compiled], allowed)
            caches[compiled].rollback()
            ran = {event.key for event in prof.key_averages()}
            assert "eyas::attend" in ran and (flash in ran) == (k > most), (k, sorted(ran))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not row_gemv.available(), reason="eyas::attend needs an x86 CPU with AVX2")
def test_compiled_verifies_of_any_size_attend_over_the_caches_own_key_value_heads(monkeypatch):
    """A GQA model repeats each key/value head per query head before its attention; eyas's kernel takes the heads
    unrepeated (no copy of the cache in every layer) in the graph of any size too, compiled here for a new cache of
    another capacity (as each new generation's cache is): the cache's length is known only at run time there, and
    the repeat traces with slices of whole dimensions. Its logits are the eager verify's."""
    graphs = []
    rewrite = cpu_kernels.rewrite_attention

    def kept(graph):
        graphs.append(graph)
        return rewrite(graph)

    monkeypatch.setattr(cpu_kernels, "rewrite_attention", kept)
    eager = tiny_target("llama", vocab_size=VOCAB, seed=4)  # weights of its own: its own graphs
    compiled = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)
    kv_heads = eager.model.config.num_key_value_heads
    assert kv_heads < eager.model.config.num_attention_heads
    with torch._inductor.config.patch(fx_graph_cache=False):  # compiled here, not taken from another test's cache
        for k in (2, 3):  # the second: the size changed, the graph of any size compiles
            caches = _prefilled(eager, compiled, capacity=len(PROMPT) + k + 8)
            ids, pos, allowed = _chain(k)
            want, got = (target(ids, pos, caches[target], allowed).logits for target in (eager, compiled))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    attends = [n for n in graphs[-1].nodes if n.target is torch.ops.eyas.attend.default]
    assert attends and all(a.meta["val"].shape[1] == kv_heads for n in attends for a in n.args[1:3])
