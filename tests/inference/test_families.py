"""The exactness matrix: on tiny random targets of every family in tests/helpers/families.py, speculative
decoding is token-identical to the model's own `generate` (greedy, fp32) for chains, static and dynamic trees
and batches of prompts of different lengths (longer than the models' attention windows, and of one and two
tokens, alone and at every place in a batch), with a random head of every drafter algorithm; the target's
logits are the model's own; sampling keeps the model's distribution where its CausalLM post-processes logits."""

import functools
import random

import pytest
import torch

from eyas.inference import SpeculativeGenerator, TreeOptions
from eyas.models.drafters import NAMES
from eyas.models.errors import Unsupported
from eyas.models.masks import after_history
from eyas.models.target import Target
from tests.helpers.families import FAMILIES, WINDOW, family_target
from tests.helpers.inference import NO_EOS, OracleHead, assert_drafts_verified, make_head
from tests.helpers.stored import FP32_NOISE

NEW = 20  # new tokens per prompt
# prompt lengths: the first three longer than the windows, rows differ in length; then one token (no context
# before the first root) and two
LENGTHS = (13, 21, 10, 1, 2)
ONE, TWO = 3, 4  # their indices in PROMPTS


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


CHAIN = TreeOptions(kind="chain", depth=5, lookup=0)
STATIC = TreeOptions(kind="static", lookup=0)
DYNAMIC = TreeOptions(kind="dynamic", total_tokens=10, top_k=3, depth=5)  # + n-gram lookup
CASES = {  # case -> (tree options, prompts: indices into PROMPTS)
    "chain-single": (CHAIN, [0]),  # a uniform cache: the model's own masks
    "chain-batch": (CHAIN, [0, 1, 2]),
    "static-batch": (STATIC, [0, 1, 2]),
    "dynamic-batch": (DYNAMIC, [1, 2, 0]),
    # short prompts alone, and first, in the middle and last of a batch (each tree kind has one of them)
    "chain-one": (CHAIN, [ONE]),
    "chain-two": (CHAIN, [TWO]),
    "static-short-first": (STATIC, [ONE, 0, TWO]),
    "dynamic-short-middle": (DYNAMIC, [TWO, ONE, 1]),
    "chain-short-last": (CHAIN, [2, TWO, ONE]),
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
    deep = 5 if len(rows) > 1 else 4  # one row's 20 tokens give the oracle's misses fewer long stretches between them
    assert sum(accepted) / len(accepted) > 2 and max(accepted) >= deep, f"long paths should be accepted: {accepted}"


@pytest.mark.parametrize("family", FAMILIES)
def test_fixed_shape_steps_match_generate(family):
    """Fixed-shape steps (a GPU's CUDA-graph steps, here eager): every step attends over the cache's whole capacity
    under eyas's mask and pads its tokens to a power of two, and a ragged batch of trees stays token-identical."""
    target, refs = setup(family)
    fixed = Target(target.model, target.tokenizer, target.name_or_path, fixed_shapes=True)
    options, rows = CASES["dynamic-short-middle"]
    results = SpeculativeGenerator(fixed, OracleHead(fixed, [refs[i] for i in rows]), options).generate_batch(
        [PROMPTS[i] for i in rows], max_new_tokens=NEW, **NO_EOS)
    assert [r.tokens for r in results] == [refs[i][len(PROMPTS[i]):] for i in rows]
    assert_drafts_verified(results)


def refused(family: str, head, target) -> bool:
    """A head that reads states inside the decoder, on a family whose layers pass several streams (Gemma 3n's AltUp;
    its tests draft with eagle1, which reads the decoder's output): the target refuses its features."""
    return FAMILIES[family].head == "eagle1" and any(i < target.num_layers for i in head.reads(target.num_layers))


# every drafter algorithm but the oracle head's own (EAGLE-1), whose drafting the cases above cover
DRAFTERS = [name for name in NAMES if name != OracleHead.algorithm.name]


@pytest.mark.parametrize("head_type", DRAFTERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_generate_with_a_random_head(family, head_type):
    """A random head of each drafter algorithm (trees grown level by level, or a block of positions from one
    forward) drafts for a ragged batch that starts with a one-token prompt."""
    target, refs = setup(family)
    head = make_head(target, head_type)
    rows, n = [ONE, 0, TWO], 12  # 12 new tokens: every row still passes the windows
    gen = SpeculativeGenerator(target, head, TreeOptions(total_tokens=8, depth=4))
    if refused(family, head, target):
        with pytest.raises(Unsupported, match="eagle1"):
            gen.generate_batch([PROMPTS[i] for i in rows], max_new_tokens=n, **NO_EOS)
        return
    results = gen.generate_batch([PROMPTS[i] for i in rows], max_new_tokens=n, **NO_EOS)
    assert [r.tokens for r in results] == [refs[i][len(PROMPTS[i]):len(PROMPTS[i]) + n] for i in rows]
    assert_drafts_verified(results, accepted=False)  # a random head



@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_generate_with_a_random_head_and_the_planner(family, calibrations):
    """The planner measures this machine on the first generation's first prompt, here one token alone (no token
    before the root for the head to catch up on), then chooses every cycle's tree, in a ragged batch next."""
    target, refs = setup(family)
    gen = SpeculativeGenerator(target, make_head(target, FAMILIES[family].head), TreeOptions(depth=4))
    results = gen.generate_batch([PROMPTS[ONE]], max_new_tokens=NEW, **NO_EOS)
    results += gen.generate_batch([PROMPTS[i] for i in (ONE, 0, TWO)], max_new_tokens=NEW, **NO_EOS)
    assert [r.tokens for r in results] == [refs[i][len(PROMPTS[i]):] for i in (ONE, ONE, 0, TWO)]
    assert len(calibrations) == 1  # once per generator
    assert_drafts_verified(results, accepted=False)  # a random head
    # trees of several sizes, as the planner chose (a chain-verifying target: the chain cut where the plan stops paying)
    assert len({n for r in results for n in r.stats.drafted}) > (1 if target.verify_mode() == "chain" else 2)


# plain attention, sliding + full layers, an eagle1 family (KV shared across layers), learned positions, chains only
FUZZED = ["llama", "qwen2-swa", "gemma3n", "gpt2", "falcon-alibi"]


@pytest.mark.parametrize("family", FUZZED)
def test_greedy_matches_generate_on_random_prompt_lengths(family):
    """Batches of random sizes, prompt lengths (mostly short) and tree shapes, seeded."""
    target, _ = setup(family)
    rng = random.Random(family)
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    for _ in range(3):
        lengths = [rng.choice([1, 1, 2, 2, 3, rng.randint(4, 24)]) for _ in range(rng.randint(1, 4))]
        prompts = [torch.randint(4, 300, (n,), generator=g).tolist() for n in lengths]
        refs = [p + model_generate(target.model, p, 12) for p in prompts]
        options = rng.choice([CHAIN, STATIC, DYNAMIC])
        gen = SpeculativeGenerator(target, OracleHead(target, refs), options)
        results = gen.generate_batch(prompts, max_new_tokens=12, **NO_EOS)
        assert [r.tokens for r in results] == [ref[len(p):] for p, ref in zip(prompts, refs)], (lengths, options)
        assert_drafts_verified(results)


@pytest.mark.parametrize("family", FAMILIES)
def test_target_logits_are_the_models_own(family):
    """Target logits equal the model's own forward, in one forward and at every node of a draft tree verified
    after a history longer than the windows (tree-verifying targets)."""
    target, _ = setup(family)
    ids = torch.tensor([PROMPTS[0], PROMPTS[1][:len(PROMPTS[0])]])
    # eyas's products sum in another order than the model's own, and a logit scale (Granite multiplies by 4) scales
    # that rounding: FP32_NOISE bounds it, far below what a wrong mask or position changes
    torch.testing.assert_close(target(ids).logits, target.model(ids).logits, rtol=1e-5, atol=FP32_NOISE)
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
        torch.testing.assert_close(logits[0, i], alone, rtol=1e-5, atol=FP32_NOISE)
