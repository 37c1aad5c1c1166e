"""Run configs: every shipped YAML loads, overrides apply, bad keys and values fail with the nearest key."""

from pathlib import Path

import pytest
import yaml

from eyas.train.config import ConfigError, RunConfig, dump_config, from_dict, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads_and_shows_its_command(path):
    config = load_config(path)
    assert isinstance(config, RunConfig)
    first = path.read_text().splitlines()[0]
    assert first.startswith("#")
    assert "eyas train" in path.read_text().split("\n\n")[0] or "accelerate launch" in path.read_text()


def test_overrides_use_dotted_paths_and_yaml_values():
    c = load_config(None, ["optim.lr=3e-4", "data.limit=200", "head.fused_layer_ids=[1, 2]", "precision=bf16"])
    assert c.optim.lr == pytest.approx(3e-4) and c.data.limit == 200
    assert c.head.fused_layer_ids == (1, 2) and c.precision == "bf16"


@pytest.mark.parametrize("override, expected", [
    ("optim.lrr=1e-3", "did you mean 'optim.lr'"),
    ("optm.lr=1e-3", "did you mean 'optim'"),
    ("loss.ttt_step=3", "did you mean 'loss.ttt_steps'"),
])
def test_unknown_key_names_the_nearest_valid_key(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [override])


@pytest.mark.parametrize("override, expected", [
    ("optim.lr=fast", "optim.lr must be a number"),
    ("batch.size=1.5", "batch.size must be an integer"),
    ("head.type=eagle2", "head.type 'eagle2' is not one of"),
    ("optim.betas=[0.9]", "optim.betas must have 2 items"),
    ("data.hidden_states=offline", "needs data.cache_dir"),
    ("loss.ttt_steps=0", "ttt_steps must be >= 1"),
])
def test_mistyped_values_name_the_key(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [override])


def test_each_head_type_takes_only_its_own_keys():
    with pytest.raises(ConfigError, match="draft_vocab_size is for heads with an lm_head of their own"):
        load_config(None, ["head.type=eagle1", "head.draft_vocab_size=100"])
    with pytest.raises(ConfigError, match="head.type 'eagle4' is not one of eagle1, eagle3, peagle, dflash"):
        load_config(None, ["head.type=eagle4"])
    with pytest.raises(ConfigError, match="did you mean 'norm_output'"):
        load_config(None, ["head.options.norm_outptu=true"])
    with pytest.raises(ConfigError, match="eagle1 heads have no option 'norm_output'"):
        load_config(None, ["head.type=eagle1", "head.options.norm_output=true"])
    c = load_config(None, ["head.type=peagle", "head.options.depths=4"])
    assert c.head.options == {"depths": 4}


def test_resolved_config_round_trips():
    c = load_config(None, ["optim.betas=[0.8, 0.9]", "data.field_map={conversation: convs}"])
    assert from_dict(RunConfig, yaml.safe_load(dump_config(c))) == c


def test_eyas_train_rejects_an_unknown_key_before_loading_anything(capsys):
    from eyas.inference.cli import main

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny-eagle3.yaml"
    assert main(["train", "--config", str(tiny), "schedule.total_step=3"]) == 2
    assert "did you mean 'schedule.total_steps'" in capsys.readouterr().err
