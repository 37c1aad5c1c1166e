import dataclasses
import importlib.metadata
import importlib.util
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from eyas.inference.cli import main
from eyas.models import DraftHead, Target, load_head, save_head
from eyas.models.head_config import head_config_for
from eyas.models.layouts import export_head
from eyas.models.layouts.speculators import SPECULATORS_VERSION
from eyas.models.masks import causal
from tests.helpers.tiny import tiny_model, tiny_target, tiny_tokenizer

LAYER0 = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
IDS = torch.randint(4, 300, (2, 7), generator=torch.Generator().manual_seed(0))


def _head(target, head_type="eagle3", seed=1, draft_vocab_size=100, fused_layer_ids=None, num_layers=1, **fields):
    torch.manual_seed(seed)
    config = head_config_for(target, head_type, draft_vocab_size, fused_layer_ids, num_layers)
    option_names = {f.name for f in dataclasses.fields(config.options)}
    options = {k: fields.pop(k) for k in list(fields) if k in option_names}
    head = DraftHead(dataclasses.replace(config, options={**dataclasses.asdict(config.options), **options}, **fields),
                     target)
    with torch.no_grad():  # random norms too, so a swapped or dropped norm changes the logits
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    if head_type == "eagle3":
        vocab = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(seed))
        head.set_vocab_map(vocab[: head.config.draft_vocab_size])
    return head


def _logits(head, target):
    """Draft logits in *target-id* space [B, T, V] (-inf outside the draft vocab): comparable across layouts
    that store the draft rows in different orders."""
    out = target(IDS, layer_ids=head.config.fused_layer_ids)
    feat = out.features if head.config.head_type == "eagle3" else out.hidden
    logits = head(IDS, head.fuse(feat), torch.arange(IDS.shape[1]).expand(2, -1)).logits
    if head.config.head_type != "eagle3":
        return logits
    full = logits.new_full((*logits.shape[:2], head.config.vocab_size), float("-inf"))
    full[..., head.draft_to_target] = logits
    return full


def _export(head, tmp_path, fmt, target=None, name="out"):
    save_head(head, tmp_path / f"{name}-src")
    return export_head(tmp_path / f"{name}-src", tmp_path / name, fmt, target)


def _runtime_fc_input(folder, target, fmt):
    """The fc input as the runtime builds it: the hidden states it captures for the config's aux ids, in layer
    order (SGLang adds 1 to each id; vLLM reads HF hidden_states indices), concatenated."""
    config = json.loads((folder / "config.json").read_text())
    if fmt == "sglang":
        layers = {i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]}
    else:
        layers = set(config["eagle_aux_hidden_state_layer_ids"])
    states = target.model(IDS, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in sorted(layers)], dim=-1)


# ---- round trips: export, load back, same logits ---------------------------------------------------------------
@pytest.mark.parametrize("fmt,head_type", [("sglang", "eagle3"), ("speculators", "eagle3"), ("eagle", "eagle1")])
def test_round_trip_through_foreign_layout(tmp_path, fmt, head_type):
    target = tiny_target("llama", num_layers=8)  # default fused ids (2, 4, 5): three, as the runtimes need
    head = _head(target, head_type)
    _export(head, tmp_path, fmt, target, name=fmt)
    foreign = load_head(tmp_path / fmt, target)
    torch.testing.assert_close(_logits(foreign, target), _logits(head, target), rtol=0, atol=0)
    export_head(tmp_path / fmt, tmp_path / "back", "eyas")  # foreign -> eyas
    back = load_head(tmp_path / "back", target)
    assert back.config == head.config
    assert json.loads((tmp_path / "back" / "config.json").read_text())["target"]["tokenizer_fingerprint"] == ""
    torch.testing.assert_close(_logits(back, target), _logits(head, target), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
@pytest.mark.parametrize("fused", [(5, 2, 4), (4, 2), (6,), (2, 2, 5)], ids=["unsorted", "two", "one", "repeated"])
def test_fused_layers_convert_exactly_to_three_in_layer_order(tmp_path, fmt, fused):
    """Runtimes fuse exactly three captured layers, concatenated in layer order: the export sorts the fc blocks
    with their ids, sums repeated ones and pads with zero blocks, so the runtime's fc input gives the head's."""
    target = tiny_target("llama", num_layers=8)
    head = _head(target, fused_layer_ids=fused)
    folder = _export(head, tmp_path, fmt, target)
    config = json.loads((folder / "config.json").read_text())
    ids = config["eagle_aux_hidden_state_layer_ids"] if fmt == "speculators" else \
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert len(ids) == len(set(ids)) == 3 and ids == sorted(ids)
    fc = load_file(str(folder / "model.safetensors"))["fc.weight"]
    assert fc.shape == (64, 3 * 64)
    ours = head.fuse(target(IDS, layer_ids=fused).features)
    torch.testing.assert_close(_runtime_fc_input(folder, target, fmt) @ fc.T, ours, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_logits(load_head(folder, target), target), _logits(head, target), rtol=1e-5, atol=1e-5)


def test_fused_layers_that_no_runtime_can_read_are_refused(tmp_path):
    target = tiny_target("llama", num_layers=8)
    with pytest.raises(ValueError, match="4 distinct target layers.*exactly 3"):
        _export(_head(target, fused_layer_ids=(1, 2, 4, 6)), tmp_path, "speculators", target)
    with pytest.raises(ValueError, match="embedding output"):  # SGLang's id -1: it cannot capture layer 0's input
        _export(_head(target, fused_layer_ids=(0, 2, 4)), tmp_path, "sglang", target)
    folder = _export(_head(target, fused_layer_ids=(0, 2, 4)), tmp_path, "speculators", target)  # vLLM captures it
    assert json.loads((folder / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    weights = _released_weights(target, "layers.0")
    weights["fc.weight"] = weights["fc.weight"][:, :128].contiguous()  # a foreign head fusing two layers
    _write(tmp_path / "two", _redhat_config(eagle_aux_hidden_state_layer_ids=[2, 4], norm_before_residual=False),
           weights)
    with pytest.raises(ValueError, match="pass --target"):  # padding needs the target's layer count
        export_head(tmp_path / "two", tmp_path / "x", "sglang")
    export_head(tmp_path / "two", tmp_path / "x", "sglang", target)
    assert json.loads((tmp_path / "x" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]  # eyas 1 (the first capturable spare), 2, 4


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_full_vocab_head_is_written_without_maps_and_rows_in_target_order(tmp_path, fmt):
    """vLLM has no d2t parameter when the draft vocab is the whole vocab, and the EAGLE-3 reference drops it:
    the lm_head rows must already be in target-id order."""
    target = tiny_target("llama", num_layers=8)
    head = _head(target, draft_vocab_size=320)  # a permuted full vocab: the map is not the identity
    assert not torch.equal(head.draft_to_target, torch.arange(320))
    folder = _export(head, tmp_path, fmt, target)
    weights = load_file(str(folder / "model.safetensors"))
    assert "d2t" not in weights and "t2d" not in weights
    feat = head.fuse(target(IDS, layer_ids=head.config.fused_layer_ids).features)
    hidden = head(IDS, feat, torch.arange(7).expand(2, -1), logits=False).hidden
    runtime_logits = head.norm(hidden) @ weights["lm_head.weight"].T  # row j scores target id j
    torch.testing.assert_close(runtime_logits, _logits(head, target), rtol=1e-6, atol=1e-6)
    again = load_head(folder, target)
    assert torch.equal(again.draft_to_target, torch.arange(320))
    torch.testing.assert_close(_logits(again, target), _logits(head, target), rtol=0, atol=0)


# ---- what each layout writes -----------------------------------------------------------------------------------
def test_sglang_layout_fields_and_keys(tmp_path):
    target = tiny_target("llama", num_layers=8)
    head = _head(target)
    folder = _export(head, tmp_path, "sglang", target)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["tie_word_embeddings"], config["torch_dtype"]) == (1, False, "float32")
    assert (config["vocab_size"], config["draft_vocab_size"], config["hidden_size"]) == (320, 100, 64)
    assert (config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]) == (2, 16, 128)
    # SpecForge/SGLang record layer outputs: one less than eyas' layer-input ids (2, 4, 5).
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    weights = load_file(str(folder / "model.safetensors"))
    assert set(weights) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                            "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                            *[f"midlayer.{k}" for k in LAYER0]}
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(100) + weights["d2t"], head.draft_to_target)
    assert weights["t2d"].sum() == 100 and weights["t2d"][head.draft_to_target].all()


def test_speculators_layout_fields_and_keys(tmp_path):
    target = tiny_target("llama", num_layers=8)
    head = _head(target, num_layers=2, norm_before_residual=True)  # vLLM builds num_hidden_layers layers
    folder = _export(head, tmp_path, "speculators", target)
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM numbering = eyas numbering
    assert config["norm_before_residual"] is True and config["draft_vocab_size"] == 100
    assert config["speculators_version"] == SPECULATORS_VERSION  # installed (as on CI) or the release followed
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    method = spec["proposal_methods"][0]
    assert method["proposal_type"] == "greedy" and method["speculative_tokens"] >= 1
    assert spec["verifier"] == {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"]}
    layer = config["transformer_layer_config"]
    assert (layer["num_hidden_layers"], layer["vocab_size"], layer["hidden_size"]) == (2, 320, 64)
    assert "layer_types" not in layer  # no window: full attention
    weights = load_file(str(folder / "model.safetensors"))
    assert set(weights) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight",
                            "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight",
                            "layers.1.input_layernorm.weight", *[f"layers.{i}.{k}" for i in (0, 1) for k in LAYER0]}
    assert torch.equal(weights["embed_tokens.weight"], target.embed_tokens.weight)  # speculators loads it from here
    again = load_head(folder, target)
    assert again.config.options.norm_before_residual
    torch.testing.assert_close(_logits(again, target), _logits(head, target), rtol=0, atol=0)


def test_speculators_verifier_names_a_loadable_model(tmp_path, monkeypatch):
    aliased = Target(tiny_model("llama", num_layers=8), tiny_tokenizer(), "smollm2-135m")
    config = json.loads((_export(_head(aliased), tmp_path, "speculators", aliased, "a") / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    model = tiny_model("qwen2", num_layers=8)
    model.save_pretrained(tmp_path / "qwen")
    monkeypatch.chdir(tmp_path)  # a relative target path is written absolute
    save_head(_head(Target(model, tiny_tokenizer(), "qwen")), tmp_path / "rel-src")
    export_head(tmp_path / "rel-src", tmp_path / "rel", "speculators")  # no target: config.json on disk names the class
    verifier = json.loads((tmp_path / "rel" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str((tmp_path / "qwen").resolve()), "architectures": ["Qwen2ForCausalLM"]}
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9" if name == "speculators" else version(name))
    config = json.loads((_export(_head(aliased), tmp_path, "speculators", aliased, "v") / "config.json").read_text())
    assert config["speculators_version"] == "9.9.9"  # the installed release, when there is one


def test_sliding_window_head_exports_its_window_to_vllm_only(tmp_path):
    target = tiny_target("llama", num_layers=8)
    head = _head(target, sliding_window=4)
    folder = _export(head, tmp_path, "speculators", target)
    layer = json.loads((folder / "config.json").read_text())["transformer_layer_config"]
    assert (layer["layer_types"], layer["sliding_window"]) == (["sliding_attention"], 4)
    assert load_head(folder, target).config == head.config
    with pytest.raises(ValueError, match="4-token window"):
        _export(head, tmp_path, "sglang", target, "s")
    with pytest.raises(ValueError, match="norm_before_residual"):
        _export(_head(target, norm_before_residual=True), tmp_path, "sglang", target, "n")


# head fields -> a speculators export the library's own model must compute as eyas does: the fused ids sorted,
# padded with a zero block or summed, the variant flag, a full vocabulary without maps, several layers, a window
SPECULATORS_HEADS = {
    "reduced-vocab": dict(),
    "unsorted-norm-before-residual": dict(fused_layer_ids=(5, 2, 4), norm_before_residual=True),
    "two-layers-fused": dict(fused_layer_ids=(4, 2)),
    "repeated-layer": dict(fused_layer_ids=(2, 2, 5)),
    "full-vocab-two-decoder-layers": dict(draft_vocab_size=320, num_layers=2),
    "sliding-window": dict(sliding_window=4),
}


def _drafting_logits(head, target):
    """`_logits` as drafting computes them: through the head's cache with a mask, where its own window applies."""
    b, t = IDS.shape
    feat = head.fuse(target(IDS, layer_ids=head.config.fused_layer_ids).features)
    logits = head(IDS, feat, torch.arange(t).expand(b, -1), causal(t)[None].expand(b, -1, -1),
                  head.new_cache(b, t)).logits
    full = logits.new_full((b, t, head.config.vocab_size), float("-inf"))
    full[..., head.draft_to_target] = logits
    return full


@pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                    reason="the speculators library is not installed (.ci/run installs it)")
@pytest.mark.parametrize("fields", SPECULATORS_HEADS.values(), ids=SPECULATORS_HEADS)
def test_speculators_library_computes_the_exported_heads_logits(tmp_path, monkeypatch, fields):
    """speculators 0.9.0's own Eagle3DraftModel loads the speculators export (the verifier's weights from the target
    folder it names) and computes the head's draft logits from the states vLLM captures for its aux ids."""
    from speculators.models.eagle3 import Eagle3DraftModel

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tiny_model("llama", num_layers=8)
    model.save_pretrained(tmp_path / "target")
    target = Target(model, tiny_tokenizer(), str(tmp_path / "target"))
    head = _head(target, **fields)
    folder = _export(head, tmp_path, "speculators", target)
    theirs = Eagle3DraftModel.from_pretrained(str(folder)).eval()
    aux_ids = json.loads((folder / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    states = target.model(IDS, output_hidden_states=True).hidden_states
    aux = torch.cat([states[i] for i in aux_ids], dim=-1)
    drafts = []
    theirs.lm_head.register_forward_hook(lambda module, args, out: drafts.append(out))
    with torch.no_grad():  # one TTT step drafts at every position; speculators takes one packed sequence per call
        for row in range(IDS.shape[0]):
            theirs(aux[row:row + 1], IDS[row:row + 1], document_ids=torch.zeros_like(IDS[row:row + 1]),
                   position_ids=torch.arange(IDS.shape[1])[None], ttt_steps=1)
    draft = torch.cat(drafts)  # [B, T, draft vocab], rows in the export's order
    logits = draft.new_full((*draft.shape[:2], target.vocab_size), float("-inf"))
    logits[..., torch.arange(draft.shape[-1]) + (theirs.d2t if theirs.use_draft_vocab else 0)] = draft
    # the same fp32 head by two implementations (flex attention and other kernels): rounding apart, ~2e-6 here
    torch.testing.assert_close(logits, _drafting_logits(head, target), rtol=1e-5, atol=1e-5)


def test_eagle1_export_loads_in_the_pypi_reference(tmp_path, caplog):
    """eagle-llm 1.2.1 reads pytorch_model.bin strictly, embedding included, and rotates at base 10000."""
    target = tiny_target("llama", num_layers=4)
    head = _head(target, "eagle1", rope_theta=10000.0)
    folder = _export(head, tmp_path, "eagle", target)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "pytorch_model.bin"]
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    assert set(state) == set(head.state_dict()) | {"embed_tokens.weight"}
    assert torch.equal(state["embed_tokens.weight"], target.embed_tokens.weight)
    config = json.loads((folder / "config.json").read_text())
    assert config["bias"] is True and config["architectures"] == ["LlamaForCausalLM"]
    assert "eagle-llm" not in caplog.text
    with caplog.at_level(logging.WARNING):
        _export(_head(target, "eagle1", rope_theta=5e5), tmp_path, "eagle", target, "theta")
    assert "rope_theta 500000, eagle-llm 1.2.1 at 10000" in caplog.text
    with pytest.raises(ValueError, match="pass --target"):
        _export(head, tmp_path, "eagle", None, "notarget")
    with pytest.raises(ValueError, match="hidden_size // num_heads"):
        _export(_head(target, "eagle1", head_dim=8), tmp_path, "eagle", target, "hd")


def test_eagle1_export_runs_in_eagle_llm(tmp_path):
    """The export, loaded strictly by eagle-llm 1.2.1's own Model, computes the head's hidden states."""
    cnets = pytest.importorskip("eagle.model.cnets", reason="eagle-llm 1.2.1 is not installed")
    from eagle.model.configs import EConfig

    target = tiny_target("llama", num_layers=4)
    head = _head(target, "eagle1", rope_theta=10000.0, num_layers=2)
    folder = _export(head, tmp_path, "eagle", target)
    config = EConfig.from_pretrained(str(folder))
    config.rope_scaling = None  # transformers 5 fills a null rope_scaling with defaults; the release's 4.x did not
    reference = cnets.Model(config, bias=True).eval()
    reference.load_state_dict(torch.load(folder / "pytorch_model.bin", weights_only=True), strict=True)
    feat = target(IDS).hidden
    theirs = reference(feat, input_ids=IDS)
    ours = head(IDS, head.fuse(feat), torch.arange(7).expand(2, -1), logits=False).hidden
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


# ---- released layouts import as they were trained ----------------------------------------------------------------
def _reference_eagle3(weights, llama, target, fused, norm_before_residual):
    """Draft logits [B, T, draft_vocab] of an EAGLE-3 head as the speculators library / EAGLE-3 reference compute
    them, built from transformers' own Llama decoder layer with 2H-wide q/k/v (speculators' first layer)."""
    fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "max_position_embeddings")
    config = LlamaConfig(**{k: llama[k] for k in fields},
                         rope_parameters={"rope_type": "default", "rope_theta": llama.get("rope_theta", 10000.0)})
    config._attn_implementation = "sdpa"
    h = config.hidden_size
    layer = LlamaDecoderLayer(config, 0)
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(layer.self_attn, name)
        setattr(layer.self_attn, name, torch.nn.Linear(2 * h, old.out_features, bias=False))
    layer.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
    prefix = "midlayer." if "midlayer.hidden_norm.weight" in weights else "layers.0."
    layer.load_state_dict({k.removeprefix(prefix): v.float() for k, v in weights.items() if k.startswith(prefix)})
    norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
    norm.weight.data = weights["norm.weight"].float()
    emb = target.embed_tokens(IDS)
    hidden = target(IDS, layer_ids=fused).features @ weights["fc.weight"].float().T
    residual = layer.hidden_norm(hidden) if norm_before_residual else hidden
    x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
    rope = LlamaRotaryEmbedding(config)(x, torch.arange(IDS.shape[1])[None])
    x = residual + layer.self_attn(x, position_embeddings=rope, attention_mask=None)[0]
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return norm(x) @ weights["lm_head.weight"].float().T


def _released_weights(target, prefix, dtype=torch.bfloat16, seed=3):
    """Random head weights named as released checkpoints name them, with the target's embedding as speculators
    saves it; d2t/t2d for a 100-token draft vocab."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (64, 192), "norm.weight": (64,), "lm_head.weight": (100, 64),
              f"{prefix}.input_layernorm.weight": (64,), f"{prefix}.hidden_norm.weight": (64,),
              f"{prefix}.post_attention_layernorm.weight": (64,), f"{prefix}.self_attn.q_proj.weight": (64, 128),
              f"{prefix}.self_attn.k_proj.weight": (32, 128), f"{prefix}.self_attn.v_proj.weight": (32, 128),
              f"{prefix}.self_attn.o_proj.weight": (64, 64), f"{prefix}.mlp.gate_proj.weight": (128, 64),
              f"{prefix}.mlp.up_proj.weight": (128, 64), f"{prefix}.mlp.down_proj.weight": (64, 128)}
    w = {k: (torch.randn(s, generator=g) * 0.1 + (1.0 if len(s) == 1 else 0.0)).to(dtype) for k, s in shapes.items()}
    draft = torch.randperm(320, generator=g)[:100].sort().values
    w["d2t"], w["t2d"] = draft - torch.arange(100), torch.zeros(320, dtype=torch.bool).index_fill(0, draft, True)
    w["embed_tokens.weight"] = target.embed_tokens.weight.detach().to(dtype)  # dropped on import: borrowed
    return w


def _write(folder, config, weights, bin_file=False):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if bin_file:
        torch.save(weights, folder / "pytorch_model.bin")
    else:
        save_file(weights, str(folder / "model.safetensors"))
    return folder


def _check_released(folder, target, weights, llama, fused, norm_before_residual):
    head = load_head(folder, target)
    assert head.config.fused_layer_ids == fused and head.config.options.norm_before_residual == norm_before_residual
    expected = _reference_eagle3(weights, llama, target, fused, norm_before_residual)
    full = expected.new_full((2, 7, 320), float("-inf"))
    full[..., torch.arange(100) + weights["d2t"]] = expected
    torch.testing.assert_close(_logits(head, target), full, rtol=1e-4, atol=1e-4)


REDHAT_LAYER = {  # transformer_layer_config as speculators serialises a Llama layer (tiny sizes)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2,
    "eos_token_id": 3, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 512, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 4, "num_hidden_layers": 1, "num_key_value_heads": 2, "pretraining_tp": 1,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 320}


def _redhat_config(**over):
    """A config.json shaped like RedHatAI's released speculators EAGLE-3 heads."""
    return {"architectures": ["Eagle3Speculator"], "draft_vocab_size": 100, "norm_before_residual": True,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3,
                                      "verifier_accept_k": 1}],
                "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "Qwen/Qwen3-8B"}},
            "speculators_model_type": "eagle3", "speculators_version": "0.1.0.dev42", "target_hidden_size": None,
            "torch_dtype": "bfloat16", "transformer_layer_config": REDHAT_LAYER, "transformers_version": "4.52.4",
            **over}


@pytest.mark.parametrize("norm_before_residual", [True, False])
def test_redhat_speculators_head_imports_as_trained(tmp_path, norm_before_residual):
    target = tiny_target("llama", num_layers=8)
    weights = _released_weights(target, "layers.0")
    config = _redhat_config(norm_before_residual=norm_before_residual)  # no aux ids recorded: defaults 2, N//2, N-3
    folder = _write(tmp_path / "redhat", config, weights)
    _check_released(folder, target, weights, REDHAT_LAYER, (2, 4, 5), norm_before_residual)
    assert load_head(folder, target).config.target.name_or_path == "Qwen/Qwen3-8B"
    export_head(folder, tmp_path / "again", "speculators", target)  # and back out with the variant kept
    assert json.loads((tmp_path / "again" / "config.json").read_text())["norm_before_residual"] is norm_before_residual
    torch.testing.assert_close(_logits(load_head(tmp_path / "again", target), target),
                               _logits(load_head(folder, target), target), rtol=0, atol=0)


def test_eagle3_reference_head_imports_as_trained(tmp_path):
    """As SafeAILab's EAGLE-3 training writes it: LlamaForCausalLM + draft_vocab_size, midlayer.*, .bin, no ids."""
    target = tiny_target("llama", num_layers=8)
    weights = _released_weights(target, "midlayer", dtype=torch.float16)
    del weights["embed_tokens.weight"]  # the reference loads the embedding from the target
    config = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 2, "eos_token_id": 3, "hidden_act": "silu",
              "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 512,
              "model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
              "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
              "transformers_version": "4.28.1", "use_cache": True, "vocab_size": 320, "draft_vocab_size": 100}
    folder = _write(tmp_path / "eagle3", config, weights, bin_file=True)
    _check_released(folder, target, weights, {**config, "head_dim": 16}, (2, 4, 5), False)
    with pytest.raises(ValueError, match="does not record the fused target layers"):
        load_head(folder)


def test_specforge_sglang_head_imports_as_trained(tmp_path):
    target = tiny_target("llama", num_layers=8)
    weights = _released_weights(target, "midlayer")
    del weights["embed_tokens.weight"]
    config = {"architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 2, "draft_vocab_size": 100, "eos_token_id": 3, "head_dim": 16, "hidden_act": "silu",
              "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 512,
              "mlp_bias": False, "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 1,
              "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "transformers_version": "4.51.0", "use_cache": True, "vocab_size": 320,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6], "use_aux_hidden_state": True}}
    folder = _write(tmp_path / "specforge", config, weights)
    _check_released(folder, target, weights, config, (2, 4, 7), False)  # SGLang ids are layer outputs: +1


def test_released_sliding_window_layers(tmp_path):
    target = tiny_target("llama", num_layers=8)
    weights = _released_weights(target, "layers.0")
    layer = {**REDHAT_LAYER, "layer_types": ["sliding_attention"], "sliding_window": 128}
    folder = _write(tmp_path / "swa", _redhat_config(transformer_layer_config=layer), weights)
    assert load_head(folder, target).config.sliding_window == 128
    full = {**REDHAT_LAYER, "layer_types": ["full_attention"], "sliding_window": 128}
    assert load_head(_write(tmp_path / "full", _redhat_config(transformer_layer_config=full), weights),
                     target).config.sliding_window is None
    mixed = {**REDHAT_LAYER, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
             "sliding_window": 128}
    with pytest.raises(ValueError, match="mixes attention kinds"):
        load_head(_write(tmp_path / "mixed", _redhat_config(transformer_layer_config=mixed), weights), target)


def test_eagle1_reference_folder_with_pytorch_bin(tmp_path):
    """A folder as the EAGLE-1 reference writes it: LlamaConfig + pytorch_model.bin, embedding included."""
    target = tiny_target("qwen2", tied=True)
    head = _head(target, "eagle1", rope_theta=10000.0)
    state = dict(head.state_dict())
    assert "fc.bias" in state and "layers.0.input_layernorm.weight" not in state  # the reference's layer 0
    state["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()  # borrowed: ignored on load
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
              "vocab_size": 320, "max_position_embeddings": 512}  # no rope_theta: the reference's 10000
    loaded = load_head(_write(tmp_path / "e", config, state, bin_file=True), target)
    torch.testing.assert_close(_logits(loaded, target), _logits(head, target), rtol=0, atol=0)


# ---- CLI, dtype, refusals ----------------------------------------------------------------------------------------
def test_export_cli_from_training_checkpoint(tmp_path, capsys):
    target = tiny_target("llama", num_layers=8)
    head = _head(target)
    save_head(head, tmp_path / "ckpt" / "head")
    (tmp_path / "ckpt" / "optimizer.pt").write_bytes(b"")  # whatever else a checkpoint holds
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "v"), "--format", "speculators"]) == 0
    assert "speculators" in capsys.readouterr().out
    exported = load_head(tmp_path / "v", target)
    torch.testing.assert_close(_logits(exported, target), _logits(head, target), rtol=0, atol=0)
    assert main(["export", str(tmp_path / "v"), "--out", str(tmp_path / "e")]) == 0  # default format: eyas
    assert "eyas_format" in json.loads((tmp_path / "e" / "config.json").read_text())


def test_export_keeps_dtype(tmp_path):
    target = tiny_target("llama", num_layers=8)
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
        export_head(tmp_path / "deep", tmp_path / "x", "eagle", target)
    with pytest.raises(ValueError, match="exactly 1 decoder layer"):
        export_head(tmp_path / "deep", tmp_path / "x", "sglang")
    last = DraftHead(head_config_for(target, "eagle3", fused_layer_ids=(1, 2, 4)), target)  # 4 = final normed state
    save_head(last, tmp_path / "last")
    with pytest.raises(ValueError, match="final \\*normed\\* state"):
        export_head(tmp_path / "last", tmp_path / "x", "speculators")
    save_head(DraftHead(head_config_for(target, "eagle3", attention_bias=True), target), tmp_path / "qkv_bias")
    with pytest.raises(ValueError, match="no Llama-config equivalent"):
        export_head(tmp_path / "qkv_bias", tmp_path / "x", "sglang", target)
    with pytest.raises(ValueError, match="unknown export format"):
        export_head(tmp_path / "e1", tmp_path / "x", "onnx")
    with pytest.raises(FileNotFoundError, match="training checkpoint"):
        export_head(tmp_path / "nothing", tmp_path / "x", "eyas")
    assert not (tmp_path / "x").exists()


def test_foreign_load_errors_name_the_problem(tmp_path):
    target = tiny_target("llama", num_layers=8)
    folder = _export(_head(target), tmp_path, "sglang", target, "s")
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))

    _write(tmp_path / "bert", {"architectures": ["BertModel"]}, weights)
    with pytest.raises(ValueError, match="unknown head layout"):
        load_head(tmp_path / "bert")
    model_config = {k: v for k, v in config.items() if k not in ("draft_vocab_size", "eagle_config")}
    _write(tmp_path / "model", {**model_config, "architectures": ["LlamaForCausalLM"]},
           {"model.embed_tokens.weight": torch.zeros(320, 64)})
    with pytest.raises(ValueError, match="not an EAGLE draft head"):
        load_head(tmp_path / "model")
    _write(tmp_path / "bias", {**config, "attention_bias": True}, weights)
    with pytest.raises(ValueError, match="attention_bias"):
        load_head(tmp_path / "bias")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_head(tmp_path / "noweights")
    _write(tmp_path / "nohead", config, {k: v for k, v in weights.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        load_head(tmp_path / "nohead")
    _write(tmp_path / "narrow", {**config, "intermediate_size": 96}, weights)
    with pytest.raises(ValueError, match="midlayer.mlp|mlp.gate_proj.weight"):
        load_head(tmp_path / "narrow")
    _write(tmp_path / "rope", {**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, weights)
    with pytest.raises(ValueError, match="rope scaling"):
        load_head(tmp_path / "rope")
    _write(tmp_path / "nomap", {**config}, {k: v for k, v in weights.items() if k not in ("d2t", "t2d")})
    with pytest.raises(ValueError, match="no d2t map"):
        load_head(tmp_path / "nomap")

    spec_weights = _released_weights(target, "layers.0")
    _write(tmp_path / "ambiguous", {k: v for k, v in _redhat_config().items() if k != "norm_before_residual"},
           spec_weights)
    with pytest.raises(ValueError, match="norm_before_residual is missing"):
        load_head(tmp_path / "ambiguous", target)
    _write(tmp_path / "fc_norm", _redhat_config(fc_norm=True), spec_weights)
    with pytest.raises(ValueError, match="fc_norm"):
        load_head(tmp_path / "fc_norm", target)
    _write(tmp_path / "qwen3", _redhat_config(transformer_layer_config={**REDHAT_LAYER, "model_type": "qwen3"}),
           spec_weights)
    with pytest.raises(ValueError, match="qwen3"):
        load_head(tmp_path / "qwen3", target)
    _write(tmp_path / "medusa", _redhat_config(speculators_model_type="medusa"), spec_weights)
    with pytest.raises(ValueError, match="medusa"):
        load_head(tmp_path / "medusa", target)
