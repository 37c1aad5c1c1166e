import pytest
import torch

from eyas.models import Target, row_gemv
from eyas.models.masks import after_history, causal
from tests.helpers.families import POST_PROCESSING, family_target
from tests.helpers.machine import skip_unless_runs_bf16_units
from tests.helpers.stored import FP32_NOISE
from tests.helpers.tiny import FIXTURES, tiny_target, tiny_tokenizer


def tree_block(parents: list[int]) -> torch.Tensor:
    """[1, n, n]: node i sees itself and its ancestors (columns after the history)."""
    n = len(parents)
    block = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            block[i, j] = True
            j = parents[j]
    return block[None]


def path(parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


# fp32 results of different kernels (summation orders) on the tiny targets: rounding accumulated over a few
# layers of width 64, ~1e-6, bounded with room to spare
FP32 = 1e-5
PARENTS = [-1, 0, 0, 1, 1, 2, 3, -1]  # two roots, depths up to 3
DEPTH = [len(path(PARENTS, i)) - 1 for i in range(len(PARENTS))]


@pytest.mark.parametrize("arch,tied", FIXTURES)
def test_features_match_plain_forward(arch, tied):
    target = tiny_target(arch, tied)
    ids = torch.randint(4, 300, (2, 11))
    ref = target.model(ids, output_hidden_states=True)
    layer_ids = (1, 2, target.num_layers)
    out = target(ids, layer_ids=layer_ids)
    # eyas's prepacked linears ran (the model's own forward used F.linear): two kernels, equal up to fp32 rounding
    assert all((lin.kernel(ids.numel()) is not None) == torch.backends.mkldnn.is_available() for lin in target._linears)
    expected = torch.cat([ref.hidden_states[i] for i in layer_ids], dim=-1)
    torch.testing.assert_close(out.features, expected, rtol=FP32, atol=FP32)
    torch.testing.assert_close(out.hidden, ref.hidden_states[-1], rtol=FP32, atol=FP32)
    torch.testing.assert_close(out.logits, ref.logits, rtol=FP32, atol=FP32)


def _tree_logits(target, prefix, nodes, block):
    """Prefill `prefix`, then one forward over the tree `nodes` whose columns see `block` [1, n, n]."""
    cache = target.new_cache(1, prefix.shape[1] + nodes.shape[1] + 4)
    target(prefix, cache=cache, logits=False)
    cache.commit([prefix.shape[1]])
    pos = prefix.shape[1] + torch.tensor(DEPTH)[None]
    allowed = after_history(cache.lengths, block, cache.width + nodes.shape[1])
    return target(nodes, pos, cache, allowed).logits[0], cache


@pytest.mark.parametrize("arch,tied", FIXTURES)
def test_tree_forward_equals_each_path_alone(arch, tied):
    target = tiny_target(arch, tied)
    prefix = torch.randint(4, 300, (1, 9))
    nodes = torch.randint(4, 300, (1, len(PARENTS)))
    logits, cache = _tree_logits(target, prefix, nodes, tree_block(PARENTS))
    for i in range(len(PARENTS)):
        seq = torch.cat([prefix, nodes[:, path(PARENTS, i)]], dim=1)
        alone = target.model(seq).logits[0, -1]
        torch.testing.assert_close(logits[i], alone, rtol=1e-5, atol=1e-5)

    # Keeping prefix + one accepted path leaves a cache equal to running that path alone.
    accepted = path(PARENTS, 6)
    cache.commit([len(accepted)], torch.tensor([accepted]))
    assert cache.host_lengths == [prefix.shape[1] + len(accepted)]
    nxt = torch.randint(4, 300, (1, 1))
    cont = target(nxt, cache=cache).logits[0, -1]
    seq = torch.cat([prefix, nodes[:, accepted], nxt], dim=1)
    torch.testing.assert_close(cont, target.model(seq).logits[0, -1], rtol=1e-5, atol=1e-5)


def test_causal_mask_in_place_of_tree_mask_fails():
    target = tiny_target("llama")
    prefix = torch.randint(4, 300, (1, 9))
    nodes = torch.randint(4, 300, (1, len(PARENTS)))
    logits, _ = _tree_logits(target, prefix, nodes, causal(len(PARENTS))[None])
    mismatched = 0
    for i in range(len(PARENTS)):
        seq = torch.cat([prefix, nodes[:, path(PARENTS, i)]], dim=1)
        mismatched += not torch.allclose(logits[i], target.model(seq).logits[0, -1], rtol=1e-5, atol=1e-5)
    assert mismatched > 0


def test_tree_mask_shape_is_checked():
    target = tiny_target("llama")
    cache = target.new_cache(1, 8)
    with pytest.raises(ValueError, match="mask must be"):
        target(torch.ones(1, 3, dtype=torch.long), cache=cache, allowed=torch.ones(1, 3, 5, dtype=torch.bool))


def test_target_is_frozen():
    target = tiny_target("qwen2", True)
    assert not any(p.requires_grad for p in target.parameters())


@pytest.mark.parametrize("rows", [1, 5])
def test_logit_projection_matches_lm_head_and_follows_weight_changes(rows):
    target = tiny_target("llama", tied=True)
    proj = target.logit_projection
    assert proj.applies() == torch.backends.mkldnn.is_available()
    h = torch.randn(1, rows, target.hidden_size)
    torch.testing.assert_close(proj(h), target.lm_head(h), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # a stale packed copy would keep the old weight
        target.lm_head.weight.mul_(-1)
    torch.testing.assert_close(proj(h), target.lm_head(h), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama-tied", "opt", "mistral3-vlm", *POST_PROCESSING])
def test_logits_are_the_models_own_and_skip_its_forward_only_where_it_adds_nothing(family):
    """Soft-capped and scaled logits come from the model's forward; a model that adds nothing to its lm_head's
    output has its logits from the lm_head alone, after the first call."""
    target = family_target(family)
    ids = torch.randint(4, 200, (1, 9), generator=torch.Generator().manual_seed(0))
    # eyas's products sum in another order than the model's own, and a logit scale (Granite divides by 0.25) scales
    # that rounding; a skipped cap or scale differs by far more
    torch.testing.assert_close(target(ids).logits, target.model(ids).logits, rtol=FP32_NOISE, atol=FP32_NOISE)
    calls = []
    target.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    # states far larger than a decoder's: logits well past the caps, where skipping a cap shows
    hidden = 30 * torch.randn(3, target.hidden_size, generator=torch.Generator().manual_seed(1))
    logits = target.logits(hidden)
    assert torch.equal(logits, target._logits_through(*target._logits_slot, hidden))
    assert (len(calls) == 1) == (family not in POST_PROCESSING)


def test_logit_projection_runs_the_module_when_it_is_hooked():
    target = tiny_target("llama")
    target.logits(torch.zeros(1, target.hidden_size))  # the first call's checks (`logits`) call the head too
    calls = []
    target.lm_head.register_forward_pre_hook(lambda module, args: calls.append(tuple(args[0].shape)))
    out = target(torch.randint(4, 300, (1, 5)), logits=torch.tensor([[2, 4]]))
    assert calls == [(1, 2, target.hidden_size)] and out.logits.shape == (1, 2, target.vocab_size)


@pytest.mark.parametrize("capabilities", [{"avx2": True}, {"avx2": True, "avx512_bf16": True},
                                          {"avx2": True, "amx_bf16": True, "avx512_bf16": True}])
def test_bf16_linears_take_eyas_kernels_only_where_they_pay(monkeypatch, request, capabilities):
    """One bf16 row runs eyas's row kernel wherever it is built (any AVX2 CPU; torch's one-row bf16 product reads
    the weight far below the bandwidth), else oneDNN's prepacked product on a CPU with native bf16. Several rows run
    the row kernel up to the rows it is the faster product of on the CPU (`kernel_rows`): all it takes without bf16
    units (torch emulates bf16 products there), 16 with AVX512-BF16; none with AMX, whose tiles take them. Past
    them the prepacked product runs with native bf16; without, the product in fp32 (torch's bf16 one is emulated)."""
    from eyas.models.cpu_kernels import kernel_rows, native_bf16

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    native_bf16.cache_clear()
    request.addfinalizer(native_bf16.cache_clear)
    skip_unless_runs_bf16_units()
    native = "avx512_bf16" in capabilities
    most = 1 if "amx_bf16" in capabilities else 16 if native else row_gemv.MAX_ROWS
    assert kernel_rows(torch.bfloat16) == most
    packing = torch.backends.mkldnn.is_available()
    target = tiny_target("llama", tied=False, dtype=torch.bfloat16)
    lin = target.logit_projection
    row_kernel = packing and row_gemv.available()

    def runs(rows: int, name: str) -> bool:
        kernel = lin.kernel(rows)
        return kernel is not None and kernel.func.__name__ == name

    assert (lin.kernel(1) is not None) == (packing and (native or row_gemv.available()))
    for rows in (3, most, most + 1):
        assert runs(rows, "_through_row_kernel") == (row_kernel and rows <= most), rows
        in_fp32 = packing and not native and rows > row_gemv.MAX_ROWS
        assert runs(rows, "_bf16_in_fp32") == in_fp32, rows
        assert (lin.kernel(rows) is not None) == (packing and native or runs(rows, "_through_row_kernel") or in_fp32)
    for rows in (1, 3, most + 1):
        h = torch.randn(1, rows, target.hidden_size, dtype=torch.bfloat16)
        # bf16 products accumulate in fp32 either way; they may round the last bit differently
        torch.testing.assert_close(target.logit_projection(h).float(), target.lm_head(h).float(), rtol=2 ** -7,
                                   atol=2 ** -7 * float(target.lm_head(h).abs().max()))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoder_linears_run_through_eyas_kernels_with_unchanged_results(arch):
    target = tiny_target(arch)
    linears = target._linears
    packing = torch.backends.mkldnn.is_available()
    assert linears and all(lin.applies() == packing for lin in linears)
    shadowed = []  # seen from inside the forward: are the layers' own calls routed through eyas's kernel?
    target._layers[0].register_forward_pre_hook(
        lambda module, args: shadowed.append(all("forward" in vars(lin.module) for lin in linears)))
    ids = torch.randint(4, 300, (2, 6))
    fast = target(ids, layer_ids=(1,))
    one = target(ids[:1, :1])  # one row: eyas's row kernel where it is built, else F.linear (nothing shadowed)
    assert shadowed == [packing, packing and row_gemv.available()]
    assert not any("forward" in vars(lin.module) for lin in linears)  # restored after the call
    as_is = Target(target.model, target.tokenizer, "as-is", cpu_kernels=False)  # the same weights, modules as they are
    assert not any(lin.applies() for lin in as_is._linears) and not as_is.logit_projection.applies()
    plain = as_is(ids, layer_ids=(1,))
    assert shadowed[-1] is False  # nothing was shadowed this time
    torch.testing.assert_close(fast.features, plain.features, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.logits, plain.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one.logits, as_is(ids[:1, :1]).logits, rtol=1e-5, atol=1e-5)
    few = target(ids[:1, :3])  # a few fp32 rows: eyas's row kernel where it is built, else the prepacked products
    torch.testing.assert_close(few.logits, as_is(ids[:1, :3]).logits, rtol=1e-5, atol=1e-5)


def test_row_copy_linears_take_one_row_through_their_transposed_copy(monkeypatch):
    """Where eyas's one-row kernel is not built (non-x86 CPUs), one row of a row_copy layer (the lm_head) runs
    through its [in, out] copy and other layers keep F.linear."""
    from torch import nn

    from eyas.models.cpu_kernels import CpuLinear, cpu_linears

    monkeypatch.setattr(row_gemv, "available", lambda: False)

    torch.manual_seed(0)
    wide, plain = nn.Linear(16, 64, bias=False), nn.Linear(16, 16)
    linears = [CpuLinear(wide, row_copy=True), CpuLinear(plain)]
    x = torch.randn(1, 1, 16)
    expected = wide(x), plain(x)
    with cpu_linears(linears, rows=1):
        shadowed = ["forward" in vars(m) for m in (wide, plain)]
        got = wide(x), plain(x)
    packing = torch.backends.mkldnn.is_available()
    assert shadowed == [packing, False]  # one row: only the row_copy layer changes
    assert not any("forward" in vars(m) for m in (wide, plain))  # restored
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_decoder_linears_are_restored_when_the_forward_fails_and_hooked_ones_run_themselves():
    target = tiny_target("llama")
    hooked = target._linears[0].module
    calls = []
    hooked.register_forward_pre_hook(lambda module, args: calls.append(tuple(args[0].shape)))
    target(torch.randint(4, 300, (1, 4)))
    assert calls == [(1, 4, target.hidden_size)]  # the module itself ran, hook and all

    def boom(module, args, kwargs):
        raise RuntimeError("boom")

    target._layers[-1].register_forward_pre_hook(boom, with_kwargs=True)
    with pytest.raises(RuntimeError, match="boom"):
        target(torch.randint(4, 300, (1, 4)))
    assert not any("forward" in vars(lin.module) for lin in target._linears)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_masked_gqa_attention_reads_each_key_head_once_with_unchanged_results(arch, monkeypatch):
    target = tiny_target(arch)  # 4 query heads over 2 key/value heads
    plain = Target(target.model, target.tokenizer, "as-is", cpu_kernels=False)
    seen = []  # (query heads, key heads) of every masked multi-row SDPA call
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        if q.shape[2] > 1 and kwargs.get("attn_mask") is not None:
            seen.append((q.shape[1], k.shape[1]))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    prefix, nodes = torch.randint(4, 300, (1, 9)), torch.randint(4, 300, (1, len(PARENTS)))
    fast, _ = _tree_logits(target, prefix, nodes, tree_block(PARENTS))
    ours, seen[:] = list(seen), []
    slow, _ = _tree_logits(plain, prefix, nodes, tree_block(PARENTS))
    assert ours and all(kv == 2 for _, kv in ours)  # the cache's own 2 heads, not a copy per query head
    assert seen and all(kv == 4 for _, kv in seen)  # transformers' sdpa repeats them
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    from transformers import AttentionInterface

    assert target.model.config._attn_implementation == "sdpa"  # the model's own setting is never touched
    assert AttentionInterface._global_mapping["sdpa"].__module__.startswith("transformers")  # restored afterwards


def test_ragged_spans_are_the_cheapest_contiguous_split():
    import itertools

    from eyas.models.cpu_kernels import ragged_spans

    g = torch.Generator().manual_seed(0)
    for n in range(1, 9):
        need = torch.randint(1, 400, (n,), generator=g).tolist()
        spans = ragged_spans(need, call_cost=100)
        # covers every row once
        assert [a for a, _, _ in spans] == [0] + [b for _, b, _ in spans[:-1]] and spans[-1][1] == n
        assert all(m == max(need[a:b]) for a, b, m in spans)  # each span reads as far as its neediest row

        def cost(cuts, n=n, need=need):
            bounds = [0, *cuts, n]
            return sum((b - a) * max(need[a:b]) + 100 for a, b in zip(bounds, bounds[1:]))

        cheapest = min(cost(c) for k in range(n) for c in itertools.combinations(range(1, n), k))
        assert cost([b for _, b, _ in spans[:-1]]) == cheapest


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rows_of_different_lengths_attend_only_over_their_own_columns(arch, monkeypatch):
    """Rows of different lengths in one cache (as regeneration holds them): the same logits as the model's own
    attention, while the attention of short rows reads fewer key columns than the batch's widest row."""
    import eyas.models.cpu_kernels as kernels

    target = tiny_target(arch)
    plain = Target(target.model, target.tokenizer, "as-is", cpu_kernels=False)
    monkeypatch.setattr(kernels, "SPAN_CALL_COST", 0)  # tiny rows: splitting must not look too dear to happen
    widths = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, *a, **kw: widths.append(k.shape[2]) or sdpa(q, k, v, *a, **kw))
    lens = [12, 9, 5, 3]
    ids = torch.randint(4, 300, (len(lens), 12))
    step = torch.randint(4, 300, (len(lens), 1))
    logits = {}
    for name, t in (("eyas", target), ("plain", plain)):
        cache = t.new_cache(len(lens), 16)
        t(ids, cache=cache, logits=False)  # right-padded: each row keeps its first lens[b] tokens
        cache.commit(lens)
        widths.clear()
        allowed = after_history(cache.lengths, torch.ones(len(lens), 1, 1, dtype=torch.bool), cache.width + 1)
        nxt = t(step, cache.lengths[:, None], cache, allowed).logits[:, 0]
        logits[name] = (nxt, list(widths))
    assert min(logits["eyas"][1]) < 13 and min(logits["plain"][1]) >= 13  # spans read less; the model reads all
    torch.testing.assert_close(logits["eyas"][0], logits["plain"][0], rtol=1e-5, atol=1e-5)
    for b, n in enumerate(lens):  # and each row as if it were alone
        alone = target.model(torch.cat([ids[b:b + 1, :n], step[b:b + 1]], 1)).logits[0, -1]
        torch.testing.assert_close(logits["eyas"][0][b], alone, rtol=1e-5, atol=1e-5)


# ---- what the target can and cannot verify exactly ------------------------------------------------------------
def _tiny(config_name: str, model_name: str, **settings):
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**settings)).eval()
    return Target(model, tiny_tokenizer(320), f"tiny-{model_name}")


@pytest.mark.parametrize("config,model,settings,message", [
    ("MambaConfig", "MambaForCausalLM", dict(state_size=4), "'linear_attention' layers, which carry a recurrent"),
    ("JambaConfig", "JambaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                             attn_layer_period=2, attn_layer_offset=1, num_experts=2,
                                             mamba_d_state=4), "'linear_attention' layers"),
    ("Lfm2Config", "Lfm2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                           layer_types=["conv", "full_attention"]), "'conv' layers"),
    ("RwkvConfig", "RwkvForCausalLM", dict(attention_hidden_size=32, intermediate_size=64),
     "keeps no keys and values"),
])
def test_targets_with_recurrent_state_are_refused_naming_why(config, model, settings, message):
    from eyas.models.errors import Unsupported

    target = _tiny(config, model, vocab_size=320, hidden_size=32, num_hidden_layers=2, **settings)
    with pytest.raises(Unsupported, match=message):
        target.verify_mode()


def test_a_model_that_masks_by_cache_column_verifies_chains():
    """GPT-Neo's local layers mask by cache column (a window of 256 columns, longer than the check's sequences):
    only the check's row of unused columns shows it, so such a target verifies chains, where column = position."""
    def gpt_neo():
        return _tiny("GPTNeoConfig", "GPTNeoForCausalLM", vocab_size=320, hidden_size=32, num_layers=2, num_heads=4,
                     attention_types=[[["global", "local"], 1]], window_size=256, max_position_embeddings=2048)

    assert gpt_neo().verify_mode() == "chain"
    no_gap = gpt_neo()
    no_gap.GAP = 0
    assert no_gap.verify_mode() == "tree"  # what the check would conclude from rows of similar lengths alone


def test_lengths_past_a_length_dependent_rope_switch_are_refused():
    from eyas.inference import SpeculativeGenerator
    from eyas.models.errors import InputError, Unsupported
    from tests.helpers.families import family_target
    from tests.helpers.inference import make_head

    target = family_target("phi3-longrope")  # long factors past 128 tokens, 256 positions in all
    target.check_length(128)
    with pytest.raises(Unsupported, match="longrope.*128"):
        target.check_length(129)
    with pytest.raises(InputError, match="max_position_embeddings"):
        target.check_length(257)
    gen = SpeculativeGenerator(target, make_head(target))
    with pytest.raises(Unsupported, match="longrope"):
        gen.generate(list(range(10, 110)), max_new_tokens=40)


def test_eagle3_features_are_refused_where_layers_pass_several_streams():
    from eyas.models.errors import Unsupported
    from tests.helpers.families import family_target

    target = family_target("gemma3n")  # AltUp: [2, B, T, H] between layers
    assert target(torch.randint(4, 300, (1, 5)), layer_ids=(target.num_layers,)).features is not None  # the output
    with pytest.raises(Unsupported, match="eagle1"):
        target(torch.randint(4, 300, (1, 5)), layer_ids=(1, 2))


def test_a_chain_verifying_target_refuses_explicit_masks():
    """ALiBi models take positions from their own masks: any forward with eyas's explicit masks (rows of different
    lengths, trees, packed prompts; regeneration makes such forwards) is refused instead of computing other logits."""
    from eyas.models.errors import Unsupported
    from tests.helpers.families import family_target

    target = family_target("falcon-alibi")
    cache = target.new_cache(2, 16)
    target(torch.randint(4, 300, (2, 6)), cache=cache, logits=False)
    cache.commit([6, 4])
    allowed = after_history(cache.lengths, torch.ones(2, 1, 1, dtype=torch.bool), cache.width + 1)
    with pytest.raises(Unsupported, match="explicit masks"):
        target(torch.randint(4, 300, (2, 1)), cache.lengths[:, None], cache, allowed)
    assert target.verify_mode() == "chain"
