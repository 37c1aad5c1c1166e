"""The memory estimator: built from a config alone (any architecture), it orders placements as they hold weights,
its TTT activations grow linearly in the sequence length, and its command prints what fits."""

import json

import pytest
from transformers import LlamaConfig, Qwen3Config

from eyas.models import memory

CONFIGS = [LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64),
           Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)]


@pytest.mark.parametrize("config", CONFIGS, ids=["llama", "qwen3-tied"])
def test_placements_and_lengths(config):
    def total(**kw):
        return memory.training_step(config, 1024, precision="fp32", target_dtype="fp32", **kw).total

    replicated, offline = total(), total(offline=True)
    sharded = total(placement="shard", processes=8, head_sharding="fsdp")
    assert offline < replicated and sharded < replicated
    est = memory.training_step(config, 1024, draft_vocab_size=1024)
    target = memory.target_shape(memory.meta_target(config))
    assert est.parts["target weights"] == target.total * 2  # bf16, replicated
    acts = [memory.training_step(config, t, draft_vocab_size=1024).parts["TTT activations"] for t in (2048, 4096)]
    assert acts[1] / acts[0] == pytest.approx(2.0, rel=0.02)


def test_the_command_reads_a_config_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[0].to_dict()))
    assert memory.main(["--target", str(path), "--seq-len", "512", "--gpu-gib", "0.001"]) == 0
    out = capsys.readouterr().out
    assert "training step (does NOT fit in 0.001 GiB)" in out and "speculative generation" in out
