import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from eyas.inference.cli import main
from eyas.models import DraftHead, Target, load_head, save_head
from eyas.models.errors import InputError
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
    if head.algorithm.reduced_vocab:
        vocab = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(seed))
        head.set_vocab_map(vocab[: head.config.draft_vocab_size])
    return head


def _logits(head, target):
    """Draft logits in *target-id* space [B, T, V] (-inf outside the draft vocab): comparable across layouts
    that store the draft rows in different orders."""
    out = target(IDS, layer_ids=head.config.fused_layer_ids)
    feat = out.features if head.config.fused_layer_ids else out.hidden
    return _in_target_ids(head, head(IDS, head.fuse(feat), torch.arange(IDS.shape[1]).expand(2, -1)).logits)


def _in_target_ids(head, logits, draft_to_target=None):
    """Draft logits [..., draft_vocab] -> [..., V] scattered to the target ids draft row i stands for (the head's map
    unless given), -inf elsewhere."""
    if not head.algorithm.reduced_vocab:
        return logits
    full = logits.new_full((*logits.shape[:-1], head.config.vocab_size), float("-inf"))
    full[..., head.draft_to_target if draft_to_target is None else draft_to_target] = logits
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
ROUND_TRIPS = {  # (format, head type, head fields): every head a foreign layout holds, and every option it carries
    "sglang": ("sglang", "eagle3", {}),
    "speculators": ("speculators", "eagle3", {}),
    "eagle": ("eagle", "eagle1", {}),
    "speculators-fc-norm": ("speculators", "eagle3", dict(fc_norm=True)),
    "speculators-norm-before-fc": ("speculators", "eagle3", dict(norm_before_fc=True, norm_before_residual=True)),
    "speculators-norm-output": ("speculators", "eagle3", dict(norm_output=True, num_layers=2)),
    "speculators-peagle": ("speculators", "peagle", dict(num_layers=2, depths=3)),
    "speculators-peagle-norm-before-fc": ("speculators", "peagle", dict(norm_before_fc=True, norm_output=True)),
}


@pytest.mark.parametrize("fmt,head_type,fields", ROUND_TRIPS.values(), ids=ROUND_TRIPS)
def test_round_trip_through_foreign_layout(tmp_path, fmt, head_type, fields):
    target = tiny_target("llama", num_layers=8)  # default fused ids (2, 4, 5): three, as the runtimes need
    head = _head(target, head_type, **fields)
    _export(head, tmp_path, fmt, target, name=fmt)
    foreign = load_head(tmp_path / fmt, target)
    torch.testing.assert_close(_logits(foreign, target), _logits(head, target), rtol=0, atol=0)
    export_head(tmp_path / fmt, tmp_path / "back", "eyas")  # foreign -> eyas
    back = load_head(tmp_path / "back", target)
    assert back.config == head.config
    assert all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())  # mask_hidden, norms too
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


# head fields -> None where the conversion to three layers in layer order is exact, else what its refusal names
FUSION_WITH_NORMS = {
    "fc-norm-unsorted": ("eagle3", dict(fused_layer_ids=(5, 2, 4), fc_norm=True), None),
    "fc-norm-two": ("eagle3", dict(fused_layer_ids=(4, 2), fc_norm=True), None),
    "fc-norm-one": ("eagle3", dict(fused_layer_ids=(6,), fc_norm=True), None),
    "fc-norm-repeated": ("eagle3", dict(fused_layer_ids=(2, 2, 5), fc_norm=True), None),
    "norm-before-fc-unsorted": ("eagle3", dict(fused_layer_ids=(5, 2, 4), norm_before_fc=True), None),
    "norm-before-fc-two": ("eagle3", dict(fused_layer_ids=(4, 2), norm_before_fc=True), "norm_before_fc"),
    "norm-before-fc-repeated": ("eagle3", dict(fused_layer_ids=(2, 2, 5), norm_before_fc=True), "norm_before_fc"),
    "peagle-unsorted-norm-before-fc": ("peagle", dict(fused_layer_ids=(5, 2, 4), norm_before_fc=True), None),
    "peagle-two": ("peagle", dict(fused_layer_ids=(4, 2)), None),
    "peagle-repeated": ("peagle", dict(fused_layer_ids=(2, 2, 5)), "mask_hidden"),
}


def _runtime_fusion(weights, states, eps):
    """What vLLM's combine_hidden_states makes of states [..., 3H] (captured in layer order) with the exported
    weights: input_norm over the whole (norm_before_fc) or fc_norm.j over block j, then the fc. The norms are
    transformers' LlamaRMSNorm, the class speculators builds."""
    def norm(weight, x):
        module = LlamaRMSNorm(weight.numel(), eps=eps)
        module.weight.data = weight
        return module(x)

    if "input_norm.weight" in weights:
        states = norm(weights["input_norm.weight"], states)
    if "fc_norm.0.weight" in weights:
        states = torch.cat([norm(weights[f"fc_norm.{j}.weight"], x) for j, x in enumerate(states.chunk(3, -1))], -1)
    return states @ weights["fc.weight"].T


@pytest.mark.parametrize("head_type,fields,refusal", FUSION_WITH_NORMS.values(), ids=FUSION_WITH_NORMS)
def test_fused_layer_conversion_carries_each_blocks_norm_and_mask_state(tmp_path, head_type, fields, refusal):
    """fc_norm: a block's norm weight moves with its fc block; a layer fused twice folds its norms into its summed
    fc block (W_a diag(g_a) + W_b diag(g_b), a unit norm: RMS normalisation without its weight is one function of
    the state); a spare layer gets a zero block and a unit norm. norm_before_fc (one norm over the concatenation):
    only a reordering keeps its RMS, so padding and summing are refused. P-EAGLE's mask state moves block by
    block, and a layer fused twice has two mask blocks that no one block can stand for. The runtime's fusion of
    the captured states, and of the mask state, gives the head's."""
    target = tiny_target("llama", num_layers=8)
    head = _head(target, head_type, **fields)
    if refusal:
        with pytest.raises(ValueError, match=f"{refusal}.*no exact conversion"):
            _export(head, tmp_path, "speculators", target)
        return
    folder = _export(head, tmp_path, "speculators", target)
    ids = json.loads((folder / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    weights = load_file(str(folder / "model.safetensors"))
    states = target.model(IDS, output_hidden_states=True).hidden_states
    features = target(IDS, layer_ids=fields["fused_layer_ids"]).features
    pairs = [(torch.cat([states[i] for i in ids], -1), head.fuse(features))]  # (runtime's fc input, head's state)
    if head_type == "peagle":
        assert weights["mask_hidden"].shape == (1, 1, 192)  # as speculators' PEagleDraftModel holds it
        pairs.append((weights["mask_hidden"][0, 0], head.fuse(head.mask_hidden)))
    for captured, ours in pairs:  # folding rounds differently: fp32 rounding apart
        torch.testing.assert_close(_runtime_fusion(weights, captured, head.config.rms_norm_eps), ours,
                                   rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(load_head(folder, target), target), _logits(head, target), rtol=1e-5, atol=1e-5)


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
    assert (config["fc_norm"], config["norm_before_fc"], config["norm_output"]) == (False, False, False)
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


def test_speculators_layout_holds_peagle_heads(tmp_path):
    """P-EAGLE as speculators' PEagleSpeculatorConfig and vLLM's update_peagle read it: the mask token (vLLM's pard
    token), the draft positions as the proposal's speculative tokens, mask_hidden stored [1, 1, F]; loaded back, it
    proposes what the head proposes."""
    target = tiny_target("llama", num_layers=8)
    head = _head(target, "peagle", num_layers=2, depths=5, norm_before_fc=True)
    folder = _export(head, tmp_path, "speculators", target)
    config = json.loads((folder / "config.json").read_text())
    assert (config["speculators_model_type"], config["architectures"]) == ("peagle", ["PEagleSpeculator"])
    assert config["speculators_config"]["algorithm"] == "peagle"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert config["mask_token_id"] == head.options.mask_token_id is not None
    assert (config["norm_before_fc"], config["fc_norm"]) == (True, False)
    weights = load_file(str(folder / "model.safetensors"))
    assert weights["mask_hidden"].shape == (1, 1, 192) and "input_norm.weight" in weights
    again = load_head(folder, target)
    assert again.config == head.config
    feat = target(IDS, layer_ids=head.config.fused_layer_ids).features
    pos = torch.arange(7).expand(2, -1)
    proposals = [h.propose(IDS, feat, pos, [7, 5], h.new_cache(2, 16), 5) for h in (head, again)]  # [B, 5, vocab]
    torch.testing.assert_close(proposals[1], proposals[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="fc_norm: vLLM 0.32 does not read it for peagle heads"):
        _export(_head(target, "peagle", fc_norm=True), tmp_path, "speculators", target, "fc_norm")


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
# padded with a zero block or summed, the variant flags, a full vocabulary without maps, several layers, a window
SPECULATORS_HEADS = {
    "reduced-vocab": dict(),
    "unsorted-norm-before-residual": dict(fused_layer_ids=(5, 2, 4), norm_before_residual=True),
    "two-layers-fused": dict(fused_layer_ids=(4, 2)),
    "repeated-layer": dict(fused_layer_ids=(2, 2, 5)),
    "full-vocab-two-decoder-layers": dict(draft_vocab_size=320, num_layers=2),
    "sliding-window": dict(sliding_window=4),
    "fc-norm-unsorted-two-decoder-layers": dict(fused_layer_ids=(5, 2, 4), fc_norm=True, num_layers=2),
    "fc-norm-repeated-layer": dict(fused_layer_ids=(2, 2, 5), fc_norm=True),
    "fc-norm-two-layers-fused": dict(fused_layer_ids=(4, 2), fc_norm=True),
    "norm-before-fc-unsorted-two-decoder-layers": dict(fused_layer_ids=(5, 2, 4), norm_before_fc=True, num_layers=2),
    "norm-output-two-decoder-layers": dict(norm_output=True, num_layers=2),
}


def _drafting_logits(head, target, steps=1):
    """`_logits` as drafting computes them, through the head's cache with a mask (its own window applies): step 0 at
    every index t, then (steps=2) the next step at every t < T-1 as drafting takes it: token t+1 at position t+1,
    the state step 0 hands on (`feedback`), seeing step 0's entries up to t and itself."""
    b, t = IDS.shape
    feat = head.fuse(target(IDS, layer_ids=head.config.fused_layer_ids).features)
    pos, cache = torch.arange(t).expand(b, -1), head.new_cache(b, 2 * t)
    first = head(IDS, feat, pos, causal(t)[None].expand(b, -1, -1), cache)
    out = [first.logits]
    if steps == 2:
        allowed = torch.cat([causal(t)[:-1], torch.eye(t - 1, dtype=torch.bool)], 1)[None].expand(b, -1, -1)
        out.append(head(IDS[:, 1:], head.feedback(first.hidden[:, :-1]), pos[:, 1:], allowed, cache).logits)
    return [_in_target_ids(head, logits) for logits in out]


def _saved_target(tmp_path, monkeypatch, arch="llama", num_layers=8):
    """A target whose folder speculators can load as the export's verifier (offline)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tiny_model(arch, num_layers=num_layers)
    model.save_pretrained(tmp_path / "target")
    return Target(model, tiny_tokenizer(), str(tmp_path / "target"))


def _speculators_model(cls, folder):
    """speculators' model class `cls` loading the export, with dense masks: flex attention's block masks assume
    sequences of whole 128-token blocks when a TTT step extends them, and either is the library's own path."""
    config = cls.config_class.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"
    return cls.from_pretrained(str(folder), config=config).eval()


def _captured(folder, target):
    """The fc input vLLM builds for the export: the hidden states of its aux ids, concatenated [B, T, 3H]."""
    aux_ids = json.loads((folder / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    states = target.model(IDS, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in aux_ids], dim=-1)


needs_speculators = pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                                       reason="the speculators library is not installed (.ci/run installs it)")


@needs_speculators
@pytest.mark.parametrize("fields", SPECULATORS_HEADS.values(), ids=SPECULATORS_HEADS)
def test_speculators_library_computes_the_exported_heads_logits(tmp_path, monkeypatch, fields):
    """speculators 0.9.0's own Eagle3DraftModel loads the speculators export (the verifier's weights from the target
    folder it names) and computes the head's draft logits from the states vLLM captures for its aux ids, at the
    first drafting step and at the second, which reads the state the first hands on (norm_output)."""
    from speculators.models.eagle3 import Eagle3DraftModel

    target = _saved_target(tmp_path, monkeypatch)
    head = _head(target, **fields)
    folder = _export(head, tmp_path, "speculators", target)
    theirs = _speculators_model(Eagle3DraftModel, folder)
    aux = _captured(folder, target)
    # speculators' TTT mask slides a window by index, and a later step drafts one position on: with a window only
    # its first step is drafting's
    steps = 1 if head.config.sliding_window else 2
    drafts = []
    theirs.lm_head.register_forward_hook(lambda module, args, out: drafts.append(out))
    with torch.no_grad():  # a TTT step drafts at every position; speculators takes one packed sequence per call
        for row in range(IDS.shape[0]):
            theirs(aux[row:row + 1], IDS[row:row + 1], document_ids=torch.zeros_like(IDS[row:row + 1]),
                   position_ids=torch.arange(IDS.shape[1])[None], ttt_steps=steps)
    d2t = torch.arange(theirs.draft_vocab_size) + (theirs.d2t if theirs.use_draft_vocab else 0)
    ours = _drafting_logits(head, target, steps)
    for step in range(steps):  # drafts: row 0's steps, then row 1's; the second step's last index drafts past the end
        draft = torch.cat(drafts[step::steps])[:, :ours[step].shape[1]]  # [B, T, draft vocab], the export's rows
        # the same fp32 head by two implementations (flex attention and other kernels): rounding apart, ~2e-6 here
        torch.testing.assert_close(_in_target_ids(head, draft, d2t), ours[step], rtol=1e-5, atol=1e-5)


# P-EAGLE heads a speculators export of which the library must draft as eyas does: plain, with the norm over the
# concatenation (its weight and the mask state permuted with the fc blocks), two fused layers (zero mask block)
PEAGLE_HEADS = {
    "peagle": dict(),
    "norm-before-fc-unsorted": dict(fused_layer_ids=(5, 2, 4), norm_before_fc=True, norm_before_residual=True),
    "two-layers-fused-full-vocab": dict(fused_layer_ids=(4, 2), draft_vocab_size=320),
}


@needs_speculators
@pytest.mark.parametrize("fields", PEAGLE_HEADS.values(), ids=PEAGLE_HEADS)
def test_speculators_library_computes_the_exported_peagle_heads_logits(tmp_path, monkeypatch, fields):
    """speculators 0.9.0's own PEagleDraftModel loads the export; its training forward, given every anchor at every
    depth instead of a random COD sample, computes at each position (anchor a, depth d) what eyas's `propose`
    drafts d tokens after root a: the mask token and the fused mask state at position a + d, seeing the context
    up to a and its own rollout."""
    from speculators.losses import resolve_loss_config
    from speculators.models.peagle import PEagleDraftModel, core

    k, t = 4, IDS.shape[1]
    anchors = [torch.arange(t - d) for d in range(k)]  # depth d at every anchor a with a + d < T
    depths = torch.cat([torch.full((len(a),), d) for d, a in enumerate(anchors)])
    monkeypatch.setattr(core, "generate_cod_sample_indices", lambda *args, **kw: (torch.cat(anchors), depths))
    target = _saved_target(tmp_path, monkeypatch)
    head = _head(target, "peagle", num_layers=2, depths=k, **fields)
    folder = _export(head, tmp_path, "speculators", target)
    theirs = _speculators_model(PEagleDraftModel, folder)
    aux = _captured(folder, target)
    drafts = []
    theirs.lm_head.register_forward_hook(lambda module, args, out: drafts.append(out[0]))
    with torch.no_grad():
        for row in range(IDS.shape[0]):  # the loss needs verifier states: any will do, only the logits are compared
            theirs(aux[row:row + 1], IDS[row:row + 1], document_ids=torch.zeros_like(IDS[row:row + 1]),
                   verifier_last_hidden_states=torch.zeros(1, t, 64), num_depths=k,
                   loss_config=resolve_loss_config("kl_div", "eager"))  # the fused loss needs Triton
        feat = target(IDS, layer_ids=head.config.fused_layer_ids).features
        d2t = torch.arange(theirs.draft_vocab_size) + (theirs.d2t if theirs.use_draft_vocab else 0)
        for row in range(IDS.shape[0]):
            for a in range(t):
                ours = head.propose(IDS[row:row + 1, :a + 1], feat[row:row + 1, :a + 1], torch.arange(a + 1)[None],
                                    [a + 1], head.new_cache(1, t + k), k)[0]  # [k, draft vocab]
                d = torch.arange(min(k, t - a))
                at = torch.tensor([sum(t - e for e in range(x)) for x in d.tolist()]) + a  # (a, d) in the packed rows
                torch.testing.assert_close(_in_target_ids(head, drafts[row][at], d2t),
                                           _in_target_ids(head, ours[d]), rtol=1e-5, atol=1e-5)


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


# ---- DFlash: speculators' `dflash` and z-lab's own layout ------------------------------------------------------
DFLASH_IDS = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))
MASK = 300  # not the tokenizer's pad token, whose embedding is zero in the tiny targets (it would hide a wrong mask)
needs_dflash = pytest.mark.skipif(importlib.util.find_spec("dflash") is None,
                                  reason="z-lab's dflash 0.1.0 is not installed (.ci/run installs it)")


def _dflash(target, **fields):
    """A DFlash head with random weights: two layers, blocks of 4 (3 drafts), mask token MASK."""
    return _head(target, "dflash", **{"num_layers": 2, "block_size": 4, "mask_token_id": MASK, **fields})


def _dflash_drafts(head, target):
    """The head's drafts [2, block_size - 1, V] after the rows of DFLASH_IDS, 12 and 9 tokens, through its cache."""
    feat = target(DFLASH_IDS, layer_ids=head.reads(target.num_layers)).features
    return head.propose(DFLASH_IDS, feat, torch.arange(12).expand(2, -1), [12, 9], head.new_cache(2, 32),
                        head.draft_positions)


def _dflash_drafts_after(head, target, row, n):
    """The head's drafts [block_size - 1, V] for the block after the first n tokens of DFLASH_IDS[row]: the context
    is the target's states at 0..n-1, the anchor token n (drafting's root)."""
    ids = DFLASH_IDS[row:row + 1]
    feat = target(ids, layer_ids=head.reads(target.num_layers)).features
    return head.propose(ids[:, 1:n + 1], feat[:, :n], torch.arange(n)[None], [n], head.new_cache(1, 32),
                        head.draft_positions)[0]


DFLASH_ROUND_TRIPS = {  # (format, head fields): every DFlash head a layout holds, and every field it carries
    "zlab": ("zlab", {}),
    "zlab-window-attention-bias-three-layers": ("zlab", dict(sliding_window=5, attention_bias=True, num_layers=3)),
    "speculators": ("speculators", {}),
    "speculators-attention-bias-three-layers": ("speculators", dict(attention_bias=True, num_layers=3)),
}


@pytest.mark.parametrize("fmt,fields", DFLASH_ROUND_TRIPS.values(), ids=DFLASH_ROUND_TRIPS)
def test_dflash_round_trip_through_foreign_layout(tmp_path, fmt, fields):
    """The layouts hold the head as it is (its training settings, anchors to dpace_alpha, are not part of them);
    back in eyas's layout it is the same head, weight for weight."""
    target = tiny_target("qwen3", num_layers=6)  # default fused ids (2, 4) for two layers
    head = _dflash(target, **fields)
    _export(head, tmp_path, fmt, target, name=fmt)
    foreign = load_head(tmp_path / fmt, target)
    assert foreign.config == head.config
    torch.testing.assert_close(_dflash_drafts(foreign, target), _dflash_drafts(head, target), rtol=0, atol=0)
    export_head(tmp_path / fmt, tmp_path / "back", "eyas")
    back = load_head(tmp_path / "back", target)
    assert back.config == head.config
    assert all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())


@pytest.mark.parametrize("fmt,offset", [("zlab", -1), ("speculators", 0)])
@pytest.mark.parametrize("fused", [(5, 2, 4), (4, 2, 2)], ids=["unsorted", "repeated"])
def test_dflash_fused_layers_are_written_once_each_in_layer_order(tmp_path, fmt, offset, fused):
    """vLLM captures each fused layer once, in layer order, whatever order the config names them in: the export sorts
    the fc's blocks with their ids and sums a repeated layer's, and the head read back drafts as the original."""
    target = tiny_target("qwen3", num_layers=6)
    head = _dflash(target, fused_layer_ids=fused)
    folder = _export(head, tmp_path, fmt, target)
    config = json.loads((folder / "config.json").read_text())
    ids = config["dflash_config"]["target_layer_ids"] if fmt == "zlab" else config["aux_hidden_state_layer_ids"]
    assert ids == [i + offset for i in sorted(set(fused))]
    assert load_file(str(folder / "model.safetensors"))["fc.weight"].shape == (64, 64 * len(set(fused)))
    again = load_head(folder, target)
    assert again.config.fused_layer_ids == tuple(sorted(set(fused)))
    torch.testing.assert_close(_dflash_drafts(again, target), _dflash_drafts(head, target), rtol=1e-5, atol=1e-5)


def test_zlab_layout_fields_and_keys(tmp_path):
    target = tiny_target("qwen3", num_layers=6)
    head = _dflash(target, num_layers=3, sliding_window=5)
    folder = _export(head, tmp_path, "zlab", target)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert (config["num_target_layers"], config["num_hidden_layers"], config["vocab_size"]) == (6, 3, 320)
    # z-lab's ids are layer outputs: one less than eyas's layer-input ids (2, 3, 4)
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 2, 3], "block_size": 4}
    assert (config["head_dim"], config["rope_theta"], config["rms_norm_eps"]) == (16, 10000.0, 1e-6)
    assert (config["layer_types"], config["sliding_window"]) == (["sliding_attention"] * 3, 5)
    assert config["use_sliding_window"] is True and config["is_causal"] is False  # both default sliding to causal
    weights = load_file(str(folder / "model.safetensors"))
    assert set(weights) == set(head.state_dict())  # the target's embedding and lm_head stay out
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in weights)
    # the CLI writes the same, the layer count from the head's recorded target
    assert main(["export", str(tmp_path / "out-src"), "--out", str(tmp_path / "cli"), "--format", "zlab"]) == 0
    assert json.loads((tmp_path / "cli" / "config.json").read_text()) == config


def test_speculators_layout_holds_dflash_heads(tmp_path):
    """DFlash as speculators' DFlashSpeculatorConfig and vLLM's update_dflash read it: its own field names, a Qwen3
    decoder, block_size - 1 speculative tokens, sliding_window_non_causal true (vLLM makes every layer causal
    otherwise), no embedding or lm_head in the file (speculators reloads both from the verifier)."""
    target = tiny_target("qwen3", num_layers=6)
    head = _dflash(target, num_layers=3, block_size=6)
    folder = _export(head, tmp_path, "speculators", target)
    config = json.loads((folder / "config.json").read_text())
    assert (config["speculators_model_type"], config["architectures"]) == ("dflash", ["DFlashSpeculator"])
    assert config["speculators_config"]["algorithm"] == "dflash"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert (config["block_size"], config["mask_token_id"], config["draft_vocab_size"]) == (6, MASK, 320)
    assert config["aux_hidden_state_layer_ids"] == [2, 3, 4] and "eagle_aux_hidden_state_layer_ids" not in config
    assert (config["sample_from_anchor"], config["sliding_window_non_causal"]) == (False, True)
    assert not any(k in config for k in ("norm_before_residual", "fc_norm", "norm_before_fc", "norm_output"))
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"]) == ("qwen3", 3, 320)
    weights = load_file(str(folder / "model.safetensors"))
    assert set(weights) == set(head.state_dict())


def test_dflash_exports_refuse_what_the_runtimes_would_compute_otherwise(tmp_path):
    target = tiny_target("qwen3", num_layers=6)
    with pytest.raises(ValueError, match="zlab layout holds dflash heads; this head is eagle3"):
        _export(_head(target), tmp_path, "zlab", target, "eagle3")
    for fmt in ("sglang", "eagle"):
        with pytest.raises(ValueError, match="holds eagle[13] heads only"):
            _export(_dflash(target), tmp_path, fmt, target, fmt)
    with pytest.raises(ValueError, match="sliding window: speculators' DFlashDraftModel windows the context from each "
                                         "block's anchor, vLLM 0.32 from each block position"):
        _export(_dflash(target, sliding_window=5), tmp_path, "speculators", target, "window")
    with pytest.raises(ValueError, match="block_size 4 is longer than the head's window 3"):
        _export(_dflash(target, sliding_window=3), tmp_path, "zlab", target, "short-window")
    with pytest.raises(ValueError, match="final \\*normed\\* state"):  # vLLM captures id N before the final norm
        _export(_dflash(target, fused_layer_ids=(2, 6)), tmp_path, "zlab", target, "last")
    imported = _export(_dflash(target), tmp_path, "speculators", target, "imported")  # records no layer count
    with pytest.raises(ValueError, match="num_target_layers.*pass --target"):
        export_head(imported, tmp_path / "x", "zlab")
    export_head(imported, tmp_path / "x", "zlab", target)
    assert not (tmp_path / "eagle3").exists() and not (tmp_path / "window").exists()


def test_eyas_layout_holds_dflash_heads_whole(tmp_path):
    """save_head / load_head keep a DFlash head as it is: every option (the training ones too), its window and
    biases, every weight."""
    target = tiny_target("qwen3", num_layers=6)
    head = _dflash(target, num_layers=3, block_size=5, anchors=8, loss_weight="dpace", gamma=3.0, dpace_alpha=0.25,
                   sliding_window=9, attention_bias=True, fused_layer_ids=(4, 1, 1))
    save_head(head, tmp_path / "dflash")
    again = load_head(tmp_path / "dflash", target)
    assert again.config == head.config and again.config.target == head.config.target
    assert set(again.state_dict()) == set(head.state_dict())
    assert all(torch.equal(again.state_dict()[k], v) for k, v in head.state_dict().items())


def _zlab_config(**over):
    """A config.json as z-lab releases its DFlash heads (z-lab/Qwen3-8B-DFlash-b16, tiny sizes): a Qwen3Config with
    block_size at the top level, as its earlier heads have it, and dflash_config."""
    return {"architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 4, "bos_token_id": 2,
            "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 3]}, "dtype": "bfloat16",
            "eos_token_id": 3, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
            "intermediate_size": 128, "layer_types": ["full_attention", "full_attention"],
            "max_position_embeddings": 512, "max_window_layers": 2, "model_type": "qwen3", "num_attention_heads": 4,
            "num_hidden_layers": 2, "num_key_value_heads": 2, "num_target_layers": 6, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
            "transformers_version": "4.57.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 320,
            **over}


def _dflash_weights(num_layers=2, fused=2, seed=3):
    """Random DFlash weights as z-lab and speculators name them (eyas's names), bf16 as released."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (64, 64 * fused), "hidden_norm.weight": (64,), "norm.weight": (64,)}
    for i in range(num_layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in {
            "self_attn.q_proj.weight": (64, 64), "self_attn.k_proj.weight": (32, 64),
            "self_attn.v_proj.weight": (32, 64), "self_attn.o_proj.weight": (64, 64),
            "self_attn.q_norm.weight": (16,), "self_attn.k_norm.weight": (16,), "input_layernorm.weight": (64,),
            "post_attention_layernorm.weight": (64,), "mlp.gate_proj.weight": (128, 64),
            "mlp.up_proj.weight": (128, 64), "mlp.down_proj.weight": (64, 128)}.items()})
    return {k: (torch.randn(s, generator=g) * 0.1 + (1.0 if len(s) == 1 else 0.0)).to(torch.bfloat16)
            for k, s in shapes.items()}


def test_released_zlab_head_imports_as_trained(tmp_path):
    """A z-lab release loads with its ids shifted (+1), its block size from the top level, its window of none; the
    config's own rope_theta is kept (vLLM and transformers default it differently)."""
    target = tiny_target("qwen3", num_layers=6)
    folder = _write(tmp_path / "zlab", _zlab_config(), _dflash_weights())
    head = load_head(folder, target)
    c = head.config
    assert (c.head_type, c.fused_layer_ids, c.num_layers, c.rope_theta, c.sliding_window) == ("dflash", (2, 4), 2,
                                                                                                1e6, None)
    assert (head.options.block_size, head.options.mask_token_id, c.target.num_hidden_layers) == (4, MASK, 6)
    no_ids = _zlab_config(dflash_config={"mask_token_id": MASK}, num_target_layers=10)
    # no ids: z-lab's build_target_layer_ids(10, 2), [1, 7]
    assert load_head(_write(tmp_path / "no-ids", no_ids, _dflash_weights())).config.fused_layer_ids == (2, 8)


ZLAB_REFUSED = {  # config change -> what the refusal names
    "sample-from-anchor": (dict(dflash_config={"mask_token_id": MASK, "target_layer_ids": [1, 3],
                                               "sample_from_anchor": True}), "sample_from_anchor True"),
    "input-embedding-scale": (dict(input_embedding_scale=8.0), "input_embedding_scale 8.0"),
    "output-multiplier": (dict(output_multiplier=0.5), "output_multiplier 0.5"),
    "softcapping": (dict(final_logit_softcapping=30.0), "final_logit_softcapping 30.0"),
    "dflash2": (dict(architectures=["DFlash2DraftModel"], conv_kernel_size=4), "DFlash2 head \\(conv_kernel_size\\)"),
    "causal": (dict(is_causal=True), "attends causally in z-lab's reading"),
    "causal-vllm": (dict(dflash_config={"mask_token_id": MASK, "target_layer_ids": [1, 3], "causal": True}),
                    "attends causally in vLLM's reading"),
    "sliding-default-causal": (dict(layer_types=["sliding_attention"] * 2, sliding_window=8, use_sliding_window=True),
                               "attends causally in z-lab's reading"),
    "mixed-windows": (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                           use_sliding_window=True, is_causal=False), "mixes attention kinds"),
    "window-shorter-than-block": (dict(layer_types=["sliding_attention"] * 2, sliding_window=3,
                                       use_sliding_window=True, is_causal=False), "block_size 4 is longer"),
    "rope-scaling": (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope scaling"),
    "no-rope-theta": (dict(rope_theta=None), "rope_theta is missing"),
    "no-mask-token": (dict(dflash_config={"target_layer_ids": [1, 3]}), "mask_token_id is missing"),
    "no-layers": (dict(dflash_config={"mask_token_id": MASK}, num_target_layers=None),
                  "neither target_layer_ids nor num_target_layers"),
    "mlp-bias": (dict(mlp_bias=True), "mlp_bias"),
    "swa": (dict(dflash_config={"mask_token_id": MASK, "target_layer_ids": [1, 3], "use_swa": True}), "use_swa"),
}


@pytest.mark.parametrize("change,refusal", ZLAB_REFUSED.values(), ids=ZLAB_REFUSED)
def test_zlab_heads_eyas_cannot_run_are_refused_naming_the_field(tmp_path, change, refusal):
    config = {k: v for k, v in _zlab_config(**change).items() if v is not None}
    with pytest.raises(ValueError, match=refusal):
        load_head(_write(tmp_path / "h", config, _dflash_weights()))


def test_zlab_mask_embedding_file_is_refused(tmp_path):
    """vLLM embeds the mask token with a shipped mask_embedding.pt; eyas's head reads the target's embedding."""
    folder = _write(tmp_path / "h", _zlab_config(), _dflash_weights())
    torch.save(torch.zeros(64), folder / "mask_embedding.pt")
    with pytest.raises(ValueError, match="mask_embedding.pt"):
        load_head(folder)


def _speculators_dflash_config(**over):
    """A config.json as speculators 0.9.0 writes a DFlash head (DFlashSpeculatorConfig, its defaults included; its
    save_pretrained names the model class, z-lab's name too, among the architectures)."""
    layer = {k: v for k, v in _zlab_config().items() if k not in (
        "architectures", "auto_map", "block_size", "dflash_config", "num_target_layers", "dtype")}
    return {"architectures": ["DFlashDraftModel"], "aux_hidden_state_layer_ids": [2, 4], "block_size": 4,
            "draft_vocab_size": 320, "mask_token_id": MASK, "sample_from_anchor": False,
            "sliding_window_non_causal": False, "speculators_config": {
                "algorithm": "dflash", "default_proposal_method": "greedy",
                "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3,
                                      "verifier_accept_k": 1}],
                "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "Qwen/Qwen3-8B"}},
            "speculators_model_type": "dflash", "speculators_version": "0.9.0", "target_hidden_size": None,
            "torch_dtype": "bfloat16", "transformer_layer_config": layer, **over}


SPECULATORS_DFLASH_REFUSED = {
    "sample-from-anchor": (dict(sample_from_anchor=True), "sample_from_anchor True"),
    "reduced-vocab": (dict(draft_vocab_size=100), "draft_vocab_size must equal vocab_size"),
    "window": (dict(transformer_layer_config={**_speculators_dflash_config()["transformer_layer_config"],
                                              "layer_types": ["sliding_attention"] * 2, "sliding_window": 8,
                                              "use_sliding_window": True}), "sliding window"),
    "no-aux-ids": (dict(aux_hidden_state_layer_ids=None), "aux_hidden_state_layer_ids is missing"),
    "no-block-size": (dict(block_size=None), "block_size is missing \\(speculators defaults it to 8"),
    "llama-layers": (dict(transformer_layer_config={**_speculators_dflash_config()["transformer_layer_config"],
                                                    "model_type": "llama"}), "'llama' is not supported for dflash"),
    "dflash2": (dict(speculators_model_type="dflash2"), "'dflash2' is not supported"),
}


def test_released_speculators_dflash_head_imports(tmp_path):
    """As speculators writes it: sliding_window_non_causal false (its default; with no sliding layer speculators
    attends both ways within the block, as eyas does), the verifier named, no embedding or lm_head."""
    target = tiny_target("qwen3", num_layers=6)
    head = load_head(_write(tmp_path / "h", _speculators_dflash_config(), _dflash_weights()), target)
    c = head.config
    assert (c.head_type, c.fused_layer_ids, c.rope_theta, head.options.block_size) == ("dflash", (2, 4), 1e6, 4)
    assert c.target.name_or_path == "Qwen/Qwen3-8B"


@pytest.mark.parametrize("change,refusal", SPECULATORS_DFLASH_REFUSED.values(), ids=SPECULATORS_DFLASH_REFUSED)
def test_speculators_dflash_heads_eyas_cannot_run_are_refused_naming_the_field(tmp_path, change, refusal):
    config = {k: v for k, v in _speculators_dflash_config(**change).items() if v is not None}
    with pytest.raises(ValueError, match=refusal):
        load_head(_write(tmp_path / "h", config, _dflash_weights()))


# DFlash heads whose exports the reference code must draft as eyas does: plain, with a window and biases, with fused
# ids the export sorts and merges
DFLASH_HEADS = {
    "plain": dict(),
    "three-layers-attention-bias": dict(num_layers=3, attention_bias=True),
    "unsorted-repeated-ids": dict(fused_layer_ids=(4, 1, 1)),
}
ZLAB_HEADS = {**DFLASH_HEADS, "window": dict(sliding_window=5, num_layers=3)}


def _zlab_drafts(model, target, row, n):
    """z-lab's drafts [block_size - 1, V] after the first n tokens of DFLASH_IDS[row], computed as dflash_generate
    drafts: the context features it extracts, the raw embeddings of [anchor, masks], the target's output head."""
    from dflash import model as zlab

    ids = DFLASH_IDS[row:row + 1]
    context = zlab.extract_context_feature(target.model(ids, output_hidden_states=True).hidden_states,
                                           model.target_layer_ids)
    block = torch.full((1, model.block_size), model.mask_token_id)
    block[0, 0] = ids[0, n]
    hidden = model(position_ids=torch.arange(n + model.block_size)[None], target_hidden=context[:, :n],
                   noise_embedding=zlab._raw_input_embeddings(target.model, block))
    return model.compute_logits(hidden[:, 1:], zlab._output_head(target.model))[0]


@needs_dflash
@pytest.mark.parametrize("fields", ZLAB_HEADS.values(), ids=ZLAB_HEADS)
def test_zlab_library_computes_the_exported_heads_drafts(tmp_path, fields):
    """z-lab's own DFlashDraftModel (dflash 0.1.0) loads the zlab export and drafts, after every context of both
    rows, what eyas's head drafts (fp32; the two implementations round apart by ~1e-7)."""
    from dflash.model import DFlashDraftModel

    target = tiny_target("qwen3", num_layers=6)
    head = _dflash(target, **fields)
    theirs = DFlashDraftModel.from_pretrained(str(_export(head, tmp_path, "zlab", target))).eval()
    with torch.no_grad():
        for row in range(2):
            for n in range(1, 12):
                torch.testing.assert_close(_zlab_drafts(theirs, target, row, n),
                                           _dflash_drafts_after(head, target, row, n), rtol=1e-5, atol=1e-5)


@needs_dflash
def test_released_zlab_head_drafts_in_eyas_as_in_zlab(tmp_path):
    """A z-lab release (bf16, block_size at the top level, rope_theta 1e6) drafts in eyas as in z-lab's code."""
    from dflash.model import DFlashDraftModel

    target = tiny_target("qwen3", num_layers=6)
    folder = _write(tmp_path / "zlab", _zlab_config(), _dflash_weights())
    theirs = DFlashDraftModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    head = load_head(folder, target)
    with torch.no_grad():
        for n in range(1, 12):
            torch.testing.assert_close(_zlab_drafts(theirs, target, 0, n), _dflash_drafts_after(head, target, 0, n),
                                       rtol=1e-5, atol=1e-5)


def _walker_target(chain, mask):
    """A Qwen3 target whose greedy next token is a chosen function of the current one: chain[i] -> chain[i + 1], the
    last -> itself, the mask token -> the last, any other -> itself. Its lm_head row v sums the normed embeddings of
    the tokens mapped to v, and its layers are damped (x0.1) so the final state stays close to the current token's
    embedding while every layer still contributes. A head whose layers are damped too drafts the chain's end at
    every masked position: rejected along the chain, all accepted once it is reached."""
    target = tiny_target("qwen3", num_layers=6)
    model = target.model
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
        emb = model.model.embed_tokens.weight
        normed = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + 1e-6)
        step = torch.arange(emb.shape[0])
        step[torch.tensor(chain[:-1])] = torch.tensor(chain[1:])
        step[mask] = chain[-1]
        model.lm_head.weight.copy_(torch.zeros_like(emb).index_add_(0, step, normed))
    return target


@needs_dflash
def test_zlab_generate_and_eyas_decode_alike_cycle_by_cycle(tmp_path, monkeypatch):
    """z-lab's dflash_generate (greedy) with the zlab export and eyas's SpeculativeGenerator with the head, as a
    chain of block_size - 1 drafts: the same tokens, and per verify cycle the same tokens gained (z-lab caps the last
    cycle at the length asked for; eyas counts what the cycle gained)."""
    from dflash import model as zlab

    from eyas.inference.drafter import TreeOptions
    from eyas.inference.generator import SpeculativeGenerator

    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # its stats time with torch.cuda.synchronize
    chain, prompt, new = [40, 41, 42, 43, 44, 45, 46, 47], [5, 6, 7, 40], 20
    target = _walker_target(chain, MASK)
    head = _dflash(target)
    with torch.no_grad():  # small layer outputs: the masked positions draft what the mask token maps to
        for name, p in head.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.01)
    theirs = zlab.dflash_generate(zlab.DFlashDraftModel.from_pretrained(str(_export(head, tmp_path, "zlab", target))),
                                  target.model, torch.tensor([prompt]), new, None, return_stats=True)
    ours = SpeculativeGenerator(target, head, TreeOptions(kind="chain", depth=head.draft_positions, lookup=0)
                                ).generate(prompt, max_new_tokens=new, temperature=0.0, eos_token_id=[])
    assert ours.tokens == theirs.output_ids[0, len(prompt):].tolist() == chain[1:] + [chain[-1]] * (new - 7)
    left, gained = new - ours.stats.prefill_tokens, []
    for n in ours.stats.accepted:
        gained.append(min(n, left))
        left -= gained[-1]
    assert gained == theirs.acceptance_lengths
    assert 1 in gained and head.options.block_size in gained  # rejected drafts and whole blocks accepted alike


def _speculators_dflash_drafts(folder, target, monkeypatch):
    """speculators' own DFlashDraftModel, loading `folder` (embedding and lm_head from the verifier it names), drafting
    with its training forward at every anchor a with a whole block in each row of DFLASH_IDS (instead of a random
    sample): per row [anchors, block_size, V], and the anchors."""
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import DFlashDraftModel, core

    config = json.loads((folder / "config.json").read_text())
    size, t = config["block_size"], DFLASH_IDS.shape[1]
    anchors = torch.arange(1, t - size + 1)
    monkeypatch.setattr(core, "select_anchors", lambda *args: (anchors, torch.ones(len(anchors), dtype=torch.bool)))
    theirs = _speculators_model(DFlashDraftModel, folder)
    states = target.model(DFLASH_IDS, output_hidden_states=True).hidden_states
    aux = torch.cat([states[i] for i in config["aux_hidden_state_layer_ids"]], dim=-1)  # what vLLM captures
    drafts = []
    theirs.lm_head.register_forward_hook(lambda module, args, out: drafts.append(out[0].view(len(anchors), size, -1)))
    with torch.no_grad():
        for row in range(2):  # the loss needs verifier states: any will do, only the logits are compared
            theirs(aux[row:row + 1], DFLASH_IDS[row:row + 1], loss_mask=torch.ones(1, t),
                   verifier_last_hidden_states=torch.zeros(1, t, 64),
                   document_ids=torch.zeros(1, t, dtype=torch.long), max_anchors=len(anchors),
                   loss_config=resolve_loss_config("kl_div", "eager"))  # the fused loss needs Triton
    return drafts, anchors.tolist()


def _check_speculators_dflash(folder, target, head, monkeypatch):
    """Block position j of anchor a, in speculators, is what eyas's head drafts j tokens after the context 0..a-1."""
    drafts, anchors = _speculators_dflash_drafts(folder, target, monkeypatch)
    with torch.no_grad():
        for row in range(2):
            for j, a in enumerate(anchors):
                torch.testing.assert_close(drafts[row][j, 1:], _dflash_drafts_after(head, target, row, a),
                                           rtol=1e-5, atol=1e-5)


@needs_speculators
@pytest.mark.parametrize("fields", DFLASH_HEADS.values(), ids=DFLASH_HEADS)
def test_speculators_library_computes_the_exported_dflash_heads_drafts(tmp_path, monkeypatch, fields):
    """speculators 0.9.0's DFlashDraftModel drafts with the speculators export what eyas's head drafts (fp32; the
    two implementations round apart by ~5e-7)."""
    target = _saved_target(tmp_path, monkeypatch, "qwen3", num_layers=6)
    head = _dflash(target, **fields)
    _check_speculators_dflash(_export(head, tmp_path, "speculators", target), target, head, monkeypatch)


@needs_speculators
def test_speculators_written_dflash_head_drafts_in_eyas_as_in_speculators(tmp_path, monkeypatch):
    """A DFlash head as the speculators library itself builds and saves it (DFlashSpeculatorConfig with its defaults,
    sliding_window_non_causal false among them; rope_theta 1e6; save_pretrained leaves out the verifier's weights)
    loads in eyas and drafts as in speculators."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    target = _saved_target(tmp_path, monkeypatch, "qwen3", num_layers=6)
    layer = Qwen3Config(**{k: v for k, v in _zlab_config().items() if k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "num_hidden_layers", "rms_norm_eps", "rope_theta", "max_position_embeddings")})
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=320, block_size=4, aux_hidden_state_layer_ids=[2, 4],
        mask_token_id=MASK, speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=target.name_or_path, architectures=["Qwen3ForCausalLM"])))
    model = DFlashDraftModel(config)
    with torch.no_grad():  # the head's own weights random, norms included; the verifier's from the target
        for name, p in model.named_parameters():
            if not name.startswith(("embed_tokens", "lm_head", "verifier_")):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    model.load_verifier_weights()
    model.save_pretrained(tmp_path / "released")
    written = json.loads((tmp_path / "released" / "config.json").read_text())
    assert written["sliding_window_non_causal"] is False and written["speculators_model_type"] == "dflash"
    head = load_head(tmp_path / "released", target)
    assert (head.config.fused_layer_ids, head.config.rope_theta, head.options.block_size) == ((2, 4), 1e6, 4)
    _check_speculators_dflash(tmp_path / "released", target, head, monkeypatch)


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


def test_released_peagle_head_imports_as_trained(tmp_path):
    """A speculators P-EAGLE head: its draft positions come from the proposal's speculative tokens, its mask state
    [1, 1, F] becomes the head's [F]; norm_before_residual may be absent (speculators and vLLM's update_peagle both
    default it to false), and fc_norm, which speculators trains P-EAGLE heads with too, is read."""
    target = tiny_target("llama", num_layers=8)
    weights = _released_weights(target, "layers.0")
    weights["mask_hidden"] = torch.randn(1, 1, 192, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    spec = _redhat_config()["speculators_config"]
    config = {k: v for k, v in _redhat_config().items() if k != "norm_before_residual"}
    config.update(speculators_model_type="peagle", architectures=["PEagleSpeculator"], mask_token_id=7,
                  embed_requires_grad=True, speculators_config={
                      **spec, "algorithm": "peagle", "proposal_methods": [{**spec["proposal_methods"][0],
                                                                           "speculative_tokens": 6}]})
    folder = _write(tmp_path / "peagle", config, weights)
    _check_released(folder, target, weights, REDHAT_LAYER, (2, 4, 5), False)  # the root drafts as EAGLE-3's
    head = load_head(folder, target)
    assert head.config.head_type == "peagle" and (head.options.depths, head.options.mask_token_id) == (6, 7)
    assert torch.equal(head.mask_hidden, weights["mask_hidden"].float()[0, 0])
    norms = {f"fc_norm.{j}.weight": torch.rand(64) + 0.5 for j in range(3)}
    assert load_head(_write(tmp_path / "fc_norm", {**config, "fc_norm": True}, {**weights, **norms}),
                     target).config.options.fc_norm


def test_sglang_heads_with_eagle31_fields_import_as_trained(tmp_path):
    """SpecForge writes fc_norm and norm_output among the Llama fields (its configs/qwen3-30B-A3B-eagle3.1.json),
    NVIDIA's checkpoints norm_before_fc in eagle_config (where vLLM reads it first). Loaded, the head drafts both
    steps as the head those weights came from (norm_output: the second reads the post-norm state)."""
    target = tiny_target("llama", num_layers=8)
    config = json.loads((_export(_head(target), tmp_path, "sglang", target, "plain") / "config.json").read_text())
    nvidia = {**config["eagle_config"], "norm_before_fc": True}
    cases = {"specforge": (dict(fc_norm=True, norm_output=True), dict(fc_norm=True, norm_output=True)),
             "nvidia": (dict(norm_before_fc=True), dict(eagle_config=nvidia))}
    for name, (fields, written) in cases.items():
        head = _head(target, **fields)
        state = {k.replace("layers.0.", "midlayer."): v for k, v in head.state_dict().items()}
        loaded = load_head(_write(tmp_path / name, {**config, **written}, state), target)
        assert loaded.config == head.config
        for theirs, ours in zip(_drafting_logits(loaded, target, 2), _drafting_logits(head, target, 2)):
            torch.testing.assert_close(theirs, ours, rtol=0, atol=0)


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


def test_eyas_layout_holds_every_algorithm_and_reads_format_1(tmp_path):
    """save_head / load_head keep a P-EAGLE head whole (every option, the mask state); a format-1 head (EAGLE-3's
    norm_before_residual among the shape fields, no options) loads as the same head."""
    target = tiny_target("llama", num_layers=8)
    head = _head(target, "peagle", num_layers=2, depths=3, depth_keep=0.5, fc_norm=True, norm_output=True)
    save_head(head, tmp_path / "peagle")
    again = load_head(tmp_path / "peagle", target)
    assert again.config == head.config
    assert all(torch.equal(again.state_dict()[k], v) for k, v in head.state_dict().items())
    old = _head(target, norm_before_residual=True)
    config = {k: v for k, v in old.config.to_dict().items() if k != "options"}
    folder = _write(tmp_path / "format1", {"eyas_format": 1, **config, "norm_before_residual": True},
                    dict(old.state_dict()))
    loaded = load_head(folder, target)
    assert loaded.config == old.config and loaded.options.norm_before_residual
    torch.testing.assert_close(_logits(loaded, target), _logits(old, target), rtol=0, atol=0)


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
    with pytest.raises(ValueError, match="holds eagle3, peagle, dflash heads; this head is eagle1"):
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
    for option in ("fc_norm", "norm_before_fc", "norm_output"):  # SGLang's draft model reads none of them
        save_head(_head(target, **{option: True}), tmp_path / option)
        with pytest.raises(ValueError, match=f"{option}: SGLang's llama_eagle3.py does not read it.*as speculators"):
            export_head(tmp_path / option, tmp_path / "x", "sglang", target)
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
    with pytest.raises(ValueError, match=r"missing \['fc_norm.0.weight', 'fc_norm.1.weight', 'fc_norm.2.weight'\]"):
        load_head(tmp_path / "fc_norm", target)
    _write(tmp_path / "both_norms", _redhat_config(fc_norm=True, norm_before_fc=True), spec_weights)
    with pytest.raises(ValueError, match="fc_norm and norm_before_fc are exclusive"):
        load_head(tmp_path / "both_norms", target)
    _write(tmp_path / "qwen3", _redhat_config(transformer_layer_config={**REDHAT_LAYER, "model_type": "qwen3"}),
           spec_weights)
    with pytest.raises(ValueError, match="qwen3"):
        load_head(tmp_path / "qwen3", target)
    _write(tmp_path / "medusa", _redhat_config(speculators_model_type="medusa"), spec_weights)
    with pytest.raises(ValueError, match="medusa"):
        load_head(tmp_path / "medusa", target)


def test_a_head_on_a_target_that_scales_its_embedding_stays_in_the_eyas_format(tmp_path):
    """Gemma 3 scales its token embedding inside the embedding module: eyas's head reads the scaled rows, runtimes
    feed drafters the raw table, so a foreign export would draft differently: refused, naming why."""
    from tests.helpers.families import family_target

    target = family_target("gemma3")
    assert float(target.embed_tokens.embed_scale) != 1.0
    head = DraftHead(head_config_for(target, "eagle3"), target)
    save_head(head, tmp_path / "eyas")
    with pytest.raises(InputError, match="scales its token embedding"):
        export_head(tmp_path / "eyas", tmp_path / "out", "speculators", target)
    assert not (tmp_path / "out").exists()
    export_head(tmp_path / "eyas", tmp_path / "again", "eyas", target)  # its own format holds it
