import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.inference.cli import main
from eyas.models import DraftHead, load_head, save_head
from eyas.models.head_config import head_config_for
from eyas.models.layouts import export_head
from tests.helpers.tiny import tiny_target

EAGLE3_FORMATS = ["sglang", "speculators"]
LAYER0 = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


def _head(target, head_type="eagle3", num_layers=1, seed=1):
    torch.manual_seed(seed)
    head = DraftHead(head_config_for(target, head_type, draft_vocab_size=100, num_layers=num_layers), target)
    with torch.no_grad():  # random norms too, so a swapped or dropped norm changes the logits
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    if head_type == "eagle3":
        head.set_vocab_map(torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(seed))[:100])
    return head


def _logits(head, target):
    ids = torch.randint(4, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    out = target(ids, layer_ids=head.config.fused_layer_ids)
    feat = out.features if head.config.head_type == "eagle3" else out.hidden
    return head(ids, head.fuse(feat), torch.arange(7).expand(2, -1)).logits


@pytest.mark.parametrize("fmt,head_type", [("sglang", "eagle3"), ("speculators", "eagle3"), ("eagle", "eagle1")])
def test_round_trip_through_foreign_layout(tmp_path, fmt, head_type):
    target = tiny_target("llama")
    head = _head(target, head_type)
    save_head(head, tmp_path / "h")
    export_head(tmp_path / "h", tmp_path / fmt, fmt)
    foreign = load_head(tmp_path / fmt, target)
    torch.testing.assert_close(_logits(foreign, target), _logits(head, target), rtol=0, atol=0)
    if head_type == "eagle3":
        assert torch.equal(foreign.draft_to_target, head.draft_to_target)
    export_head(tmp_path / fmt, tmp_path / "back", "eyas")  # foreign -> eyas
    back = load_head(tmp_path / "back", target)
    assert back.config == head.config
    assert json.loads((tmp_path / "back" / "config.json").read_text())["target"]["tokenizer_fingerprint"] == ""
    torch.testing.assert_close(_logits(back, target), _logits(head, target), rtol=0, atol=0)


def test_sglang_layout_fields_and_keys(tmp_path):
    target = tiny_target("llama")  # 4 layers: default fused ids (2, 2, 1) -> (1, 2)
    head = _head(target)
    save_head(head, tmp_path / "h")
    export_head(tmp_path / "h", tmp_path / "s", "sglang")
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["tie_word_embeddings"], config["torch_dtype"]) == (1, False, "float32")
    assert (config["vocab_size"], config["draft_vocab_size"], config["hidden_size"]) == (320, 100, 64)
    assert (config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]) == (2, 16, 128)
    # SpecForge/SGLang record layer outputs: one less than eyas' layer-input ids.
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in head.config.fused_layer_ids],
                                      "use_aux_hidden_state": True}
    weights = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert set(weights) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                            "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                            *[f"midlayer.{k}" for k in LAYER0]}
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(100) + weights["d2t"], head.draft_to_target)
    assert weights["t2d"].sum() == 100 and weights["t2d"][head.draft_to_target].all()


def test_speculators_layout_fields_and_keys(tmp_path):
    target = tiny_target("llama", num_layers=8)
    head = _head(target, num_layers=2)  # speculators/vLLM build num_hidden_layers decoder layers
    save_head(head, tmp_path / "h")
    export_head(tmp_path / "h", tmp_path / "v", "speculators")
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM numbering = eyas numbering
    assert config["norm_before_residual"] is False and config["draft_vocab_size"] == 100
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy" and spec["proposal_methods"][0]["speculative_tokens"] >= 1
    assert spec["verifier"]["name_or_path"] == "tiny-llama"
    layer = config["transformer_layer_config"]
    assert (layer["num_hidden_layers"], layer["vocab_size"], layer["hidden_size"]) == (2, 320, 64)
    assert "speculators_version" in config
    keys = set(load_file(str(tmp_path / "v" / "model.safetensors")))
    assert keys == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "layers.0.input_layernorm.weight",
                    "layers.0.hidden_norm.weight", "layers.1.input_layernorm.weight",
                    *[f"layers.{i}.{k}" for i in (0, 1) for k in LAYER0]}
    again = load_head(tmp_path / "v", target)
    torch.testing.assert_close(_logits(again, target), _logits(head, target), rtol=0, atol=0)


def test_eagle1_reference_folder_with_pytorch_bin(tmp_path):
    """A folder as the EAGLE-1 reference writes it: LlamaConfig + pytorch_model.bin, embedding included."""
    target = tiny_target("qwen2", tied=True)
    head = _head(target, "eagle1")
    state = dict(head.state_dict())
    assert "fc.bias" in state and "layers.0.input_layernorm.weight" not in state  # the reference's layer 0
    state["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()  # borrowed: ignored on load
    (tmp_path / "e").mkdir()
    torch.save(state, tmp_path / "e" / "pytorch_model.bin")
    (tmp_path / "e" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
        "vocab_size": 320, "max_position_embeddings": 512, "rope_theta": head.config.rope_theta}))
    loaded = load_head(tmp_path / "e", target)
    torch.testing.assert_close(_logits(loaded, target), _logits(head, target), rtol=0, atol=0)
    export_head(tmp_path / "e", tmp_path / "out", "eagle")
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert set(load_file(str(tmp_path / "out" / "model.safetensors"))) == set(head.state_dict())


def test_sglang_head_without_layer_ids_uses_target_defaults(tmp_path):
    target = tiny_target("llama", num_layers=8)
    head = _head(target)
    save_head(head, tmp_path / "h")
    export_head(tmp_path / "h", tmp_path / "s", "sglang")
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    del config["eagle_config"]  # as the EAGLE-3 reference writes it
    (tmp_path / "s" / "config.json").write_text(json.dumps(config))
    assert load_head(tmp_path / "s", target).config.fused_layer_ids == (2, 4, 5)
    with pytest.raises(ValueError, match="does not record the fused target layers"):
        load_head(tmp_path / "s")
    with pytest.raises(ValueError, match="does not record the fused target layers"):
        export_head(tmp_path / "s", tmp_path / "e", "eyas")
    export_head(tmp_path / "s", tmp_path / "e", "eyas", target)  # the target supplies the defaults
    assert json.loads((tmp_path / "e" / "config.json").read_text())["fused_layer_ids"] == [2, 4, 5]


def test_export_cli_from_training_checkpoint(tmp_path, capsys):
    target = tiny_target("llama")
    head = _head(target)
    save_head(head, tmp_path / "ckpt" / "head")
    (tmp_path / "ckpt" / "optimizer.pt").write_bytes(b"")  # whatever else a checkpoint holds
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "v"), "--format", "speculators"]) == 0
    assert "speculators" in capsys.readouterr().out
    torch.testing.assert_close(_logits(load_head(tmp_path / "v", target), target), _logits(head, target), rtol=0, atol=0)
    assert main(["export", str(tmp_path / "v"), "--out", str(tmp_path / "e")]) == 0  # default format: eyas
    assert "eyas_format" in json.loads((tmp_path / "e" / "config.json").read_text())


def test_export_keeps_dtype(tmp_path):
    target = tiny_target("llama")
    save_head(_head(target).to(torch.bfloat16), tmp_path / "h")
    export_head(tmp_path / "h", tmp_path / "s", "sglang")
    assert json.loads((tmp_path / "s" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_file(str(tmp_path / "s" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16


def test_export_refusals_are_clear_and_write_nothing(tmp_path, capsys):
    target = tiny_target("llama")
    save_head(_head(target, "eagle1"), tmp_path / "e1")
    save_head(_head(target, num_layers=2), tmp_path / "deep")
    assert main(["export", str(tmp_path / "e1"), "--out", str(tmp_path / "x"), "--format", "sglang"]) == 2
    assert "holds eagle3 heads only" in capsys.readouterr().err
    with pytest.raises(ValueError, match="holds eagle3 heads only"):
        export_head(tmp_path / "e1", tmp_path / "x", "speculators")
    with pytest.raises(ValueError, match="holds eagle1 heads only"):
        export_head(tmp_path / "deep", tmp_path / "x", "eagle")
    with pytest.raises(ValueError, match="exactly 1 decoder layer"):
        export_head(tmp_path / "deep", tmp_path / "x", "sglang")
    last = DraftHead(head_config_for(target, "eagle3", fused_layer_ids=(1, 2, 4)), target)  # 4 = final normed state
    save_head(last, tmp_path / "last")
    with pytest.raises(ValueError, match="final \\*normed\\* state"):
        export_head(tmp_path / "last", tmp_path / "x", "speculators")
    save_head(DraftHead(head_config_for(target, "eagle3", attention_bias=True), target), tmp_path / "qkv_bias")
    with pytest.raises(ValueError, match="no Llama-config equivalent"):
        export_head(tmp_path / "qkv_bias", tmp_path / "x", "sglang")
    with pytest.raises(ValueError, match="unknown export format"):
        export_head(tmp_path / "e1", tmp_path / "x", "onnx")
    with pytest.raises(FileNotFoundError, match="training checkpoint"):
        export_head(tmp_path / "nothing", tmp_path / "x", "eyas")
    assert not (tmp_path / "x").exists()


def _write_foreign(folder, config, weights):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if weights is not None:
        save_file(weights, str(folder / "model.safetensors"))


def test_foreign_load_errors_name_the_problem(tmp_path):
    target = tiny_target("llama")
    save_head(_head(target), tmp_path / "h")
    export_head(tmp_path / "h", tmp_path / "s", "sglang")
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    weights = load_file(str(tmp_path / "s" / "model.safetensors"))

    _write_foreign(tmp_path / "bert", {"architectures": ["BertModel"]}, weights)
    with pytest.raises(ValueError, match="unknown head layout"):
        load_head(tmp_path / "bert")
    _write_foreign(tmp_path / "model", {**config, "architectures": ["LlamaForCausalLM"]},
                   {"model.embed_tokens.weight": torch.zeros(320, 64)})
    with pytest.raises(ValueError, match="not an EAGLE draft head"):
        load_head(tmp_path / "model")
    _write_foreign(tmp_path / "bias", {**config, "attention_bias": True}, weights)
    with pytest.raises(ValueError, match="attention_bias"):
        load_head(tmp_path / "bias")
    _write_foreign(tmp_path / "noweights", config, None)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_head(tmp_path / "noweights")
    _write_foreign(tmp_path / "nohead", config, {k: v for k, v in weights.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        load_head(tmp_path / "nohead")
    _write_foreign(tmp_path / "narrow", {**config, "intermediate_size": 96}, weights)
    with pytest.raises(ValueError, match="midlayer.mlp|mlp.gate_proj.weight"):
        load_head(tmp_path / "narrow")
    _write_foreign(tmp_path / "rope", {**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, weights)
    with pytest.raises(ValueError, match="rope scaling"):
        load_head(tmp_path / "rope")
    _write_foreign(tmp_path / "nomap", {**config}, {k: v for k, v in weights.items() if k not in ("d2t", "t2d")})
    with pytest.raises(ValueError, match="no d2t map"):
        load_head(tmp_path / "nomap")

    export_head(tmp_path / "h", tmp_path / "v", "speculators")
    spec = json.loads((tmp_path / "v" / "config.json").read_text())
    spec_weights = load_file(str(tmp_path / "v" / "model.safetensors"))
    _write_foreign(tmp_path / "ambiguous", {k: v for k, v in spec.items() if k != "norm_before_residual"}, spec_weights)
    with pytest.raises(ValueError, match="norm_before_residual is missing"):
        load_head(tmp_path / "ambiguous")
    _write_foreign(tmp_path / "fc_norm", {**spec, "fc_norm": True}, spec_weights)
    with pytest.raises(ValueError, match="fc_norm"):
        load_head(tmp_path / "fc_norm")
    qwen3_layer = {**spec, "transformer_layer_config": {**spec["transformer_layer_config"], "model_type": "qwen3"}}
    _write_foreign(tmp_path / "qwen3", qwen3_layer, spec_weights)
    with pytest.raises(ValueError, match="qwen3"):
        load_head(tmp_path / "qwen3")
    _write_foreign(tmp_path / "medusa", {**spec, "speculators_model_type": "medusa"}, spec_weights)
    with pytest.raises(ValueError, match="medusa"):
        load_head(tmp_path / "medusa")
