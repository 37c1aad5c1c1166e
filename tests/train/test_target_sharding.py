"""A target loaded sharded as the trainer loads it (FSDP2 through transformers' distributed loading, DeepSpeed
ZeRO-3 built under zero.Init), 2 CPU processes: each holds about half its decoder, computes the unsharded model's
features and logits, and (FSDP2) keeps the embedding and lm_head whole once gathered; placement choices and
sharding groups."""

import json
import os
import subprocess
import sys

import pytest

from eyas.train.target_sharding import choose_placement, shard_group_size
from tests.helpers.train import REPO, write_target


@pytest.mark.parametrize("placement", ["fsdp", "zero3"])
def test_each_rank_loads_its_part_and_computes_the_whole_models_outputs(tmp_path, placement):
    folder = write_target(tmp_path / "target")
    port = 29400 + os.getpid() % 500 + (placement == "zero3")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(REPO / "tests" / "train" / "sharding_worker.py"), placement, str(folder), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=600)
    reports = sorted(tmp_path.glob("rank-*.json"))
    assert len(reports) == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(p.read_text()) for p in reports]
    for r in rows:
        assert max(r["diffs"]) < 1e-5, r
        assert not r["layer_whole"], r  # after use, a decoder layer is a shard again
        if placement == "fsdp":  # embedding and lm_head units stay whole once gathered: the teacher's chunks and the
            assert r["embedding_and_lm_head_whole"] == [True, True], r  # head's lookups gather nothing more
        assert r["held"] < 0.75 * r["total"], r  # half the decoder (embedding and lm_head whole)


def test_placement_and_groups():
    assert choose_placement("auto", "FSDP", None, 8) == "fsdp"
    assert choose_placement("auto", "DEEPSPEED", 3, 8) == "zero3"
    assert choose_placement("auto", "DEEPSPEED", 2, 8) == "replicate"
    assert choose_placement("shard", "MULTI_GPU", None, 8) == "fsdp"
    assert choose_placement("shard", "MULTI_GPU", None, 1) == "replicate"
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):
        choose_placement("shard", "DEEPSPEED", 2, 8)
    assert shard_group_size(None, 16) == int(os.environ.get("LOCAL_WORLD_SIZE", 16))
    assert shard_group_size(8, 16) == 8
    with pytest.raises(ValueError, match="must divide"):
        shard_group_size(3, 16)
