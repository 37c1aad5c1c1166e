"""Two processes under `accelerate launch` (DDP on gloo, DeepSpeed ZeRO-2/3): the run asserts the process
count and distributed type it got, both ranks end identical and equal to a one-process run with the
same global batch; the frozen target is sharded (FSDP2: under ZeRO-3, and under DDP with target_placement=shard)
and training still matches; a one-process checkpoint resumes with two processes (DDP; DeepSpeed through its universal
checkpoint, converted on resume); a wrong launch is refused.

Each test spawns `accelerate launch` (~10-60 s on 2 busy cores); DeepSpeed's first run on a machine
also compiles its shared-memory comm op once (~70 s, then cached under ~/.cache/torch_extensions)."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from eyas.models import load_head
from eyas.train import checkpoint
from eyas.train.trainer import run
from tests.helpers.train import REPO, TINY_CONFIG, reset_accelerate, tiny_run_config

LAUNCHES = {
    "ddp": ("configs/accelerate/ddp_cpu.yaml", {"ACCELERATE_USE_CPU": "true"}, "MULTI_CPU"),
    "deepspeed_zero2": ("configs/accelerate/deepspeed_zero2.yaml", {}, "DEEPSPEED"),
    "deepspeed_zero3": ("configs/accelerate/deepspeed_zero3.yaml", {}, "DEEPSPEED"),
}


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    yield
    reset_accelerate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(kind: str, config, env_extra=None, expect_ok=True, processes=2) -> subprocess.CompletedProcess:
    """Run the tiny config under `accelerate launch` (2 processes by default); overrides from `config`."""
    accel_config, env, _ = LAUNCHES[kind]
    overrides = [f"target.spec={config.target.spec}", f"data.source={config.data.source}",
                 f"output_dir={config.output_dir}", f"head.type={config.head.type}",
                 f"batch.size={config.batch.size}", f"schedule.total_steps={config.schedule.total_steps}",
                 f"distributed.expect_processes={config.distributed.expect_processes}",
                 f"distributed.expect_type={config.distributed.expect_type}",
                 f"distributed.target_placement={config.distributed.target_placement}"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", accel_config,
           "--main_process_port", str(_free_port()), "--num_processes", str(processes), "-m", "eyas.train",
           "--config", str(TINY_CONFIG), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "WANDB_MODE": "offline", **env, **(env_extra or {})},
                          capture_output=True, text=True, timeout=600)
    if expect_ok:
        assert proc.returncode == 0, _failure(proc)
    return proc


def _failure(proc: subprocess.CompletedProcess) -> str:
    """What a failed launch printed: the end of its output, and its error output from the first traceback on (the
    rank that failed first; the launcher's report and the other ranks' errors, which come last, name no cause) as
    well as the end."""
    err = proc.stderr
    first = err.find("Traceback")
    cause = err[first: first + 4000] if first >= 0 else ""
    return f"{proc.stdout[-2000:]}\n--- first traceback ---\n{cause}\n--- end of error output ---\n{err[-2000:]}"


def _metrics(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind, head_type", [("ddp", "eagle3"), ("ddp", "peagle"), ("ddp", "dflash"),
                                             ("deepspeed_zero2", "eagle1")])
def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path, kind, head_type):
    dist_type = LAUNCHES[kind][2]
    two = tiny_run_config(tmp_path / "two", f"head.type={head_type}", "batch.size=2", "schedule.total_steps=4",
                          "distributed.expect_processes=2", f"distributed.expect_type={dist_type}")
    proc = launch(kind, two)
    assert f"launch: 2 process(es), distributed type {dist_type}" in proc.stdout
    one = tiny_run_config(tmp_path / "one", f"head.type={head_type}", "batch.size=4", "schedule.total_steps=4")
    run(one)
    rows = _metrics(tmp_path / "two")
    assert [r["replica_max_diff"] for r in rows if "replica_max_diff" in r] == [0.0]  # both ranks identical
    two_loss = [r["train/loss"] for r in rows if "train/loss" in r]
    one_loss = [r["train/loss"] for r in _metrics(tmp_path / "one") if "train/loss" in r]
    assert two_loss == pytest.approx(one_loss, abs=1e-5)
    a, b = load_head(tmp_path / "two" / "head"), load_head(tmp_path / "one" / "head")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-5), name


def test_one_process_checkpoint_resumes_with_two_processes(tmp_path):
    out = tmp_path / "run"
    run(tiny_run_config(out, "schedule.total_steps=3"))
    reset_accelerate()
    proc = launch("ddp", tiny_run_config(out, "batch.size=2", "schedule.total_steps=6",
                                         "distributed.expect_processes=2", "distributed.expect_type=MULTI_CPU"))
    assert "at step 3 (saved by 1 process(es), now 2)" in proc.stdout
    assert checkpoint.list_checkpoints(out)[-1].name == "step-00000006"
    steps = [r["step"] for r in _metrics(out) if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_launch_without_cpu_flag_is_refused(tmp_path):
    """A MULTI_GPU config on a CPU machine without ACCELERATE_USE_CPU would train unsynchronised copies."""
    config = tiny_run_config(tmp_path / "run", "batch.size=2", "schedule.total_steps=2",
                             "distributed.expect_processes=2", "distributed.expect_type=MULTI_CPU")
    proc = launch("ddp", config, env_extra={"ACCELERATE_USE_CPU": "false"}, expect_ok=False)
    assert proc.returncode != 0
    assert "distributed type NO" in proc.stderr + proc.stdout
    assert not checkpoint.list_checkpoints(tmp_path / "run")


@pytest.mark.parametrize("kind, placement, expected, head_type", [("deepspeed_zero3", "auto", "shard", "eagle1"),
                                                                    ("ddp", "shard", "shard", "eagle3")])
def test_sharded_target_holds_part_per_rank_and_matches_one_process(tmp_path, kind, placement, expected, head_type):
    """eagle1 also backpropagates through the target's sharded lm_head; eagle3 reads its sharded layers' inputs."""
    dist_type = LAUNCHES[kind][2]
    two = tiny_run_config(tmp_path / "two", f"head.type={head_type}", "batch.size=2", "schedule.total_steps=3",
                          "distributed.expect_processes=2", f"distributed.expect_type={dist_type}",
                          f"distributed.target_placement={placement}")
    proc = launch(kind, two)
    found = re.search(rf"target placement {expected}: weights held per process \[(\d+), (\d+)\] of (\d+)", proc.stdout)
    assert found, proc.stdout[-3000:]
    held = [int(found[1]), int(found[2])]
    total = int(found[3])
    assert all(0 < h <= 0.55 * total for h in held) and sum(held) >= total  # halves (ZeRO pads each weight)
    one = tiny_run_config(tmp_path / "one", f"head.type={head_type}", "batch.size=4", "schedule.total_steps=3")
    run(one)
    two_loss = [r["train/loss"] for r in _metrics(tmp_path / "two") if "train/loss" in r]
    one_loss = [r["train/loss"] for r in _metrics(tmp_path / "one") if "train/loss" in r]
    assert len(two_loss) == 3 and two_loss == pytest.approx(one_loss, abs=1e-5)
    a, b = load_head(tmp_path / "two" / "head"), load_head(tmp_path / "one" / "head")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-5), name


def test_deepspeed_checkpoint_resumes_at_another_world_size(tmp_path):
    """ZeRO shards saved by 1 process are converted to DeepSpeed's universal layout on resume by 2; the
    resumed steps match an uninterrupted run with the same global batch (optimizer state carried over)."""
    out = tmp_path / "run"
    launch("deepspeed_zero2", tiny_run_config(out, "schedule.total_steps=3", "distributed.expect_processes=1",
                                              "distributed.expect_type=DEEPSPEED"), processes=1)
    proc = launch("deepspeed_zero2", tiny_run_config(out, "batch.size=2", "schedule.total_steps=6",
                                                     "distributed.expect_processes=2",
                                                     "distributed.expect_type=DEEPSPEED"))
    assert "at step 3 (saved by 1 process(es), now 2)" in proc.stdout
    assert (out / "checkpoints" / "step-00000003" / checkpoint.UNIVERSAL).is_dir()
    run(tiny_run_config(tmp_path / "whole", "schedule.total_steps=6"))
    resumed = {r["step"]: r["train/loss"] for r in _metrics(out) if "train/loss" in r}
    whole = {r["step"]: r["train/loss"] for r in _metrics(tmp_path / "whole") if "train/loss" in r}
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == pytest.approx([whole[s] for s in (4, 5, 6)], abs=1e-5)
