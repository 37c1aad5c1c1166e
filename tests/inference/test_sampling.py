"""Speculative sampling draws from exactly the distribution the model's own `generate` samples from: for every
sampling setting, on every family whose CausalLM post-processes its logits, and with the settings the model's
generation_config holds when the caller sets none. Each test has a control that the same test must catch."""

import functools

import pytest
import torch
from transformers import GenerationConfig, RepetitionPenaltyLogitsProcessor

from eyas.inference import SpeculativeGenerator, TreeOptions
from eyas.inference.acceptance import penalized
from eyas.inference.tree import DraftTree
from eyas.models import DraftHead, head_config_for
from eyas.models.drafters import NAMES
from eyas.models.sampling import Sampling, choose
from eyas.models.sampling import distribution as target_distribution
from tests.helpers.families import FAMILIES, POST_PROCESSING, family_target
from tests.helpers.inference import NO_EOS, OracleHead, always_accept_first_child, greedy
from tests.helpers.tiny import tiny_target

PROMPT = [5, 6, 7, 8, 9]
VOCAB = 16  # a small vocabulary, so that a random head's top-k children often hold the target's choice
SETTINGS = [Sampling(1.0), Sampling(1.0, top_k=6), Sampling(0.8, top_p=0.7), Sampling(1.0, min_p=0.15),
            Sampling(1.0, repetition_penalty=1.5)]


def _setup(head_type: str = "eagle3"):
    target = tiny_target("llama", vocab_size=VOCAB)
    with torch.no_grad():
        target.lm_head.weight.mul_(3)
    target.model.generation_config.eos_token_id = None
    torch.manual_seed(0)
    head = DraftHead(head_config_for(target, head_type), target)
    return target, head


def generate_samples(model, n: int, steps: int, seed: int, **settings) -> torch.Tensor:
    """[n, steps] tokens after PROMPT drawn by the model's own `generate` (with `settings`; none given: what its
    generation_config says)."""
    torch.manual_seed(seed)
    out = model.generate(torch.tensor([PROMPT] * n), max_new_tokens=steps, pad_token_id=1, **settings)
    assert out.shape[1] == len(PROMPT) + steps
    return out[:, len(PROMPT):]


def as_generate_kwargs(s: Sampling) -> dict:
    return dict(do_sample=True, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p or None,
                repetition_penalty=s.repetition_penalty)


def speculative_samples(target, head, n: int, steps: int, seed: int, options: TreeOptions, min_tau: float = 1.2,
                        **kw) -> torch.Tensor:
    """[n, steps] tokens from eyas: kw holds the sampling settings (none: the target's generation_config's) and
    optionally a verifier."""
    verifier = {"verifier": kw.pop("verifier")} if "verifier" in kw else {}
    gen = SpeculativeGenerator(target, head, options, **verifier)
    res = gen.generate_batch([PROMPT] * n, max_new_tokens=steps, seed=seed, eos_token_id=[], **kw)
    assert sum(sum(r.stats.accepted) for r in res) > min_tau * sum(len(r.stats.accepted) for r in res), \
        "drafts should be accepted, else the test only exercises the bonus token"
    return torch.tensor([r.tokens for r in res])


def settings_of(s: Sampling) -> dict:
    return dict(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                repetition_penalty=s.repetition_penalty)


def chi2_p_value(table: torch.Tensor) -> float:
    """Pearson chi-square test of homogeneity on a [2, K] count table: P(statistic this large | same law)."""
    table = table.double()
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2))  # chi2 survival


def min_p_value(a: torch.Tensor, b: torch.Tensor, vocab: int = VOCAB) -> float:
    """Smallest chi-square p-value over each step's marginal and the (step 1, step 2) pair. a, b [N, steps]."""
    def table(x, y):
        size = int(max(x.max(), y.max())) + 1
        counts = torch.stack([torch.bincount(x, minlength=size), torch.bincount(y, minlength=size)])
        return counts[:, counts.sum(0) >= 10]  # drop cells too rare for chi-square

    columns = [(a[:, i], b[:, i]) for i in range(a.shape[1])]
    columns.append((a[:, 0] * vocab + a[:, 1], b[:, 0] * vocab + b[:, 1]))
    return min(chi2_p_value(table(x, y)) for x, y in columns)


TREE = TreeOptions(total_tokens=12, top_k=5, depth=3)


@functools.lru_cache(maxsize=None)
def reference_samples(setting: int) -> torch.Tensor:
    """The model's own `generate` samples under SETTINGS[setting] (the target is the same for every head)."""
    target, _ = _setup()
    return generate_samples(target.model, 1500, 3, 2, **as_generate_kwargs(SETTINGS[setting]))


@pytest.mark.parametrize("head_type", NAMES)  # every drafter algorithm
@pytest.mark.parametrize("setting", range(len(SETTINGS)), ids=["t1", "t1-topk6", "t0.8-topp0.7", "t1-minp0.15",
                                                               "t1-penalty1.5"])
def test_speculative_sampling_matches_generate(setting, head_type):
    target, head = _setup(head_type)
    spec = speculative_samples(target, head, 1500, 3, 1, TREE, **settings_of(SETTINGS[setting]))
    assert min_p_value(spec, reference_samples(setting)) > 1e-3


@pytest.mark.parametrize("head_type", NAMES)
def test_biased_verifier_is_detected(head_type):
    target, head = _setup(head_type)
    biased = speculative_samples(target, head, 1500, 3, 1, TREE, verifier=always_accept_first_child,
                                 **settings_of(SETTINGS[0]))
    assert min_p_value(biased, reference_samples(0)) < 1e-6


# ---- families whose CausalLM post-processes its logits --------------------------------------------------------
@pytest.mark.parametrize("family", POST_PROCESSING)
def test_sampling_keeps_the_distribution_of_models_that_post_process_logits(family):
    """Soft-capping, logit scales, scaled hidden states: the samples follow the model's own distribution, and the
    same test catches a target whose logits skip the post-processing (the lm_head alone)."""
    target = family_target(family, vocab_size=VOCAB)
    with torch.no_grad():  # raw logits of a size the post-processing reshapes (soft-capping at 1 bends them)
        target.lm_head.weight.mul_(2 / target.lm_head(target(torch.tensor([PROMPT])).hidden).std())
    torch.manual_seed(0)
    head = DraftHead(head_config_for(target, FAMILIES[family].head), target)
    # a temperature that leaves the model's own distribution neither flat nor one-hot
    s = Sampling(float(target(torch.tensor([PROMPT])).logits.std()) / 1.5)
    tree, n = TreeOptions(total_tokens=5, top_k=3, depth=2), 1000
    reference = generate_samples(target.model, n, 2, 2, **as_generate_kwargs(s))
    exact = speculative_samples(target, head, n, 2, 1, tree, min_tau=1.05, **settings_of(s))
    assert min_p_value(exact, reference) > 1e-3
    target.logits = lambda hidden: target.lm_head(hidden)  # the control: logits computed past the model's forward
    skipped = speculative_samples(target, head, n, 2, 1, tree, min_tau=0.0, **settings_of(s))
    assert min_p_value(skipped, reference) < 1e-6


# ---- the generation_config's settings when the caller sets none --------------------------------------------------
def test_unset_settings_follow_the_generation_config_as_generate_does():
    """A model that ships do_sample=True, temperature 0.7, top_k 5: eyas without sampling arguments draws from
    what `generate()` without arguments draws from; ignoring the config's top_k is caught."""
    target, head = _setup()
    target.model.generation_config.update(do_sample=True, temperature=0.7, top_k=5)
    reference = generate_samples(target.model, 1500, 3, 2)
    assert min_p_value(speculative_samples(target, head, 1500, 3, 1, TREE), reference) > 1e-3
    without_top_k = speculative_samples(target, head, 1500, 3, 1, TREE, temperature=0.7, top_k=0)
    assert min_p_value(without_top_k, reference) < 1e-6


@pytest.mark.parametrize("config", [dict(), dict(do_sample=True), dict(do_sample=True, temperature=0.6, top_p=0.9),
                                    dict(do_sample=True, top_k=0, min_p=0.05), dict(repetition_penalty=1.2)])
@pytest.mark.parametrize("given", [dict(), dict(temperature=0.5), dict(temperature=0.0), dict(top_p=0.8)])
def test_settings_resolve_as_generate_resolves_them(config, given):
    """Sampling.for_target against the config `generate` itself prepares from the model's generation_config and
    the call's arguments (transformers' own defaults included: top_k 50 when the config sets none)."""
    target = tiny_target("llama")
    target.model.generation_config = GenerationConfig(**config)
    s = Sampling.for_target(target.model.generation_config, **given)
    kwargs = dict(given)
    if kwargs.get("temperature"):  # eyas samples whenever a temperature > 0 is given
        kwargs["do_sample"] = True
    if kwargs.get("temperature") == 0.0:
        kwargs = {"do_sample": False}
    gc, _ = target.model._prepare_generation_config(None, **kwargs)
    assert s.greedy == (not gc.do_sample)
    assert s.repetition_penalty == gc.repetition_penalty
    if gc.do_sample:
        assert (s.temperature, s.top_k, s.top_p, s.min_p) == (gc.temperature, gc.top_k, gc.top_p, gc.min_p or 0.0)


# ---- repetition penalty -------------------------------------------------------------------------------------
def test_penalty_at_every_node_is_transformers_on_that_nodes_sequence():
    """Each node's penalized logits equal transformers' RepetitionPenaltyLogitsProcessor over the history plus the
    node's path, tokens repeated along the path included."""
    g = torch.Generator().manual_seed(0)
    history = torch.tensor([[4, 5, 6, 4], [7, 7, 8, 9]])
    #                        root  a  b  a.a  a.c  a.a.b
    tokens = torch.tensor([[4, 5, 9, 5, 4, 9], [9, 9, 3, 9, 8, 3]])
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3]] * 2)
    depth = torch.tensor([[0, 1, 1, 2, 2, 3]] * 2)
    tree = DraftTree(tokens, parents, depth, torch.zeros(2, 6))
    anc = tree.ancestors()
    logits = torch.randn(2, 6, 12, generator=g) * 3
    seen = torch.zeros(2, 12, dtype=torch.bool)
    seen.scatter_(1, history, True)
    for penalty in (1.3, 0.7):
        ours = penalized(logits, tree, anc, seen, penalty)
        for b in range(2):
            for i in range(6):
                path = tokens[b][anc[b, i]]  # root .. node i, in tree order = depth order
                ids = torch.cat([history[b], path[1:]])[None]  # the root is the history's last token
                expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[b, i][None].clone())[0]
                torch.testing.assert_close(ours[b, i], expected)


@pytest.mark.parametrize("penalty", [1.3, 0.6])  # 0.6 < 1 favours repeats: draft paths repeat their own tokens
def test_greedy_with_a_repetition_penalty_matches_generate(penalty):
    target = family_target("qwen3")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42, 40, 41]]
    refs = [p + target.model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=24, pad_token_id=1,
                                      repetition_penalty=penalty)[0, len(p):].tolist() for p in prompts]
    gen = SpeculativeGenerator(target, OracleHead(target, refs), TreeOptions(kind="static", lookup=0))
    results = gen.generate_batch(prompts, max_new_tokens=24, repetition_penalty=penalty, **NO_EOS)
    assert [r.tokens for r in results] == [ref[len(p):] for p, ref in zip(prompts, refs)]
    assert [r.tokens for r in results] != [greedy(target, p, 24) for p in prompts]  # the penalty changed them
    cycles = []
    for r in results:
        start = 0
        for n in r.stats.accepted:
            cycles.append(r.tokens[start:start + n])
            start += n
    assert max(map(len, cycles)) >= 4
    if penalty < 1:
        assert any(len(set(c)) < len(c) for c in cycles), "some accepted path should repeat a token of its own"


def test_greedy_follows_the_generation_configs_repetition_penalty():
    target = family_target("llama")
    target.model.generation_config.repetition_penalty = 1.3
    prompt = list(range(10, 24))
    ref = prompt + target.model.generate(torch.tensor([prompt]), max_new_tokens=20, pad_token_id=1)[0, 14:].tolist()
    assert ref[14:] != greedy(target, prompt, 20)  # the config's penalty matters
    gen = SpeculativeGenerator(target, OracleHead(target, [ref]), TreeOptions(kind="static", lookup=0))
    assert gen.generate(prompt, max_new_tokens=20, **NO_EOS).tokens == ref[14:]


# ---- the statistics themselves ------------------------------------------------------------------------------
def test_chi2_p_value_separates_equal_from_different_counts():
    assert chi2_p_value(torch.tensor([[100, 200, 300], [102, 198, 300]])) > 0.9
    assert chi2_p_value(torch.tensor([[100, 200, 300], [200, 200, 200]])) < 1e-6


def test_top_k_and_top_p_shape_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert (target_distribution(logits, Sampling(1.0, top_k=2))[0, 2:] == 0).all()
    p = target_distribution(logits, Sampling(1.0, top_p=0.7))  # top token alone holds ~0.64 < 0.7
    assert (p[0, :2] > 0).all() and (p[0, 2:] == 0).all()
    with pytest.raises(ValueError, match="top_p"):
        Sampling(1.0, top_p=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_choice_is_argmax_on_ties_and_nan(dtype):
    """generate's greedy pick is torch.argmax: the first of equal maxima, a NaN's index where a row holds one."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (64, 3001), generator=gen).to(dtype)  # every row full of ties
    logits[5, 1234] = float("nan")
    logits[7] = 2.0
    for x in (logits, logits.t().contiguous().t(), logits[:, None]):
        assert torch.equal(choose(x, Sampling()), x.argmax(-1))
