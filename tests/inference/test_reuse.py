"""One generator serves many calls: `eyas chat` streams every turn, `eyas bench` decodes every question with the
generator it loaded once. Whatever a generation leaves behind (the drafter and the head's cache, the planner and
what it learned, the tree's expansion) must not change the next one: for every tree kind and every drafter
algorithm, each public entry point runs twice on one generator and gives the target's own greedy continuation
both times; chat and bench do so through their real entry points."""

import functools

import pytest
import torch

from eyas.inference import GenerationStats, SpeculativeGenerator, TreeOptions
from eyas.inference.bench import Question, prompt_ids, run_bench
from eyas.inference.cli import main
from eyas.models import save_head
from eyas.models.drafters import NAMES
from tests.helpers.families import family_target
from tests.helpers.inference import NO_EOS, PROMPTS, assert_drafts_verified, greedy, make_head
from tests.helpers.tiny import tiny_target

NEW = 10  # new tokens per prompt
KINDS = {
    "dynamic-auto": TreeOptions(total_tokens="auto", depth=4),  # the planner: calibrated on the first call, kept
    "dynamic-fixed": TreeOptions(total_tokens=8, depth=4),
    "static-default": TreeOptions(kind="static"),
    "static-custom": TreeOptions(kind="static", paths=((0,), (1,), (0, 0), (0, 1), (1, 0))),
    "chain": TreeOptions(kind="chain", depth=4),
}


@functools.lru_cache(maxsize=None)
def setup():
    """(target, each of PROMPTS' greedy continuation); the target is never changed."""
    target = tiny_target("llama")
    return target, [greedy(target, p, NEW) for p in PROMPTS]



def _three_calls(gen):
    """generate, generate_batch and stream, in that order: (their tokens or text, the stats of every row)."""
    one = gen.generate(PROMPTS[0], max_new_tokens=NEW, **NO_EOS)
    batch = gen.generate_batch(PROMPTS, max_new_tokens=NEW, **NO_EOS)
    stats = GenerationStats()
    pieces = list(gen.stream(PROMPTS[1], max_new_tokens=NEW, stats=stats, **NO_EOS))
    return (one.tokens, [r.tokens for r in batch], pieces), [one.stats, *(r.stats for r in batch), stats]


@pytest.mark.parametrize("head_type", NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_entry_point_gives_the_same_output_twice(kind, head_type, calibrations):
    target, refs = setup()
    gen = SpeculativeGenerator(target, make_head(target, head_type), KINDS[kind])
    drafts, inner = [], gen.drafter.draft  # every draft's candidates: (tokens, scores)

    def recording(*args, **kwargs):
        candidates = inner(*args, **kwargs)
        drafts.append((candidates.tokens.tolist(), candidates.scores))
        return candidates

    gen.drafter.draft = recording
    first, stats = _three_calls(gen)
    n = len(drafts)
    second, more = _three_calls(gen)
    expected = (refs[0], refs, target.tokenizer.decode(refs[1], skip_special_tokens=True))
    assert (first[0], first[1], "".join(first[2])) == expected, "the first calls"
    assert second[0] == first[0], "generate, the second time"
    assert second[1] == first[1], "generate_batch, the second time"
    assert "".join(second[2]) == "".join(first[2]), "stream, the second time"
    assert len(first[2]) > 1
    if KINDS[kind].planned:  # the planner is measured once and kept: what it learned shapes the later trees
        assert len(calibrations) == 1
    else:  # a fixed tree: the second calls draft, verify and accept exactly as the first did
        assert [(s.drafted, s.accepted) for s in more] == [(s.drafted, s.accepted) for s in stats]
        assert len(drafts) == 2 * n and [t for t, _ in drafts[n:]] == [t for t, _ in drafts[:n]]
        for (_, again), (_, scores) in zip(drafts[n:], drafts[:n]):
            torch.testing.assert_close(again, scores)
        assert not calibrations
    assert_drafts_verified(stats)
    assert_drafts_verified(more)


@pytest.mark.parametrize("head_type", NAMES)
def test_a_chain_verifying_target_reuses_its_generator(head_type):
    """ALiBi: a batch is decoded one row at a time, each a new generation on the same drafter."""
    target = family_target("bloom")
    refs = [greedy(target, p, NEW) for p in PROMPTS]
    gen = SpeculativeGenerator(target, make_head(target, head_type), TreeOptions(kind="static"))
    runs = [gen.generate_batch(PROMPTS, max_new_tokens=NEW, **NO_EOS) for _ in range(2)]
    for run in runs:
        assert [r.tokens for r in run] == refs
        assert_drafts_verified(run, accepted=False)  # a random head; the chains' drafts are verified


# ---- the commands that keep one generator: eyas chat, eyas bench -------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny target as an HF folder, and a random head of every algorithm for it."""
    root = tmp_path_factory.mktemp("reuse")
    target, _ = setup()
    target.model.save_pretrained(root / "target")
    target.tokenizer.save_pretrained(root / "target")
    for head_type in NAMES:
        save_head(make_head(target, head_type), root / head_type)
    return root


def _until_eos(tokens, eos):
    return next((tokens[:i + 1] for i, t in enumerate(tokens) if t in eos), tokens)


@pytest.mark.parametrize("head_type", NAMES)
def test_chat_replies_every_turn_with_the_targets_greedy_continuation(folders, head_type, monkeypatch, capsys):
    lines = iter(["hello world", "the w5 w6", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    stream, turns = SpeculativeGenerator.stream, []  # per turn: the generator, the ids it was given, its stats

    def recording(self, prompt, **kw):
        turns.append((self, self.encode(prompt), kw["stats"]))
        yield from stream(self, prompt, **kw)

    monkeypatch.setattr(SpeculativeGenerator, "stream", recording)
    code = main(["chat", "--target", str(folders / "target"), "--head", str(folders / head_type), "--tree", "static",
                 "--max-new-tokens", str(NEW), "--dtype", "fp32", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0 and len(turns) == 2
    gen = turns[0][0]
    assert turns[1][0] is gen and gen.options.kind == "static"  # one generator served both turns
    target = gen.target
    replies = [_until_eos(greedy(target, ids, NEW), target.eos_ids()) for _, ids, _ in turns]
    assert out == "".join(target.tokenizer.decode(r, skip_special_tokens=True) + "\n" for r in replies)
    assert len(turns[1][1]) > len(turns[0][1]) + 2  # turn 2's prompt holds turn 1 and its reply
    assert_drafts_verified([stats for _, _, stats in turns])


@pytest.mark.parametrize("head_type", NAMES)
def test_bench_decodes_every_question_with_one_generator(head_type, monkeypatch):
    target, _ = setup()
    generate, calls = SpeculativeGenerator.generate, []  # per call: the generator, the ids, the result

    def recording(self, prompt, **kw):
        calls.append((self, list(prompt), generate(self, prompt, **kw)))
        return calls[-1][2]

    monkeypatch.setattr(SpeculativeGenerator, "generate", recording)
    questions = [Question(1, "writing", "hello world w1 w2", chat=True),
                 Question("HumanEval/0", "code", "a w10 w11 w12 w13", chat=False)]
    report = run_bench(target, make_head(target, head_type), questions, max_new_tokens=NEW, kind="static",
                       progress=False)
    assert len(calls) == 3 and all(c[0] is calls[0][0] for c in calls)  # the warm-up, then both questions
    assert [c[1] for c in calls[1:]] == [prompt_ids(target, q) for q in questions]
    for _, ids, res in calls[1:]:
        assert res.tokens == _until_eos(greedy(target, ids, NEW), target.eos_ids())
    assert [row["exact"] for row in report["questions"]] == [True, True]  # against transformers generate too
    assert report["settings"]["tree"]["kind"] == "static"
    assert_drafts_verified([c[2] for c in calls[1:]])
