"""Speculative sampling keeps the target's distribution; a biased verifier is caught by the same test."""

import pytest
import torch
from transformers import DynamicCache

from eyas.inference import SpeculativeGenerator, TreeOptions
from eyas.inference.sampling import Sampling
from eyas.inference.sampling import distribution as target_distribution
from eyas.models import DraftHead, head_config_for
from tests.helpers.inference import always_accept_first_child
from tests.helpers.tiny import tiny_target

PROMPT = [5, 6, 7, 8, 9]
N, STEPS, VOCAB = 1500, 3, 16
SETTINGS = [Sampling(1.0), Sampling(1.0, top_k=6), Sampling(0.8, top_p=0.7)]


def _setup():
    # a small vocabulary, so that a random head's top-k children often hold the target's choice
    target = tiny_target("llama", vocab_size=VOCAB)
    with torch.no_grad():
        target.lm_head.weight.mul_(3)
    torch.manual_seed(0)
    head = DraftHead(head_config_for(target, "eagle3"), target)
    return target, head


def plain_samples(target, s: Sampling, seed: int) -> torch.Tensor:
    """[N, STEPS] tokens sampled from the target one step at a time."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([PROMPT]).expand(N, -1)
    cache, out = DynamicCache(config=target.model.config), []
    with torch.no_grad():
        for _ in range(STEPS):
            p = target_distribution(target.model(ids, cache=cache, use_cache=True).logits[:, -1], s)
            ids = torch.multinomial(p, 1, generator=gen)
            out.append(ids)
    return torch.cat(out, 1)


def speculative_samples(target, head, s: Sampling, seed: int, **kw) -> torch.Tensor:
    gen = SpeculativeGenerator(target, head, TreeOptions(total_tokens=12, top_k=5, depth=3), **kw)
    res = gen.generate_batch([PROMPT] * N, max_new_tokens=STEPS, temperature=s.temperature, top_p=s.top_p,
                             top_k=s.top_k, seed=seed, eos_token_id=[])
    assert sum(sum(r.stats.accepted) for r in res) > 1.2 * sum(len(r.stats.accepted) for r in res), \
        "drafts should often be accepted, else the test only exercises the bonus token"
    return torch.tensor([r.tokens for r in res])


def chi2_p_value(table: torch.Tensor) -> float:
    """Pearson chi-square test of homogeneity on a [2, K] count table: P(statistic this large | same law)."""
    table = table.double()
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2))  # chi2 survival


def min_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Smallest chi-square p-value over each step's marginal and the (step 1, step 2) pair."""
    def table(x, y):
        size = int(max(x.max(), y.max())) + 1
        counts = torch.stack([torch.bincount(x, minlength=size), torch.bincount(y, minlength=size)])
        return counts[:, counts.sum(0) >= 10]  # drop cells too rare for chi-square

    columns = [(a[:, i], b[:, i]) for i in range(STEPS)] + [(a[:, 0] * VOCAB + a[:, 1], b[:, 0] * VOCAB + b[:, 1])]
    return min(chi2_p_value(table(x, y)) for x, y in columns)


@pytest.mark.parametrize("s", SETTINGS, ids=["t1", "t1-topk6", "t0.8-topp0.7"])
def test_speculative_sampling_matches_target_sampling(s):
    target, head = _setup()
    assert min_p_value(speculative_samples(target, head, s, seed=1), plain_samples(target, s, seed=2)) > 1e-3


def test_biased_verifier_is_detected():
    target, head = _setup()
    s = SETTINGS[0]
    biased = speculative_samples(target, head, s, seed=1, verifier=always_accept_first_child)
    assert min_p_value(biased, plain_samples(target, s, seed=2)) < 1e-6


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
