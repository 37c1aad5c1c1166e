"""Greedy speculative decoding is token-identical to the target's own greedy decoding."""

import numpy as np
import pytest
import torch

from eyas.inference import SpeculativeGenerator, TreeOptions
from eyas.inference.drafter import HeadDrafter
from eyas.inference.tuning import Planner, chain_candidates, fit_cost, plan_tree
from inference_fixtures import NO_EOS, PROMPTS, Oracle, always_accept_first_child, greedy, make_head
from tiny import FIXTURES, tiny_target


@pytest.mark.parametrize("head_type", ["eagle1", "eagle3"])
@pytest.mark.parametrize("arch,tied", FIXTURES)
def test_greedy_matches_target_generate(arch, tied, head_type):
    target = tiny_target(arch, tied)
    gen = SpeculativeGenerator(target, make_head(target, head_type))
    for prompt in PROMPTS:
        ref = target.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, pad_token_id=1)
        assert gen.generate(prompt, max_new_tokens=16).tokens == ref[0, len(prompt):].tolist()


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
        inner = HeadDrafter(head, options.expansion())
        seen = []

        class Recorder:
            def reset(self):
                inner.reset()

            def draft(self, ctx):
                seen.append(ctx)
                tree = inner.draft(ctx)
                _check_scores(head, seen, tree)
                return tree

        # a verifier that accepts every first child makes each catch-up cover several tokens
        gen = SpeculativeGenerator(target, head, drafter=Recorder(), verifier=always_accept_first_child)
        gen.generate(PROMPTS[0], max_new_tokens=16, **NO_EOS)
        assert len(seen) > 2 and max(c.tokens.shape[1] for c in seen[1:]) > 1


def _check_scores(head, seen, tree):
    tokens = torch.cat([c.tokens for c in seen], 1)
    feats = torch.cat([c.features for c in seen], 1)
    pos = torch.cat([c.positions for c in seen], 1)
    d2t = head.draft_to_target.tolist()
    t2d = {t: d for d, t in enumerate(d2t)}
    with torch.no_grad():
        cache = head.new_cache()
        out = head(tokens, head.fuse(feats), pos, None, cache)
        base_len = len(cache)
        for i in range(1, tree.size):
            node, path = i, []
            while node > 0:
                path.append(node)
                node = int(tree.parents[0, node])
            path.reverse()
            cache.crop(base_len)
            logits, hidden, score = out.logits[:, -1:], out.hidden[:, -1:], 0.0
            for step, n in enumerate(path):
                tok = int(tree.tokens[0, n])
                score += float(torch.log_softmax(logits[0, -1].float(), -1)[t2d[tok]])
                if step + 1 < len(path):
                    mask = torch.ones(1, 1, len(cache) + 1, dtype=torch.bool)
                    o = head(torch.tensor([[tok]]), hidden, pos[:, -1:] + step + 1, mask, cache)
                    logits, hidden = o.logits, o.hidden
            assert abs(score - float(tree.scores[0, i])) < 1e-4, (i, score, float(tree.scores[0, i]))


def test_eos_and_stop_strings_end_generation():
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, make_head(target))
    ref = greedy(target, PROMPTS[0], 30)
    k = 9
    eos = ref[k]
    res = gen.generate(PROMPTS[0], max_new_tokens=30, eos_token_id=eos)
    assert res.tokens == ref[:ref.index(eos) + 1]
    word = target.tokenizer.decode([ref[k]])
    res = gen.generate(PROMPTS[0], max_new_tokens=30, stop=[word], **NO_EOS)
    first = next(j for j in range(30) if word in target.tokenizer.decode(ref[:j + 1]))
    assert res.tokens == ref[:first + 1] and res.text.endswith(word)


def test_stream_yields_the_generated_text_in_pieces():
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, make_head(target))
    pieces = list(gen.stream(PROMPTS[1], max_new_tokens=12, **NO_EOS))
    assert len(pieces) > 1
    assert "".join(pieces) == gen.generate(PROMPTS[1], max_new_tokens=12, **NO_EOS).text


def test_chat_messages_and_text_prompts():
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, make_head(target))
    messages = [{"role": "user", "content": "hello world"}]
    ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert gen.encode(messages) == ids
    assert gen.generate(messages, max_new_tokens=8, **NO_EOS).tokens == greedy(target, ids, 8)
    assert gen.encode("hello world") == target.tokenizer("hello world").input_ids
    with pytest.raises(ValueError, match="empty"):
        gen.generate([], max_new_tokens=4)


def test_auto_total_tokens_tunes_once_and_stays_exact():
    target = tiny_target("mistral")
    gen = SpeculativeGenerator(target, make_head(target), TreeOptions(total_tokens="auto", top_k=4, depth=5))
    res = gen.generate(PROMPTS[2], max_new_tokens=10, **NO_EOS)
    plan, planner = gen.plan, gen.planner
    assert plan.plain or (1 <= plan.depth <= 5 and 1 <= plan.total_tokens <= 4 + 4 * 4 * 4)
    assert res.tokens == greedy(target, PROMPTS[2], 10)
    assert gen.generate(PROMPTS[0], max_new_tokens=4).tokens and gen.planner is planner  # tuned once


def test_plan_tree_trades_gain_against_cost():
    depth = np.repeat(np.arange(1, 5), 4)  # 4 candidates per level
    sure, hopeless = np.ones(16), np.full(16, 1e-6)
    flat, steep = (1.0, 0.0), (0.0, 1.0)  # verify cost a + b * tokens
    assert (plan_tree(sure, depth, flat, 0.0, 4).total_tokens, plan_tree(sure, depth, flat, 0.0, 4).depth) == (16, 4)
    assert plan_tree(hopeless, depth, steep, 0.0, 4).total_tokens == 1
    assert plan_tree(sure, depth, steep, 0.0, 4).total_tokens < 16
    # a chain with falling acceptance, on a CPU-like curve: stop where one more draft costs more than it gains
    p, d = chain_candidates([0.8, 0.6, 0.4, 0.2])
    plan = plan_tree(p, d, (1.0, 0.1), 0.05, 4)
    by_depth = {k: (1 + p[:k].sum()) / (k * 0.05 + 1.0 + 0.1 * (k + 1)) for k in range(1, 5)}
    assert plan.depth == plan.total_tokens == max(by_depth, key=by_depth.get)
    assert plan.expected_tokens == pytest.approx(1 + p[:plan.depth].sum())


def test_plan_tree_prefers_plain_decoding_when_no_tree_pays():
    depth = np.repeat(np.arange(1, 4), 4)
    weak, sure = np.full(12, 0.05), np.ones(12)
    assert plan_tree(weak, depth, (1.0, 0.1), 0.05, 3, plain_s=1.1).plain
    plan = plan_tree(sure, depth, (1.0, 0.1), 0.05, 3, plain_s=1.1)
    assert not plan.plain and plan.tokens_per_s > 1 / 1.1


def test_planner_follows_observed_acceptance_and_probes_while_plain():
    depth = np.repeat(np.arange(1, 4), 4)
    conf = np.repeat([0.2, 0.1, 0.05], 4)  # per node; a level sums to at most 1, like real siblings
    planner = Planner(conf, depth, (1.0, 0.1), 0.01, 1.1, 3)
    assert not planner.plan.plain  # the head's confidence alone says a tree pays
    drafted = planner.plan
    node_conf, node_depth = conf[None, :drafted.total_tokens], depth[None, :drafted.total_tokens]
    for _ in range(10):  # ...but nothing is ever accepted: plain decoding takes over
        planner.observe(node_conf, node_depth, np.zeros(1))
        if planner.plan.plain:
            break
    assert planner.plan.plain
    gaps, since = [], 0
    for _ in range(40):  # probes keep coming, further apart while they confirm plain
        plan = planner.next()
        since += 1
        if not plan.plain:
            gaps.append(since)
            since = 0
            planner.observe(node_conf, node_depth, np.zeros(1))
    assert len(gaps) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]
    for _ in range(30):  # everything drafted is accepted: back to trees; the head proves underconfident
        planner.observe(node_conf, node_depth, np.full(1, drafted.depth))
    assert not planner.plan.plain and planner.calibration()[0] > 1


def test_plain_cycles_keep_greedy_identity_and_the_head_catches_up():
    """With plain decoding planned, the probes' catch-up covers every token since the last draft."""
    target = tiny_target("llama")
    head = make_head(target, "eagle3")
    gen = SpeculativeGenerator(target, head, TreeOptions(total_tokens="auto", top_k=3, depth=3))
    gen.generate(PROMPTS[1], max_new_tokens=4, **NO_EOS)  # tunes
    # a tree verify costs ~10x a plain step here: plain decoding wins, probes still draft now and then
    gen.planner = Planner(np.full(9, 0.3), np.repeat(np.arange(1, 4), 3), (1.0, 0.0), 0.0, 0.1, 3)
    seen, inner = [], gen.drafter.draft

    def draft(ctx):
        seen.append(ctx)
        tree = inner(ctx)
        _check_scores(head, seen, tree)
        return tree

    gen.drafter.draft = draft
    res = gen.generate(PROMPTS[0], max_new_tokens=24, **NO_EOS)
    assert res.tokens == greedy(target, PROMPTS[0], 24)
    assert res.stats.drafted.count(0) > len(seen) >= 2  # mostly plain, a few probes
    assert min(c.tokens.shape[1] for c in seen[1:]) > 1  # each probe caught up on the plain cycles before it


def test_fit_cost_is_affine_and_never_rewards_noise():
    assert fit_cost({1: 2.0, 2: 3.0, 4: 5.0}) == pytest.approx((1.0, 1.0))
    a, b = fit_cost({1: 3.0, 8: 1.0, 16: 1.0})  # a lucky big forward must not make big trees look free
    assert b == 0.0 and a == pytest.approx(5 / 3)


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
    assert rows_per_forward[0] == 3 and rows_per_forward[-1] == 2 and sorted(rows_per_forward, reverse=True) == rows_per_forward
    assert len(res[1].stats.accepted) < len(res[0].stats.accepted)
