"""A target loaded sharded as the trainer loads it (FSDP2 through transformers' distributed loading), 2 CPU
processes: each holds half its decoder, computes the unsharded model's features and logits, and keeps the
embedding and lm_head whole once gathered; placement choices and sharding groups."""

import json
import os
import subprocess
import sys

import pytest

from eyas.train.target_sharding import choose_placement, shard_group_size
from tests.helpers.train import REPO, write_target


def test_each_rank_loads_its_part_and_computes_the_whole_models_outputs(tmp_path):
    folder = write_target(tmp_path / "target")
    port = 29400 + os.getpid() % 500
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(REPO / "tests" / "train" / "sharding_worker.py"), str(folder), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=600)
    reports = sorted(tmp_path.glob("rank-*.json"))
    assert len(reports) == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(p.read_text()) for p in reports]
    for r in rows:
        assert max(r["diffs"]) < 1e-5, r
        assert not r["layer_whole"], r  # after use, a decoder layer is a shard again
        assert r["embedding_and_lm_head_whole"] == [True, True], r  # the teacher's chunks gather nothing
        assert r["held"] <= 0.55 * r["total"], r  # its shard of every weight (measured right after loading)


def test_placement_and_groups():
    assert choose_placement("auto", "FSDP", None, 8) == choose_placement("auto", "DEEPSPEED", 3, 8) == "shard"
    assert choose_placement("auto", "DEEPSPEED", 2, 8) == choose_placement("auto", "MULTI_GPU", None, 8) == "replicate"
    assert choose_placement("shard", "MULTI_GPU", None, 8) == choose_placement("shard", "DEEPSPEED", 2, 8) == "shard"
    assert choose_placement("shard", "MULTI_GPU", None, 1) == choose_placement("replicate", "FSDP", None, 8) == (
        "replicate")
    assert shard_group_size(None, 16) == int(os.environ.get("LOCAL_WORLD_SIZE", 16))
    assert shard_group_size(8, 16) == 8
    with pytest.raises(ValueError, match="must divide"):
        shard_group_size(3, 16)
