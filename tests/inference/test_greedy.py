"""Greedy speculative decoding is token-identical to the target's own greedy decoding."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from eyas.inference import GenerationStats, SpeculativeGenerator, TreeOptions
from eyas.inference.bench import plain_decode
from eyas.inference.costs import CostModel
from eyas.inference.drafting import TreeDrafter
from eyas.inference.planner import Planner
from eyas.models.drafters import NAMES
from eyas.models.masks import causal
from eyas.models.sampling import Sampling
from tests.helpers.inference import (
    NO_EOS,
    PROMPTS,
    Oracle,
    always_accept_first_child,
    assert_drafts_verified,
    greedy,
    make_head,
)
from tests.helpers.tiny import FIXTURES, tiny_target

# A fixed tree size: every cycle verifies drafts, however fast this machine is (`auto` lets the planner verify
# none when a tree verify does not pay here, and the identity checks would cover plain decoding alone).
DRAFTING = TreeOptions(total_tokens=8)


@pytest.mark.parametrize("head_type", NAMES)  # every drafter algorithm
@pytest.mark.parametrize("arch,tied", FIXTURES)
def test_greedy_matches_target_generate(arch, tied, head_type):
    target = tiny_target(arch, tied)
    gen = SpeculativeGenerator(target, make_head(target, head_type), DRAFTING)
    results = []
    for prompt in PROMPTS:
        ref = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, pad_token_id=1)
        results.append(gen.generate(prompt, max_new_tokens=16))
        assert results[-1].tokens == ref[0, len(prompt):].tolist()
    assert_drafts_verified(results)


@pytest.mark.parametrize("options", [
    TreeOptions(kind="chain", depth=1), TreeOptions(kind="chain", depth=6), TreeOptions(kind="static"),
    TreeOptions(kind="static", paths=((0,), (1,), (1, 0), (1, 1), (1, 1, 2))),
    TreeOptions(total_tokens=1), TreeOptions(total_tokens=7, top_k=2, depth=3),
    TreeOptions(total_tokens=16), TreeOptions(total_tokens=64, top_k=8, depth=6),
], ids=lambda o: f"{o.kind}-{o.total_tokens if o.kind == 'dynamic' else o.depth}")
def test_greedy_identity_across_tree_shapes(options):
    target = tiny_target("qwen3")
    gen = SpeculativeGenerator(target, make_head(target), options)
    results = gen.generate_batch(PROMPTS, max_new_tokens=20, **NO_EOS)
    for prompt, res in zip(PROMPTS, results):
        assert res.tokens == greedy(target, prompt, 20)
    assert_drafts_verified(results)


@pytest.mark.parametrize("arch,tied", FIXTURES)
def test_perfect_draft_accepts_every_token(arch, tied):
    target = tiny_target(arch, tied)
    depth = 4
    refs = [p + greedy(target, p, 40) for p in PROMPTS]
    gen = SpeculativeGenerator(target, make_head(target), TreeOptions(lookup=0),  # exactly the oracle's tree
                               drafter=Oracle(refs, depth, decoy=arch == "llama"))
    results = gen.generate_batch(PROMPTS, max_new_tokens=30, **NO_EOS)
    for prompt, ref, res in zip(PROMPTS, refs, results):
        assert res.tokens == ref[len(prompt):len(prompt) + 30]
        assert res.stats.accepted and all(a == depth + 1 for a in res.stats.accepted), res.stats.accepted


@pytest.mark.parametrize("arch,tied", FIXTURES)
def test_batch_rows_accept_different_lengths_and_match_alone(arch, tied):
    target = tiny_target(arch, tied)
    refs = [p + greedy(target, p, 45) for p in PROMPTS]
    gen = SpeculativeGenerator(target, make_head(target), drafter=Oracle(refs, 5, corrupt=0.7, decoy=True, seed=3))
    results = gen.generate_batch(PROMPTS, max_new_tokens=32, **NO_EOS)
    for prompt, ref, res in zip(PROMPTS, refs, results):
        assert res.tokens == ref[len(prompt):len(prompt) + 32]
    per_cycle = list(zip(*(r.stats.accepted for r in results)))
    assert any(len(set(c)) > 1 for c in per_cycle), "rows should have accepted different lengths"


def test_head_drafter_matches_the_head_run_step_by_step():
    """Every node's cumulative draft score equals running the head along that node's path alone,
    in every cycle: checks catch-up, the head-cache masks, positions and fed-back hidden states."""
    target = tiny_target("llama")
    head = make_head(target, "eagle3")
    for options in [TreeOptions(total_tokens=12, top_k=3, depth=4), TreeOptions(kind="static")]:
        recorder = _Recorder(head, TreeDrafter(head, options.expansion()))
        # a verifier that accepts every first child makes each catch-up cover several tokens
        gen = SpeculativeGenerator(target, head, drafter=recorder, verifier=always_accept_first_child)
        gen.generate(PROMPTS[0], max_new_tokens=16, **NO_EOS)
        seen = recorder.seen
        assert len(seen) > 2 and max(c.counts[0] for c in seen[1:]) > 1


class _Recorder:
    """A drafter that checks every draft of the one it wraps against the head run path by path."""

    def __init__(self, head, inner):
        self.head, self.inner, self.seen = head, inner, []

    def reset(self, batch, capacity):
        self.inner.reset(batch, capacity)

    def keep_rows(self, order):
        self.inner.keep_rows(order)

    def draft(self, ctx, depth=None, keep_going=None):
        self.seen.append(ctx)
        candidates = self.inner.draft(ctx, depth, keep_going)
        _check_scores(self.head, self.seen, candidates.tree())
        return candidates


def _check_scores(head, seen, tree):
    """Row 0 of each context seen so far, run through the head at once, then each node's path alone."""
    tokens = torch.cat([c.tokens[:, :c.counts[0]] for c in seen], 1)[:1]
    feats = torch.cat([c.features[:, :c.counts[0]] for c in seen], 1)[:1]
    pos = torch.cat([c.positions[:, :c.counts[0]] for c in seen], 1)[:1]
    d2t = head.draft_to_target.tolist()
    t2d = {t: d for d, t in enumerate(d2t)}
    with torch.no_grad():
        cache = head.new_cache(1, tokens.shape[1] + 16)
        out = head(tokens, head.fuse(feats), pos, causal(tokens.shape[1])[None], cache)
        cache.commit([tokens.shape[1]])
        for i in range(1, tree.size):
            node, path = i, []
            while node > 0:
                path.append(node)
                node = int(tree.parents[0, node])
            path.reverse()
            cache.rollback()
            logits, hidden, score = out.logits[:, -1:], out.hidden[:, -1:], 0.0
            for step, n in enumerate(path):
                tok = int(tree.tokens[0, n])
                score += float(torch.log_softmax(logits[0, -1].float(), -1)[t2d[tok]])
                if step + 1 < len(path):
                    mask = torch.ones(1, 1, cache.width + 1, dtype=torch.bool)
                    o = head(torch.tensor([[tok]]), hidden, pos[:, -1:] + step + 1, mask, cache)
                    logits, hidden = o.logits, o.hidden
            assert abs(score - float(tree.scores[0, i])) < 1e-4, (i, score, float(tree.scores[0, i]))


def test_eos_and_stop_strings_end_generation():
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, make_head(target), DRAFTING)
    ref = greedy(target, PROMPTS[0], 30)
    k = 9
    eos = ref[k]
    res = gen.generate(PROMPTS[0], max_new_tokens=30, eos_token_id=eos)
    assert res.tokens == ref[:ref.index(eos) + 1]
    word = target.tokenizer.decode([ref[k]])
    stopped = gen.generate(PROMPTS[0], max_new_tokens=30, stop=[word], **NO_EOS)
    first = next(j for j in range(30) if word in target.tokenizer.decode(ref[:j + 1]))
    assert stopped.tokens == ref[:first + 1] and stopped.text.endswith(word)
    assert_drafts_verified([res, stopped])


def test_stream_yields_the_generated_text_in_pieces():
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, make_head(target), DRAFTING)
    stats = GenerationStats()
    pieces = list(gen.stream(PROMPTS[1], max_new_tokens=12, stats=stats, **NO_EOS))
    assert len(pieces) > 1
    assert "".join(pieces) == gen.generate(PROMPTS[1], max_new_tokens=12, **NO_EOS).text
    assert_drafts_verified([stats])


def test_chat_messages_and_text_prompts():
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, make_head(target), DRAFTING)
    messages = [{"role": "user", "content": "hello world"}]
    ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert gen.encode(messages) == ids
    res = gen.generate(messages, max_new_tokens=8, **NO_EOS)
    assert res.tokens == greedy(target, ids, 8)
    assert_drafts_verified([res])
    assert gen.encode("hello world") == target.tokenizer("hello world").input_ids
    with pytest.raises(ValueError, match="empty"):
        gen.generate([], max_new_tokens=4)


def test_auto_total_tokens_tunes_once_and_stays_exact(calibrations):
    """The first generation measures this machine's costs, once; the planner's trees keep greedy identity (planned
    with fixed costs under which trees pay: conftest.calibrations)."""
    measured = calibrations
    target = tiny_target("mistral")
    gen = SpeculativeGenerator(target, make_head(target), TreeOptions(total_tokens="auto", top_k=4, depth=5))
    res = gen.generate(PROMPTS[2], max_new_tokens=10, **NO_EOS)
    planner = gen.planner
    assert planner is not None and len(measured) == 1 and measured[0].verify(0, 0) > 0
    assert all(0 <= n <= 4 + 4 * 4 * 4 + gen.options.lookup for n in res.stats.drafted)
    assert res.tokens == greedy(target, PROMPTS[2], 10)
    assert_drafts_verified([res], accepted=False)  # a random head
    assert gen.generate(PROMPTS[0], max_new_tokens=4).tokens and gen.planner is planner  # tuned once
    assert len(measured) == 1


def test_plain_cycles_keep_greedy_identity_and_the_head_catches_up():
    """With drafting not paying, the probes' catch-up covers every token since the last draft."""
    target = tiny_target("llama")
    head = make_head(target, "eagle3")
    gen = SpeculativeGenerator(target, head, TreeOptions(total_tokens="auto", top_k=3, depth=3))
    gen.generate(PROMPTS[1], max_new_tokens=4, **NO_EOS)  # tunes
    # a tree verify costs ~10x a plain step here: plain decoding wins, probes still draft now and then (a wide
    # margin lets the guard afford them within 24 tokens)
    gen.planner = Planner(CostModel(1.0, 0.0, 0.1, 0.01, learn=False), max_depth=3, top_k=3, margin=2.0)
    seen, inner = [], gen.drafter.draft

    def draft(ctx, depth=None, keep_going=None):
        seen.append(ctx)
        candidates = inner(ctx, depth, keep_going)
        _check_scores(head, seen, candidates.tree())
        return candidates

    gen.drafter.draft = draft
    res = gen.generate(PROMPTS[0], max_new_tokens=24, **NO_EOS)
    assert res.tokens == greedy(target, PROMPTS[0], 24)
    assert res.stats.drafted.count(0) > len(seen) >= 2  # mostly plain, a few probes
    # a probe catches up on every plain cycle before it (_check_scores: the head saw every token once, in order)
    assert max(c.counts[0] for c in seen[1:]) > 1
    assert sum(c.counts[0] for c in seen) <= len(PROMPTS[0]) + len(res.tokens)


def test_too_long_request_is_refused():
    target = tiny_target("llama")  # max_position_embeddings 512
    gen = SpeculativeGenerator(target, make_head(target))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        gen.generate(PROMPTS[0], max_new_tokens=510)


def test_finished_rows_leave_the_batch():
    target = tiny_target("qwen3")
    refs = [greedy(target, p, 20) for p in PROMPTS]
    # an eos that ends row 1 within a few tokens and never appears in the other rows' outputs
    eos = next(t for t in refs[1][:6] if all(t not in r for i, r in enumerate(refs) if i != 1))
    target.verify_mode()  # its one-time check runs forwards of its own
    rows_per_forward = []
    forward = target.forward

    def counting_forward(input_ids, *args, **kwargs):
        rows_per_forward.append(input_ids.shape[0])
        return forward(input_ids, *args, **kwargs)

    target.forward = counting_forward
    # no lookup branches: rows 0 and 2 must still be decoding when row 1 ends
    gen = SpeculativeGenerator(target, make_head(target), TreeOptions(total_tokens=4, depth=2, lookup=0))
    res = gen.generate_batch(PROMPTS, max_new_tokens=20, eos_token_id=eos)
    assert res[1].tokens == refs[1][:refs[1].index(eos) + 1]
    assert res[0].tokens == refs[0] and res[2].tokens == refs[2]
    assert_drafts_verified(res, accepted=False)  # a random head, no lookup: acceptance is not the point here
    assert rows_per_forward[0] == 3 and rows_per_forward[-1] == 2
    assert sorted(rows_per_forward, reverse=True) == rows_per_forward
    assert len(res[1].stats.accepted) < len(res[0].stats.accepted)


class _DeviceReads(TorchFunctionMode):
    """Counts the calls that copy a tensor's values to the host: on a GPU, each one waits for the queue."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.READS and func.__name__ != "numpy"  # .cpu().numpy(): one
        return func(*args, **(kwargs or {}))


def test_a_cycle_reads_the_device_once_plus_once_per_planning_step():
    """A plain cycle reads the device once, as plain decoding does per token (the prefill once, for the first
    token); a drafting cycle adds one read per level the planner decides on, one for the tree size and one for
    what its candidates turned out to be."""
    target = tiny_target("llama")
    depth = 4
    gen = SpeculativeGenerator(target, make_head(target), TreeOptions(depth=depth, lookup=0))
    gen.generate(PROMPTS[0], max_new_tokens=4, **NO_EOS)
    drafts, inner = [], gen.drafter.draft
    gen.drafter.draft = lambda *a, **kw: drafts.append(1) or inner(*a, **kw)
    never = Planner(CostModel(1.0, 0.1, 1.0, 0.05, learn=False), depth, margin=0.0, slack=0.0)
    cheap = Planner(CostModel(1.0, 0.01, 1.0, 0.001, learn=False), depth, slack=1e9)  # drafting always affordable
    for planner in (never, cheap):
        gen.planner = planner
        drafts.clear()
        with _DeviceReads() as reads:
            res = gen.generate(PROMPTS[0], max_new_tokens=30, **NO_EOS)
        cycles = len(res.stats.accepted)
        assert (len(drafts) >= 3) if planner is cheap else (not drafts and reads.count == 1 + cycles == 30)
        assert reads.count <= 1 + cycles + len(drafts) * (depth - 1 + 2)
    with _DeviceReads() as reads:
        plain_decode(target, PROMPTS[0], 30, [], Sampling(), 0)
    assert reads.count == 30
