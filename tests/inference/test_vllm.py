"""An exported head in vLLM: it loads, its greedy output equals vLLM's plain greedy (and transformers'), and every
draft vLLM proposes equals the chain eyas's own head drafts from the same context.

Those run only where vLLM is installed: set EYAS_VLLM_PYTHON to the python of its environment
(docs/runtimes.md); three engine starts (plain, two heads) in eager mode, a few minutes on a 2-core CPU.
Without vLLM: how its counters become eyas bench's per-cycle numbers, and the bench's vLLM columns with a
stand-in for the engine."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.inference import runtimes_vllm
from eyas.inference.bench import run_bench
from eyas.inference.cli import main
from eyas.inference.runtimes_vllm import (
    VllmOptions,
    VllmRow,
    VllmRun,
    VllmSettings,
    export_for_vllm,
    run_vllm,
    vllm_python,
)
from eyas.models import DraftHead, Target, save_head
from eyas.models.head_config import head_config_for
from tests.helpers.plots import assert_plotted
from tests.helpers.tiny import tiny_target, tiny_tokenizer
from tests.helpers.train import write_target

PYTHON = vllm_python()
needs_vllm = pytest.mark.skipif(PYTHON is None, reason="vLLM is not installed (set EYAS_VLLM_PYTHON)")

K = 3  # draft tokens per step
SETTINGS = VllmSettings(max_new_tokens=24, eos_token_ids=(3,), num_speculative_tokens=K, threads=2,
                        max_model_len=512, enforce_eager=True, kv_cache_gib=1, record_drafts=True, timeout_s=1200)
PROMPTS = [[2, 5, 77, 140, 9, 201, 33, 18], [2, 250, 251, 12, 90, 7, 7, 61, 150, 44, 3, 19, 250]]
# (head config changes, draft vocab): a reduced vocab with fused layers eyas must sort and pad (and the
# norm_before_residual variant), and a permuted full vocab written without maps (lm_head rows reordered)
HEADS = {"reduced": (dict(fused_layer_ids=(6, 2), options={"norm_before_residual": True}), 100),
         "full": (dict(num_layers=2), 320)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny Llama target folder and the HEADS, saved by eyas and exported for vLLM: (folder, target, heads)."""
    tmp = tmp_path_factory.mktemp("vllm")
    config = LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # vLLM's CPU attention: >= 32
                         max_position_embeddings=512, pad_token_id=1, eos_token_id=3, bos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp / "target")
    tiny_tokenizer().save_pretrained(tmp / "target")
    target = Target(model, tiny_tokenizer(), str(tmp / "target"))
    heads = {}
    for name, (fields, vocab) in HEADS.items():
        fields = dict(fields)
        torch.manual_seed(1)
        base = head_config_for(target, "eagle3", vocab, fields.pop("fused_layer_ids", None),
                               fields.pop("num_layers", 1), options=fields.pop("options", None))
        head = DraftHead(dataclasses.replace(base, **fields), target)
        with torch.no_grad():
            for p in head.parameters():  # varied drafts, not one token everywhere
                p.add_(torch.randn_like(p) * 0.3)
            head.fc.weight.mul_(30)  # a fused state far from unit RMS: norm_before_residual changes the drafts
        head.set_vocab_map(torch.randperm(320)[:vocab])
        save_head(head, tmp / f"{name}-eyas")
        export_for_vllm(tmp / f"{name}-eyas", tmp / f"{name}-vllm", target)
        heads[name] = head
    return tmp, target, heads


@pytest.fixture(scope="module")
def runs(exported):
    tmp, target, heads = exported
    results = {"plain": run_vllm(PYTHON, str(tmp / "target"), PROMPTS, SETTINGS)}
    for name in HEADS:
        results[name] = run_vllm(PYTHON, str(tmp / "target"), PROMPTS, SETTINGS, tmp / f"{name}-vllm")
    return target, heads, results


def eyas_chain(target, head, context: list[int], k: int) -> list[int]:
    """The k tokens eyas's head drafts greedily after `context` (its last token is the root), EAGLE-shifted:
    token t+1 goes with the target's feature at position t."""
    ids = torch.tensor([context])
    feats = target(ids, layer_ids=head.config.fused_layer_ids).features
    tokens, hidden = ids[:, 1:], head.fuse(feats[:, :-1])
    drafts = []
    for _ in range(k):
        out = head(tokens, hidden, torch.arange(tokens.shape[1])[None])
        drafts.append(int(head.to_target_ids(out.logits[0, -1].argmax())))
        tokens = torch.cat([tokens, torch.tensor([[drafts[-1]]])], dim=1)
        hidden = torch.cat([hidden, out.hidden[:, -1:]], dim=1)
    return drafts


@needs_vllm
@pytest.mark.parametrize("name", list(HEADS))
def test_exported_head_is_lossless_in_vllm(runs, name):
    target, _, results = runs
    for prompt, plain, spec in zip(PROMPTS, results["plain"].rows, results[name].rows):
        reference = target.model.generate(torch.tensor([prompt]), max_new_tokens=SETTINGS.max_new_tokens,
                                          do_sample=False, eos_token_id=3, pad_token_id=1)[0, len(prompt):].tolist()
        assert plain.tokens == reference  # vLLM's plain greedy is transformers' greedy on this target
        assert spec.tokens == plain.tokens  # and speculation through the exported head keeps it
        assert spec.drafts > 0 and spec.draft_tokens == K * spec.drafts


def speculators_python() -> str | None:
    """vLLM's interpreter when the speculators library imports there too."""
    if PYTHON is None or subprocess.run([PYTHON, "-c", "import speculators"], capture_output=True).returncode:
        return None
    return PYTHON


SPECULATORS_DRAFTS = """
import sys, torch
from speculators.models.eagle3 import Eagle3DraftModel
model = Eagle3DraftModel.from_pretrained(sys.argv[1]).eval()
io = torch.load(sys.argv[2])
with torch.no_grad():  # one TTT step: the draft at every position, token t+1 paired with the state at t
    drafts = model(io["aux"], io["ids"], document_ids=torch.zeros_like(io["ids"]), ttt_steps=1)[0]
torch.save(drafts, sys.argv[3])
"""


@pytest.mark.skipif(speculators_python() is None, reason="the speculators library is not installed beside vLLM")
@pytest.mark.parametrize("name", list(HEADS))
def test_speculators_library_drafts_as_eyas(exported, tmp_path, name):
    """speculators 0.9.0's own Eagle3DraftModel loads the export (embedding included) and drafts what eyas does."""
    folder, target, heads = exported
    head, ids = heads[name], torch.tensor([PROMPTS[1]])
    config = json.loads((folder / f"{name}-vllm" / "config.json").read_text())
    states = target.model(ids, output_hidden_states=True).hidden_states
    aux = torch.cat([states[i] for i in config["eagle_aux_hidden_state_layer_ids"]], dim=-1)
    torch.save({"aux": aux[:, :-1], "ids": ids[:, 1:]}, tmp_path / "io.pt")
    subprocess.run([PYTHON, "-c", SPECULATORS_DRAFTS, str(folder / f"{name}-vllm"), str(tmp_path / "io.pt"),
                    str(tmp_path / "drafts.pt")], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                   capture_output=True)
    feats = target(ids, layer_ids=head.config.fused_layer_ids).features
    ours = head(ids[:, 1:], head.fuse(feats[:, :-1]), torch.arange(ids.shape[1] - 1)[None]).logits.argmax(-1)
    theirs = torch.load(tmp_path / "drafts.pt")
    full = head.config.draft_vocab_size == head.config.vocab_size  # exported rows in target order: ids are target ids
    assert torch.equal(theirs, head.to_target_ids(ours) if full else ours)


@needs_vllm
@pytest.mark.parametrize("name", list(HEADS))
def test_vllm_drafts_equal_eyas_drafts(runs, name):
    """Step c of vLLM drafts after prompt + output[:m_c] (m_0 = 1: the prefill samples the first token); it gains
    the drafts that match the output, plus one."""
    target, heads, results = runs
    compared = 0
    for prompt, row in zip(PROMPTS, results[name].rows):
        out, m = row.tokens, 1
        for proposal in row.proposals:
            if m >= len(out):
                break  # drafted after the last token: never verified
            assert proposal == eyas_chain(target, heads[name], prompt + out[:m], K), (prompt, m)
            compared += 1
            accepted = next((j for j in range(K) if m + j >= len(out) or proposal[j] != out[m + j]), K)
            m += accepted + 1
    assert compared >= 20


def test_counters_become_per_step_accepted_lengths():
    # 5 drafting steps; 3 accepted position 1, 1 accepted position 2, none position 3
    row = VllmRow(tokens=[1] * 10, time_s=1.0, drafts=5, draft_tokens=15, accepted_tokens=4,
                  accepted_per_position=[3, 1, 0])
    assert sorted(row.accepted) == [1, 1, 2, 2, 3]
    assert row.tau == sum(row.accepted) / len(row.accepted) == 1.8


def test_bench_reports_vllm_beside_eyas(tmp_path, monkeypatch, capsys):
    """The bench's vLLM columns, with a stand-in engine: the head reaches it exported as speculators, the prompts
    are eyas's, and the report, table and plot carry vLLM's tau, acceptance and speed."""
    folder = write_target(tmp_path / "target")
    target = Target.load(str(folder))
    torch.manual_seed(0)
    save_head(DraftHead(head_config_for(target, "eagle3", draft_vocab_size=100), target), tmp_path / "head")
    calls = []

    def engine(python, model, prompts, settings, head=None):
        calls.append((model, head is not None, settings))
        if head is not None:
            assert json.loads((head / "config.json").read_text())["speculators_model_type"] == "eagle3"
        rows = []
        for ids in prompts:
            out = target.model.generate(torch.tensor([ids]), max_new_tokens=settings.max_new_tokens, do_sample=False,
                                        eos_token_id=list(settings.eos_token_ids), pad_token_id=1)[0, len(ids):]
            rows.append(VllmRow(out.tolist(), 0.5, drafts=4, draft_tokens=8, accepted_tokens=3,
                                accepted_per_position=[2, 1]) if head is not None else VllmRow(out.tolist(), 1.0))
        return VllmRun(rows, 12.0, "0.0-standin")

    monkeypatch.setattr(runtimes_vllm, "run_vllm", engine)
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                                 for i, (c, t) in enumerate([("writing", "hello w1 w2"), ("code", "the w5 w6")])))
    report = run_bench(str(folder), tmp_path / "head", questions, max_new_tokens=8, out=tmp_path / "r.json",
                       progress=False, vllm=VllmOptions("unused", draft_tokens=2), kind="chain", depth=2)
    assert [(m, spec) for m, spec, _ in calls] == [(str(folder.resolve()), True), (str(folder.resolve()), False)]
    assert calls[0][2].num_speculative_tokens == 2 and calls[0][2].max_new_tokens == 8
    o = report["overall"]
    assert o["vllm_tau"] == pytest.approx((1 + 1 + 2 + 3) / 4)  # each question: steps gaining 1, 1, 2, 3 tokens
    assert o["vllm_accept_rate_per_position"] == [pytest.approx(2 / 4), pytest.approx(1 / 2)]
    assert o["vllm_exact_match_fraction"] == 1.0 and o["vllm_speedup_over_plain"] == pytest.approx(2.0)
    assert report["settings"]["vllm"]["version"] == "0.0-standin"
    assert_plotted(tmp_path / "r.png")
    from eyas.inference.bench import format_table

    assert "vLLM 0.0-standin, same head: tau 1.75" in format_table(report)


def test_bench_vllm_without_an_interpreter_is_one_clear_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("EYAS_VLLM_PYTHON", raising=False)
    target = tiny_target()
    save_head(DraftHead(head_config_for(target, "eagle3"), target), tmp_path / "head")
    assert main(["bench", "--target", str(write_target(tmp_path / "t")), "--head", str(tmp_path / "head"),
                 "--out", str(tmp_path / "r.json"), "--vllm"]) == 2
    assert "EYAS_VLLM_PYTHON" in capsys.readouterr().err
