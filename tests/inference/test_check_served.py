"""`eyas check-served`: a served head that drafts as eyas's passes; a broken export or rendering is caught and its
cause named.

Everywhere: the diagnosis with a stand-in engine that decodes as vLLM does (the target's greedy output, each step
a chain drafted by the head it was given, from prompt + the tokens decided so far) with a deliberately changed
head or tokenizer. Where vLLM is installed (EYAS_VLLM_PYTHON, docs/runtimes.md), the command itself against
vLLM: a good export passes, and three broken ones (layer ids in the exported config, the vocabulary map off by
one, another chat template in the engine's model folder) are each caught and named; four eager engine starts,
several minutes on a 2-core CPU."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.data.chat_template import encode_prompt
from eyas.inference.check_served import check_served
from eyas.inference.cli import main
from eyas.models import DraftHead, save_head
from eyas.models.layouts import export_head
from tests.helpers.tiny import CHATML, tiny_target, tiny_tokenizer
from tests.inference.test_vllm import PYTHON, engine_decode, varied_head, vllm_target

K, NEW = 3, 16
CHATS = [[{"role": "user", "content": "hello w1 w2 w3 w4"}], [{"role": "user", "content": "the w50 w51 . w52"}],
         [{"role": "user", "content": "a w7 w7 w8 world"}]]


@pytest.fixture(scope="module")
def pair():
    """A tiny 8-layer target and a head fusing layers 2, 4, 6 over a reduced vocabulary, drafting varied tokens."""
    target = tiny_target(num_layers=8)
    return target, varied_head(target, 100, fused_layer_ids=(2, 4, 6))


class StandInEngine:
    """Decodes as vLLM does with `head` (engine_decode), rendering chats with `tokenizer` (default: the target's)
    and `render` on top of it."""

    def __init__(self, target, head, tokenizer=None, render=lambda ids: ids) -> None:
        self.target, self.head, self.render = target, head, render
        self.tokenizer = tokenizer or target.tokenizer

    def __call__(self, prompts):
        return [engine_decode(self.target, self.head, self.render(encode_prompt(self.tokenizer, p)), NEW, K,
                              self.target.eos_ids()) for p in prompts]


def changed(head, target, **config):
    variant = DraftHead(head.config.replace(**config), target)
    variant.load_state_dict(head.state_dict())
    return variant.eval()


def test_served_drafts_equal_to_eyas_pass(pair):
    target, head = pair
    result = check_served(target, head, CHATS, StandInEngine(target, head), K)
    assert result.passed and result.mismatched == 0 and result.steps >= 20
    assert not result.tried  # nothing to diagnose
    assert result.lines()[-1] == "check-served: PASS"


def test_fused_layer_ids_shifted_in_the_engine_are_named(pair):
    target, head = pair
    result = check_served(target, head, CHATS, StandInEngine(target, changed(head, target,
                                                                              fused_layer_ids=(1, 3, 5))), K)
    assert not result.passed and result.mismatched > result.steps // 2
    assert [c["label"].split(":")[0] for c in result.causes] == ["fused layer ids shifted by -1"]
    assert "likely cause: fused layer ids shifted by -1: the engine fuses [1, 3, 5]" in "\n".join(result.lines())


def test_one_fused_layer_id_off_is_named(pair):
    target, head = pair
    result = check_served(target, head, CHATS, StandInEngine(target, changed(head, target,
                                                                              fused_layer_ids=(2, 4, 7))), K)
    assert [c["label"].split(":")[0] for c in result.causes] == ["fused layer id 6 read as 7"]


def test_a_vocabulary_map_off_by_one_is_named(pair):
    target, head = pair
    served = changed(head, target)
    served.set_vocab_map(head.draft_to_target + 1)  # the varied head's vocabulary leaves out the last id
    result = check_served(target, head, CHATS, StandInEngine(target, served), K)
    assert [c["label"].split(":")[0] for c in result.causes] == ["draft vocab map off by +1 in value"]


@pytest.mark.parametrize("change,named", [
    (dict(options={"norm_before_residual": True}), "norm_before_residual flipped"),
    (dict(rope_theta=10000.0), "rope theta 10000 instead of the head's 500000"),
])
def test_a_flipped_norm_flag_or_another_rope_theta_is_named(pair, change, named):
    target, head = pair
    if "rope_theta" in change:  # the head runs at another theta than the engine's default
        head = changed(head, target, rope_theta=500000.0)
    else:
        change = {"options": dataclasses.replace(head.config.options, **change["options"])}
    result = check_served(target, head, CHATS, StandInEngine(target, changed(head, target, **change)), K)
    assert [c["label"].split(":")[0] for c in result.causes] == [named]


def test_another_chat_template_in_the_engine_folder_is_named(pair):
    target, head = pair
    theirs = tiny_tokenizer()
    theirs.chat_template = "<|im_start|>system\nw0<|im_end|>\n" + CHATML  # a default system turn
    result = check_served(target, head, CHATS, StandInEngine(target, head, theirs), K, engine_tokenizer=theirs)
    assert not result.passed and result.drafts_match  # drafts compare from the engine's own context
    assert len(result.rendering) == len(CHATS) and result.rendering[0]["at"] == 1
    assert result.rendering_cause == "the engine's model folder has another chat template than eyas's target"


def test_a_bos_token_added_by_the_engine_is_named(pair):
    target, head = pair
    bos = target.tokenizer.bos_token_id
    result = check_served(target, head, CHATS, StandInEngine(target, head, render=lambda ids: [bos] + ids), K)
    assert result.rendering_cause == "the engine adds a BOS token before the rendered prompt"


def test_a_difference_nothing_reproduces_says_so(pair):
    target, head = pair
    torch.manual_seed(5)
    other = varied_head(target, 100, fused_layer_ids=(2, 4, 6))
    with torch.no_grad():
        other.lm_head.weight.copy_(torch.randn_like(other.lm_head.weight))
    result = check_served(target, head, CHATS, StandInEngine(target, other), K)
    assert not result.passed and not result.causes and len(result.tried) >= 10
    assert "no tried alternative reproduces the engine's drafts" in "\n".join(result.lines())


def test_tolerance_lets_near_ties_through_and_no_more(pair):
    target, head = pair
    honest = StandInEngine(target, head)

    def one_step_off(prompts):
        rows = honest(prompts)
        rows[0].proposals[1] = [t + 1 for t in rows[0].proposals[1]]  # one proposal, never its outcome
        return rows

    strict = check_served(target, head, CHATS, one_step_off, K)
    assert not strict.passed and strict.mismatched == 1 and strict.first["step"] == 1 and strict.first["prompt"] == 0
    assert check_served(target, head, CHATS, one_step_off, K, tolerance=0.1).passed


needs_vllm = pytest.mark.skipif(PYTHON is None, reason="vLLM is not installed (set EYAS_VLLM_PYTHON)")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A target vLLM runs, eyas's head for it, a questions file, and exports: good and three broken."""
    tmp = tmp_path_factory.mktemp("check-served")
    target = vllm_target(tmp / "target")
    save_head(varied_head(target, 100, fused_layer_ids=(2, 4, 6)), tmp / "head")
    export_head(tmp / "head", tmp / "good", "speculators", target)
    shutil.copytree(tmp / "good", tmp / "layer-ids")
    config = json.loads((tmp / "layer-ids" / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    (tmp / "layer-ids" / "config.json").write_text(json.dumps(config))
    shutil.copytree(tmp / "good", tmp / "vocab")
    weights = load_file(tmp / "vocab" / "model.safetensors")
    weights["d2t"] = weights["d2t"] + 1  # every draft id one target id up
    save_file(weights, tmp / "vocab" / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(tmp / "target", tmp / "engine-model")
    theirs = tiny_tokenizer()
    theirs.chat_template = "<|im_start|>system\nw0<|im_end|>\n" + CHATML
    theirs.save_pretrained(tmp / "engine-model")
    (tmp / "q.jsonl").write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [c[0]["content"]]})
                                         + "\n" for i, c in enumerate(CHATS)))
    return tmp


def check(served, capsys, *extra):
    rc = main(["check-served", "--target", str(served / "target"), "--head", str(served / "head"), "--questions",
               str(served / "q.jsonl"), "--limit", "2", "--max-new-tokens", str(NEW), "--draft-tokens", str(K),
               "--tolerance", "0", "--vllm-python", PYTHON, *extra])
    return rc, capsys.readouterr().out


@needs_vllm
def test_vllm_serving_a_good_export_passes(served, capsys):
    rc, out = check(served, capsys, "--out", str(served / "good.json"))
    assert rc == 0 and out.rstrip().endswith("check-served: PASS"), out
    assert json.loads((served / "good.json").read_text())["steps"] >= 8


@needs_vllm
@pytest.mark.parametrize("broken,named", [
    ("layer-ids", "likely cause: fused layer ids shifted by -1: the engine fuses [1, 3, 5], eyas's head [2, 4, 6]"),
    ("vocab", "likely cause: draft vocab map off by +1 in value"),
])
def test_vllm_serving_a_broken_export_is_caught_and_named(served, capsys, broken, named):
    rc, out = check(served, capsys, "--served", str(served / broken))
    assert rc == 1 and named in out and "drafts: " in out and "DIFFER" in out, out


@needs_vllm
def test_vllm_serving_another_chat_template_is_caught_and_named(served, capsys):
    rc, out = check(served, capsys, "--engine-model", str(served / "engine-model"))
    assert rc == 1, out
    assert "likely cause: the engine's model folder has another chat template than eyas's target" in out
