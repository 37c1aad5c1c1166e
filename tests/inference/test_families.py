"""The exactness matrix: on tiny random targets of every family in tests/helpers/families.py, speculative
decoding is token-identical to the model's own `generate` (greedy, fp32) for chains, static and dynamic trees
and batches of prompts of different lengths, all longer than the models' attention windows; the target's
logits are the model's own; sampling keeps the model's distribution where its CausalLM post-processes logits."""

import functools

import pytest
import torch

from eyas.inference import SpeculativeGenerator, TreeOptions
from eyas.inference.costs import CostModel
from eyas.models.masks import after_history
from tests.helpers.families import FAMILIES, WINDOW, family_target
from tests.helpers.inference import NO_EOS, OracleHead, assert_drafts_verified, make_head

NEW = 20  # new tokens per prompt
LENGTHS = (13, 21, 10)  # prompt lengths: every prompt is longer than the windows, rows differ in length


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 300, (n,), generator=g).tolist() for n in LENGTHS]


PROMPTS = _prompts()


def model_generate(model, prompt: list[int], n: int) -> list[int]:
    """The model's own greedy `generate` of n new tokens after `prompt` alone."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         pad_token_id=1)
    return out[0, len(prompt):].tolist()


@functools.lru_cache(maxsize=None)
def setup(name: str):
    """(target, each prompt + the model's own continuation); kept for the module, the target is never changed."""
    target = family_target(name)
    return target, [p + model_generate(target.model, p, NEW) for p in PROMPTS]


CASES = {  # case -> (tree options, prompts: indices into PROMPTS)
    "chain-single": (TreeOptions(kind="chain", depth=5, lookup=0), [0]),  # a uniform cache: the model's own masks
    "chain-batch": (TreeOptions(kind="chain", depth=5, lookup=0), [0, 1, 2]),
    "static-batch": (TreeOptions(kind="static", lookup=0), [0, 1, 2]),
    "dynamic-batch": (TreeOptions(kind="dynamic", total_tokens=10, top_k=3, depth=5), [1, 2, 0]),  # + n-gram lookup
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_generate(family, case):
    target, refs = setup(family)
    options, rows = CASES[case]
    refs = [refs[i] for i in rows]
    gen = SpeculativeGenerator(target, OracleHead(target, refs), options)
    results = gen.generate_batch([PROMPTS[i] for i in rows], max_new_tokens=NEW, **NO_EOS)
    for i, ref, res in zip(rows, refs, results):
        assert res.tokens == ref[len(PROMPTS[i]):], f"row {i}"
    accepted = [a for r in results for a in r.stats.accepted]
    assert sum(accepted) / len(accepted) > 2 and max(accepted) >= 5, f"long paths should be accepted: {accepted}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_generate_with_a_random_head_and_the_planner(family):
    target, refs = setup(family)
    head = make_head(target, FAMILIES[family].head)
    # fixed costs under which trees pay: the planner's trees then follow the head's confidence, not how loaded this
    # machine is (measured costs may make every cycle plain decoding)
    gen = SpeculativeGenerator(target, head, TreeOptions(total_tokens="auto", depth=4),
                               costs=CostModel(1.0, 0.01, 1.0, 0.001, learn=False))
    results = gen.generate_batch(PROMPTS, max_new_tokens=NEW, **NO_EOS)
    assert [r.tokens for r in results] == [ref[len(p):] for p, ref in zip(PROMPTS, refs)]
    assert_drafts_verified(results, accepted=False)  # a random head
    assert len({n for r in results for n in r.stats.drafted}) > 2  # trees of several sizes, as the planner chose


@pytest.mark.parametrize("family", FAMILIES)
def test_target_logits_are_the_models_own(family):
    """Target logits equal the model's own forward, in one forward and at every node of a draft tree verified
    after a history longer than the windows (tree-verifying targets)."""
    target, _ = setup(family)
    ids = torch.tensor([PROMPTS[0], PROMPTS[1][:len(PROMPTS[0])]])
    torch.testing.assert_close(target(ids).logits, target.model(ids).logits, rtol=1e-5, atol=1e-5)
    assert target.verify_mode() == FAMILIES[family].verify  # eyas's masks hold: no needless fall-back to chains
    if target.verify_mode() != "tree":
        return
    history = torch.tensor([PROMPTS[1]])  # 21 tokens > WINDOW
    parents = [-1, 0, 0, 1, 1, 3]  # the root, two children, grandchildren, one great-grandchild
    nodes = torch.tensor([[7, 8, 9, 10, 11, 12]])
    depth = torch.tensor([[0, 1, 1, 2, 2, 3]])
    block = torch.zeros(1, 6, 6, dtype=torch.bool)
    for i in range(6):
        j = i
        while j >= 0:
            block[0, i, j], j = True, parents[j]
    cache = target.new_cache(1, 32)
    target(history, cache=cache, logits=False)
    cache.commit([history.shape[1]])
    logits = target(nodes, history.shape[1] + depth, cache, after_history(cache.lengths, block, cache.width + 6)).logits
    assert history.shape[1] > WINDOW
    for i in range(6):
        path = [j for j in range(6) if block[0, i, j]]
        alone = target.model(torch.cat([history, nodes[:, path]], 1)).logits[0, -1]
        torch.testing.assert_close(logits[0, i], alone, rtol=1e-5, atol=1e-5)
