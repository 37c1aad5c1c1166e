"""An exported head in vLLM: it loads, its greedy output equals vLLM's plain greedy (and transformers'), and every
draft vLLM proposes equals the chain eyas's own head drafts from the same context; a warm worker answers
prompts one at a time.

Those run only where vLLM is installed: set EYAS_VLLM_PYTHON to the python of its environment
(docs/runtimes.md); three engine starts (plain, two heads) in eager mode, a few minutes on a 2-core CPU.
Without vLLM: the worker protocol with a stand-in worker script, how the engine's counters and proposals become
eyas bench's per-step numbers, and the bench alternating a stand-in engine with eyas."""

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
    EngineError,
    EngineOptions,
    EngineRow,
    EngineSettings,
    EngineWorker,
    engine_python,
    export_for,
    run_engine,
    steps_from_proposals,
)
from eyas.models import DraftHead, Target, save_head
from eyas.models.head_config import head_config_for
from tests.helpers.plots import assert_plotted
from tests.helpers.tiny import tiny_target, tiny_tokenizer
from tests.helpers.train import write_target

PYTHON = engine_python("vllm")
needs_vllm = pytest.mark.skipif(PYTHON is None, reason="vLLM is not installed (set EYAS_VLLM_PYTHON)")

K = 3  # draft tokens per step
NEW = 24  # new tokens per prompt
SETTINGS = EngineSettings(eos_token_ids=(3,), num_speculative_tokens=K, threads=2, max_model_len=512,
                          enforce_eager=True, kv_cache_gib=1, timeout_s=1200)
PROMPTS = [[2, 5, 77, 140, 9, 201, 33, 18], [2, 250, 251, 12, 90, 7, 7, 61, 150, 44, 3, 19, 250]]
# (head config changes, draft vocab): a reduced vocab with fused layers eyas must sort and pad (and the
# norm_before_residual variant), and a permuted full vocab written without maps (lm_head rows reordered)
HEADS = {"reduced": (dict(fused_layer_ids=(6, 2), options={"norm_before_residual": True}), 100),
         "full": (dict(num_layers=2), 320)}


def vllm_target(folder) -> Target:
    """A tiny Llama target vLLM's CPU backend runs (head_dim >= 32), written to `folder`."""
    config = LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # vLLM's CPU attention: >= 32
                         max_position_embeddings=512, pad_token_id=1, eos_token_id=3, bos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return Target(model, tiny_tokenizer(), str(folder))


def varied_head(target, vocab: int, fused_layer_ids=None, num_layers: int = 1, options=None, **fields) -> DraftHead:
    """A random EAGLE-3 head whose drafts vary from token to token (not one token everywhere), its draft vocab a
    random `vocab` of the 320 ids, none of them the last (a map shifted up by one stays in range)."""
    torch.manual_seed(1)
    base = head_config_for(target, "eagle3", vocab, fused_layer_ids, num_layers, options=options)
    head = DraftHead(dataclasses.replace(base, **fields), target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        head.fc.weight.mul_(30)  # a fused state far from unit RMS: norm_before_residual changes the drafts
    ids = torch.randperm(320)
    head.set_vocab_map(ids[ids != 319][:vocab] if vocab < 320 else ids)
    return head


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny Llama target folder and the HEADS, saved by eyas and exported for vLLM: (folder, target, heads)."""
    tmp = tmp_path_factory.mktemp("vllm")
    target = vllm_target(tmp / "target")
    heads = {}
    for name, (fields, vocab) in HEADS.items():
        heads[name] = varied_head(target, vocab, **fields)
        save_head(heads[name], tmp / f"{name}-eyas")
        export_for("vllm", tmp / f"{name}-eyas", tmp / f"{name}-vllm", target)
    return tmp, target, heads


@pytest.fixture(scope="module")
def runs(exported):
    tmp, target, heads = exported
    results = {"plain": run_engine(PYTHON, str(tmp / "target"), PROMPTS, SETTINGS, NEW)}
    for name in HEADS:
        results[name] = run_engine(PYTHON, str(tmp / "target"), PROMPTS, SETTINGS, NEW, tmp / f"{name}-vllm")
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
        reference = target.model.generate(torch.tensor([prompt]), max_new_tokens=NEW,
                                          do_sample=False, eos_token_id=3, pad_token_id=1)[0, len(prompt):].tolist()
        assert plain.tokens == reference  # vLLM's plain greedy is transformers' greedy on this target
        assert spec.tokens == plain.tokens  # and speculation through the exported head keeps it
        assert spec.drafts > 0 and spec.draft_tokens == K * spec.drafts
        assert spec.prompt_token_ids == prompt and plain.proposals is None
        # every verified proposal is one step the counters count, and both give the same tokens gained
        assert len(spec.steps) == spec.drafts and sorted(spec.steps) == sorted(spec.accepted)


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
    the drafts that match the output, plus one (steps_from_proposals)."""
    target, heads, results = runs
    compared = 0
    for prompt, row in zip(PROMPTS, results[name].rows):
        for step in steps_from_proposals(row.tokens, row.proposals):
            assert step.proposal == eyas_chain(target, heads[name], prompt + row.tokens[:step.done], K), step
            compared += 1
    assert compared >= 20


def test_steps_follow_the_output_and_drop_proposals_never_verified():
    # output 10 11 12 13 14; step 0 drafts after [10] and keeps 11 12, gains 13; step 1 after [.. 13] keeps none
    steps = steps_from_proposals([10, 11, 12, 13, 14], [[11, 12, 99], [7, 7, 7], [1, 2, 3]])
    assert [(s.done, s.accepted) for s in steps] == [(1, [11, 12]), (4, [])]  # step 2 would draft after the end
    row = EngineRow([10, 11, 12, 13, 14], 1.0, drafts=2, draft_tokens=6, accepted_tokens=2,
                    accepted_per_position=[1, 1, 0], proposals=[[11, 12, 99], [7, 7, 7], [1, 2, 3]])
    assert row.steps == [3, 1] and sorted(row.accepted) == [1, 3]


def test_counters_become_per_step_accepted_lengths():
    # 5 drafting steps; 3 accepted position 1, 1 accepted position 2, none position 3
    row = EngineRow(tokens=[1] * 10, time_s=1.0, drafts=5, draft_tokens=15, accepted_tokens=4,
                    accepted_per_position=[3, 1, 0])
    assert sorted(row.accepted) == [1, 1, 2, 2, 3]
    assert row.tau == sum(row.accepted) / len(row.accepted) == 1.8


def engine_decode(target, head, ids: list[int], n: int, k: int, eos: list[int], seconds: float = 1.0) -> EngineRow:
    """What vLLM answers for greedy decoding of `ids` (with `head`: speculative, drafting as eyas_chain does): the
    target's greedy output, every step's proposal, and the counters they make."""
    out = target.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                                pad_token_id=1)[0, len(ids):].tolist()
    if head is None:
        return EngineRow(out, seconds, list(ids))
    proposals, done = [], 1
    while done < len(out):
        proposals.append(eyas_chain(target, head, list(ids) + out[:done], k))
        done += len(steps_from_proposals(out, proposals)[-1].accepted) + 1
    steps = steps_from_proposals(out, proposals)
    return EngineRow(out, seconds, list(ids), drafts=len(steps), draft_tokens=k * len(steps),
                     accepted_tokens=sum(len(s.accepted) for s in steps),
                     accepted_per_position=[sum(len(s.accepted) > j for s in steps) for j in range(k)],
                     proposals=proposals)


class StandInWorker:
    """EngineWorker's interface, answering as vLLM would (engine_decode) with the exported head eyas reads back;
    twice as fast with the head as without."""

    started: list = []

    def __init__(self, python, engine, model, settings, head, log) -> None:
        from eyas.models import load_head

        self.version, self.engine_start_s, self.settings = "0.0-standin", 12.0, settings
        self.target = Target.load(model)
        self.head = None if head is None else load_head(head, self.target)
        StandInWorker.started.append((engine, model, None if head is None else json.loads(
            (head / "config.json").read_text())["speculators_model_type"], settings.num_speculative_tokens))

    def generate(self, request: dict) -> EngineRow:
        return engine_decode(self.target, self.head, request["ids"], request["max_new_tokens"],
                             self.settings.num_speculative_tokens, list(self.settings.eos_token_ids),
                             0.5 if self.head is not None else 1.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def test_bench_alternates_warm_engines_with_eyas(tmp_path, monkeypatch, capsys):
    """The bench with a stand-in engine: each engine starts once (plain, then with the head exported as
    speculators), answers every question beside eyas's runtimes, and the report, table and plot carry every
    runtime; the engine drafting as eyas's head does, eyas-chain-2 and vLLM agree on every step."""
    folder = write_target(tmp_path / "target")
    target = Target.load(str(folder))
    torch.manual_seed(0)
    save_head(DraftHead(head_config_for(target, "eagle3", draft_vocab_size=100), target), tmp_path / "head")
    monkeypatch.setattr(runtimes_vllm, "EngineWorker", StandInWorker)
    StandInWorker.started = []
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                                 for i, (c, t) in enumerate([("writing", "hello w1 w2"), ("code", "the w5 w6")])))
    report = run_bench(str(folder), tmp_path / "head", questions, max_new_tokens=10, out=tmp_path / "r.json",
                       progress=False, engines=EngineOptions({"vllm": "unused"}, draft_tokens=2,
                                                             not_run={"SGLang": "not installed here"}),
                       eyas_plain=True, repeats=2, kind="chain", depth=2)
    model = str(folder.resolve())
    assert StandInWorker.started == [("vllm", model, None, 2), ("vllm", model, "eagle3", 2)]
    rt = report["overall"]["runtimes"]
    assert list(rt) == ["baseline", "spec", "eyas_chain", "eyas_plain", "vllm_plain", "vllm"]
    assert all(s["exact_match_fraction"] == 1.0 for name, s in rt.items() if name != "baseline")
    assert rt["vllm"]["speedup_over_plain"] == pytest.approx(2.0) and rt["vllm"]["aa_worst_run"] == 1.0
    assert rt["vllm"]["speedup_over_plain_within_noise"] is False  # the stand-in's times do not vary at all
    chain, engine = rt["eyas_chain"], rt["vllm"]
    assert chain["label"] == "eyas chain-2" and engine["counters"]["steps"] > 0
    assert engine["tau"] == pytest.approx(chain["tau"])
    assert engine["accept_rate_per_position"] == pytest.approx(chain["accept_rate_per_position"])
    agreement = report["overall"]["chain_vs_engine"]
    assert agreement["first"] is None and agreement["steps_agreed"] > 0
    assert report["settings"]["engines"]["vllm"]["version"] == "0.0-standin"
    assert report["settings"]["runtimes"] == ["baseline", "spec", "eyas_chain", "eyas_plain", "vllm_plain", "vllm"]
    assert_plotted(tmp_path / "r.png")
    from eyas.inference.bench import format_table

    table = format_table(report)
    assert "ran: generate, eyas, eyas chain-2, eyas plain, vLLM plain, vLLM + head" in table
    assert "not run: SGLang: not installed here" in table
    assert f"the same tokens gained at all {agreement['steps_agreed']} steps compared" in table


def test_bench_vllm_without_an_interpreter_is_one_clear_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("EYAS_VLLM_PYTHON", raising=False)
    target = tiny_target()
    save_head(DraftHead(head_config_for(target, "eagle3"), target), tmp_path / "head")
    assert main(["bench", "--target", str(write_target(tmp_path / "t")), "--head", str(tmp_path / "head"),
                 "--out", str(tmp_path / "r.json"), "--vllm"]) == 2
    assert "EYAS_VLLM_PYTHON" in capsys.readouterr().err


FAKE_WORKER = """
import os, sys, time
sys.path.insert(0, {inference!r})
from engine_worker import serve

def start(job):
    if job["model"] == "missing":
        raise RuntimeError("no such model")
    if job["model"] == "lingering":  # an engine whose own thread would hold up an orderly exit for an hour
        import threading
        threading.Thread(target=time.sleep, args=(3600,)).start()
    def answer(request):
        ids = request["ids"]
        print("engines print on stdout: not on the protocol's stream")
        if ids == [0]:
            raise ValueError("bad prompt")
        if ids == [8]:
            time.sleep(3)
        if ids == [9]:
            os._exit(3)
        return {{"tokens": ids[::-1][:request["max_new_tokens"]], "time_s": 0.01, "prompt_token_ids": ids}}
    return answer, {{"version": "fake", "engine_start_s": 0.0}}

serve(start)
"""


def test_worker_protocol_answers_reports_errors_and_deaths(tmp_path, monkeypatch):
    import sys
    import time

    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER.format(inference=str(runtimes_vllm.HERE)))
    fake = dataclasses.replace(runtimes_vllm.ENGINES["vllm"], worker=worker)
    monkeypatch.setitem(runtimes_vllm.ENGINES, "vllm", fake)
    settings = EngineSettings(timeout_s=1)

    def request(*ids):
        return {"ids": list(ids), "max_new_tokens": 2, "seed": 0}

    with pytest.raises(EngineError, match="failed starting: RuntimeError: no such model"):
        EngineWorker(sys.executable, "vllm", "missing", settings, None, tmp_path / "a.log")
    with EngineWorker(sys.executable, "vllm", "model", settings, None, tmp_path / "b.log") as engine:
        assert engine.version == "fake"
        assert engine.generate(request(1, 2, 3)).tokens == [3, 2]
        with pytest.raises(EngineError, match="failed generating: ValueError: bad prompt"):
            engine.generate(request(0))
        assert engine.generate(request(4, 5)).tokens == [5, 4]  # an error leaves the engine up
        assert "engines print on stdout" in (tmp_path / "b.log").read_text()
        with pytest.raises(EngineError, match="exited with 3 generating"):
            engine.generate(request(9))
    with EngineWorker(sys.executable, "vllm", "model", settings, None, tmp_path / "c.log") as engine:
        with pytest.raises(EngineError, match="timed out after 1 s generating"):
            engine.generate(request(8))
    t0 = time.perf_counter()
    with EngineWorker(sys.executable, "vllm", "lingering", settings, None, tmp_path / "d.log") as engine:
        engine.generate(request(1))
    assert engine._proc.returncode == 0 and time.perf_counter() - t0 < 30  # ended at once, not killed a minute on
