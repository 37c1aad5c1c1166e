"""One-process training on a tiny target: loss falls (EAGLE-1 and EAGLE-3), an interrupted run resumes
to the same losses, NaN stops with the last checkpoint intact, the head lands where `eyas export` reads it."""

import json
import os
import re
import signal

import pytest
import torch

from eyas.models import load_head
from eyas.models.drafters import NAMES
from eyas.train import checkpoint
from eyas.train.losses import DistillationLoss
from eyas.train.trainer import NonFiniteLoss, Trainer, run
from tests.helpers.train import reset_accelerate, tiny_run_config


@pytest.fixture(autouse=True)
def fresh_accelerate_state(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    yield
    reset_accelerate()


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    return [by_step[s] for s in sorted(by_step)]


@pytest.mark.parametrize("head_type", NAMES)
def test_one_process_training_reduces_loss(tmp_path, head_type):
    out = tmp_path / "run"
    result = run(tiny_run_config(out, f"head.type={head_type}", "schedule.total_steps=12", "logging.eval_every=12"))
    curve = losses(out)
    assert len(curve) == 12
    assert sum(curve[-3:]) / 3 < curve[0]
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    evals = [r["eval/tau"] for r in rows if "eval/tau" in r]
    assert len(evals) == 2 and result["eval/tau"] == evals[-1] > evals[0]  # held-out acceptance grew from step 0
    head = load_head(out / "head")  # the final head, in eyas head format
    assert head.config.head_type == head_type
    assert (out / "config.yaml").is_file()
    last = checkpoint.list_checkpoints(out)[-1]
    assert last.name == "step-00000012" and (last / "head" / "config.json").is_file()


def _interrupt_at(monkeypatch, step_to_stop: int):
    """Send ourselves SIGINT during the forward of optimizer step `step_to_stop` (1-based)."""
    calls = {"n": 0}
    forward = DistillationLoss.forward

    def patched(self, *args):
        calls["n"] += 1
        if calls["n"] == step_to_stop:
            os.kill(os.getpid(), signal.SIGINT)
        return forward(self, *args)

    monkeypatch.setattr(DistillationLoss, "forward", patched)
    return forward


@pytest.mark.parametrize("head_type", NAMES)
def test_interrupted_run_resumes_to_the_same_losses(tmp_path, monkeypatch, head_type):
    """Every head type, its random choices included (feature noise, P-EAGLE's rows, DFlash's anchors)."""
    common = ["schedule.total_steps=7", "loss.feature_noise=0.2", "checkpoint.every=4", "schedule.kind=cosine",
              "logging.eval_batches=0", f"head.type={head_type}"]
    run(tiny_run_config(tmp_path / "straight", *common))

    forward = _interrupt_at(monkeypatch, 3)
    assert run(tiny_run_config(tmp_path / "resumed", *common)) == {}  # stopped by the signal
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "resumed")] == ["step-00000003"]
    monkeypatch.setattr(DistillationLoss, "forward", forward)
    reset_accelerate()
    run(tiny_run_config(tmp_path / "resumed", *common))
    assert losses(tmp_path / "resumed") == pytest.approx(losses(tmp_path / "straight"), abs=1e-6)
    a, b = load_head(tmp_path / "straight" / "head"), load_head(tmp_path / "resumed" / "head")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-6), name


def test_nan_loss_stops_with_last_checkpoint_intact(tmp_path, monkeypatch):
    calls = {"n": 0}
    forward = DistillationLoss.forward

    def poisoned(self, *args):
        calls["n"] += 1
        loss, metrics = forward(self, *args)
        return (loss * float("nan") if calls["n"] == 3 else loss), metrics

    monkeypatch.setattr(DistillationLoss, "forward", poisoned)
    out = tmp_path / "run"
    trainer = Trainer(tiny_run_config(out, "checkpoint.every=2", "schedule.total_steps=6"))
    with pytest.raises(NonFiniteLoss, match=r"loss is nan at step 3.*step-00000002"):
        trainer.train()
    saved = checkpoint.list_checkpoints(out)
    assert [p.name for p in saved] == ["step-00000002"]
    head = load_head(saved[0] / "head")
    assert all(torch.isfinite(v).all() for v in head.state_dict().values() if v.is_floating_point())
    assert not (out / "head").exists()


def test_offline_cache_trains_like_online(tmp_path):
    """A run reading the data layer's hidden-state cache (fp32) sees the same examples and losses as online,
    and counts the same reduced draft vocabulary from the cache's own tokens."""
    from eyas.data import build_examples
    from eyas.data.hidden_cache import cache_hidden
    from eyas.data.vocab import read_vocab_map
    from eyas.models import Target, default_fused_layer_ids

    online = tiny_run_config(tmp_path / "online", "schedule.total_steps=2", "head.draft_vocab_size=48")
    target = Target.load(online.target.spec, dtype="fp32")
    examples, _ = build_examples(online.data.source, target.tokenizer, max_length=online.data.max_length)
    cache = tmp_path / "cache-hidden"
    cache_hidden(target, examples, cache, layer_ids=default_fused_layer_ids(target.num_layers), dtype="fp32")
    run(online)
    reset_accelerate()
    run(tiny_run_config(tmp_path / "offline", "schedule.total_steps=2", "head.draft_vocab_size=48",
                        "data.hidden_states=offline", f"data.cache_dir={cache}"))
    assert losses(tmp_path / "offline") == pytest.approx(losses(tmp_path / "online"), abs=1e-4)
    vocabs = [read_vocab_map(tmp_path / run_dir / "vocab_map.safetensors") for run_dir in ("online", "offline")]
    assert torch.equal(vocabs[0].draft_to_target, vocabs[1].draft_to_target) and vocabs[0].coverage < 1
    reset_accelerate()
    with pytest.raises(ValueError, match="holds layers"):  # a head fusing layers the cache does not hold
        Trainer(tiny_run_config(tmp_path / "bad", "data.hidden_states=offline", f"data.cache_dir={cache}",
                                "head.fused_layer_ids=[1, 3]"))


def test_draft_vocab_can_be_counted_on_another_source(tmp_path, caplog):
    from eyas.data.vocab import read_vocab_map
    from eyas.models import Target

    words = ["hello", "world", "the", "a", "."] + [f"w{i}" for i in range(240, 250)]
    other = tmp_path / "other.jsonl"
    with open(other, "w") as f:
        for i in range(8):
            answer = " ".join(words[(i + j) % len(words)] for j in range(20))
            f.write(json.dumps({"messages": [{"role": "user", "content": "w1 w2"},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    config = tiny_run_config(tmp_path / "run", "schedule.total_steps=1", "head.draft_vocab_size=48",
                             f"data.vocab_source={other}", "logging.eval_batches=0")
    caplog.set_level("INFO", logger="eyas.train")
    run(config)
    assert re.search(r"draft vocab: 48 tokens cover \d+\.\d% of training targets "
                     r"\(counted on .*other.jsonl: 100\.0% there\)", caplog.text)
    target = Target.load(config.target.spec)
    draft = read_vocab_map(tmp_path / "run" / "vocab_map.safetensors").draft_to_target
    ids = set(target.tokenizer.convert_tokens_to_ids(words))
    assert ids <= set(draft.tolist())  # every token the other source trains on is in the vocab
    assert torch.equal(load_head(tmp_path / "run" / "head").draft_to_target, draft)


def test_checkpoint_folder_is_finished_only_after_every_rank_has_saved(tmp_path, monkeypatch):
    """The main process finishes the checkpoint folder (the head, trainer.json, the rename into place) only after a
    barrier that follows every rank's save_state: a rank still writing its shards into the folder as it moved would
    fail the save."""
    events = []

    class Accelerator:  # the main process of a run of several
        is_main_process = True

        def wait_for_everyone(self):
            events.append("barrier")

        def save_state(self, path):
            os.makedirs(path)
            events.append("save_state")

    monkeypatch.setattr(checkpoint, "write_head", lambda *args: events.append("write_head"))
    final = checkpoint.save_checkpoint(Accelerator(), None, {}, None, {"step": 5}, tmp_path, keep=2)
    assert final.is_dir() and (final / checkpoint.TRAINER).is_file()
    saved = events.index("save_state")
    assert "barrier" in events[saved:events.index("write_head")], events
