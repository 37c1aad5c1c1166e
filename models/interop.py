"""Other runtimes' head layouts, both directions: SGLang/EAGLE-3 reference, speculators/vLLM, EAGLE-1 reference.

Each layout is a Llama-style config plus a weight file whose key names differ from ours only by a
prefix (`RENAMES`). What differs in the config is written out once per layout in `_foreign_config`
(export) and `_read_foreign_config` (import); the Llama decoder fields are shared by all three.

Layer ids. eyas numbers fused layers like HF `hidden_states`: id i is the *input* of layer i
(= output of layer i-1); id N is the final hidden state, which eyas takes *after* the final norm.
- SGLang / SpecForge: `eagle_config.eagle_aux_hidden_state_layer_ids` name layer *outputs*;
  SGLang's `set_eagle3_layers_to_capture` adds 1 before capturing at the input of that layer
  ("for the ith layer, it takes the output of the (i-1)th layer"), so foreign = ours - 1
  (SpecForge writes [1, 29, 57] for a 61-layer target whose defaults are our [2, 30, 58]).
- speculators / vLLM: `eagle_aux_hidden_state_layer_ids` are HF hidden_states indices (vLLM captures
  index 0 before layer 0 and index k after layer k-1; defaults (2, N//2, N-3) as ours), so foreign = ours.
Neither runtime applies the final norm to id N, so a head fusing id N cannot be exported to them.

Foreign formats carry no tokenizer fingerprint: a loaded foreign head is checked against its target
by hidden size, vocab size and layer count only. They do not record the target's layer count either;
TargetIdentity.num_hidden_layers is set to the deepest fused layer id (the smallest count that is
consistent with the head) — check_head_matches compares against the real target's count.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .atomic import atomic_folder
from .config import HeadConfig, TargetIdentity, default_fused_layer_ids
from .head import DraftHead
from .head_format import CONFIG_NAME, WEIGHTS_NAME, load_head, save_head

FORMATS = ("eyas", "sglang", "speculators", "eagle")
LEGACY_WEIGHTS_NAME = "pytorch_model.bin"  # what the EAGLE-1 reference saves

# eyas state-dict prefix -> foreign prefix; everything else keeps its name (fc, norm, lm_head, d2t, t2d).
RENAMES: dict[str, list[tuple[str, str]]] = {
    "sglang": [("layers.0.", "midlayer.")],  # LlamaForCausalLMEagle3 / EAGLE-3 reference `midlayer`
    "speculators": [],  # Eagle3Speculator: fc, layers.{i}.*, norm, lm_head, d2t, t2d
    "eagle": [],  # EAGLE-1 cnets.Model: fc (with bias), layers.{i}.* (layer 0 has no input_layernorm)
}
# Foreign keys that are the target's borrowed modules, which eyas never stores: dropped on import.
BORROWED_KEYS = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")
HEAD_TYPE = {"sglang": "eagle3", "speculators": "eagle3", "eagle": "eagle1"}
# foreign aux layer id = eyas fused layer id + offset (see module docstring).
LAYER_ID_OFFSET = {"sglang": -1, "speculators": 0}
# The EAGLE-3 reference and SpecForge write one `midlayer`; SGLang names a later layer's input norm
# `hidden_norm`, not `input_layernorm`, so deeper heads would need more than a prefix rename.
MAX_LAYERS = {"sglang": 1}
SGLANG_ARCHS = ("LlamaForCausalLMEagle3",)
EAGLE1_ARCHS = ("LlamaForCausalLM", "LlamaForCausalLMEagle")  # reference / SGLang's EAGLE-1 class
# speculators' GreedyTokenProposalConfig default; the chain length vLLM proposes unless told otherwise.
SPECULATIVE_TOKENS = 5
SPECULATORS_VERSION = "0.3.0"


# ---- import ---------------------------------------------------------------------------------

def detect_layout(raw: dict[str, Any]) -> str:
    """Name the layout of a config.json: eyas, sglang, speculators or eagle."""
    if "eyas_format" in raw:
        return "eyas"
    if "speculators_model_type" in raw:
        if raw["speculators_model_type"] != "eagle3":
            raise ValueError(f"speculators model type {raw['speculators_model_type']!r} is not supported; eyas reads eagle3")
        return "speculators"
    archs = raw.get("architectures") or []
    if any(a in SGLANG_ARCHS for a in archs):
        return "sglang"
    if any(a in EAGLE1_ARCHS for a in archs):
        return "eagle"
    raise ValueError(
        f"unknown head layout (architectures={archs}): expected an eyas head (eyas_format), a speculators head "
        f"(speculators_model_type), an SGLang EAGLE-3 head ({SGLANG_ARCHS[0]}) or an EAGLE-1 head ({EAGLE1_ARCHS[0]})"
    )


def load_foreign(folder: Path, raw: dict[str, Any], target=None) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """Read a head in a foreign layout as (HeadConfig, state dict in eyas naming).

    `target` (an eyas Target, optional) supplies the EAGLE-3 default fused layers (2, N//2, N-3)
    when the config does not record them, as the runtimes themselves do.
    """
    layout = detect_layout(raw)
    config = _read_foreign_config(layout, raw, folder, target)
    state = _to_eyas_state(layout, _read_weights(folder), config, folder)
    return config, state


def _read_foreign_config(layout: str, raw: dict[str, Any], folder: Path, target) -> HeadConfig:
    where = f"{folder / CONFIG_NAME} ({layout} layout)"
    if layout == "speculators":
        spec = raw.get("speculators_config") or {}
        if spec.get("algorithm", "eagle3") != "eagle3":
            raise ValueError(f"{where}: algorithm {spec['algorithm']!r} is not eagle3")
        llama = _required(raw, "transformer_layer_config", where)
        if "norm_before_residual" not in raw:
            # speculators defaults it to False, vLLM to True: refuse to guess which the head was trained with.
            raise ValueError(f"{where}: norm_before_residual is missing (speculators and vLLM default it differently)")
        if llama.get("model_type") != "llama":  # speculators builds other decoder layers (e.g. qwen3's q/k norms)
            raise ValueError(f"{where}: transformer_layer_config model_type {llama.get('model_type')!r} is not supported; eyas heads use llama layers")
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        verifier = (spec.get("verifier") or {}).get("name_or_path") or ""
    else:
        llama = raw
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        verifier = ""
    variants = [k for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if raw.get(k)]
    if variants:
        raise ValueError(f"{where}: EAGLE-3 variants {variants} are not supported by eyas heads")
    shape = _shape_from_llama(llama, where)
    target_hidden = raw.get("target_hidden_size")
    if target_hidden not in (None, shape["hidden_size"]):
        raise ValueError(f"{where}: target_hidden_size {target_hidden} differs from hidden_size {shape['hidden_size']}; eyas heads share the target's width")
    head_type = HEAD_TYPE[layout]
    if head_type == "eagle3":
        if ids:
            fused = tuple(int(i) - LAYER_ID_OFFSET[layout] for i in ids)
        elif target is not None:
            fused = default_fused_layer_ids(target.num_layers)
        else:
            raise ValueError(f"{where} does not record the fused target layers; load it with its target to use the defaults (2, N//2, N-3)")
        draft_vocab = int(_required(raw, "draft_vocab_size", where))
    else:
        fused, draft_vocab = (), shape["vocab_size"]
    identity = TargetIdentity(
        name_or_path=verifier, hidden_size=shape["hidden_size"], vocab_size=shape["vocab_size"],
        num_hidden_layers=max(fused, default=0), tokenizer_fingerprint="",
    )
    return HeadConfig(head_type=head_type, draft_vocab_size=draft_vocab, fused_layer_ids=fused, target=identity, **shape)


def _shape_from_llama(d: dict[str, Any], where: str) -> dict[str, Any]:
    """HeadConfig shape fields from a Llama-style config dict; refuses what the eyas layer cannot run."""
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {d['hidden_act']!r} is not supported (eyas heads use silu)")
    if d.get("mlp_bias") or d.get("attention_bias"):
        raise ValueError(f"{where}: mlp_bias/attention_bias heads are not supported (Llama's attention_bias also biases o_proj)")
    rope = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or ({"rope_type": rope["rope_type"]} if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        raise ValueError(f"{where}: rope scaling {scaling} is not supported (eyas heads use plain RoPE)")
    heads = int(_required(d, "num_attention_heads", where))
    hidden = int(_required(d, "hidden_size", where))
    return dict(
        hidden_size=hidden,
        intermediate_size=int(_required(d, "intermediate_size", where)),
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        vocab_size=int(_required(d, "vocab_size", where)),
        num_layers=int(d.get("num_hidden_layers", 1)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
    )


def _required(d: dict[str, Any], key: str, where: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"{where}: required field {key!r} is missing")
    return d[key]


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / WEIGHTS_NAME).is_file():
        return load_file(str(folder / WEIGHTS_NAME))
    if (folder / LEGACY_WEIGHTS_NAME).is_file():
        return torch.load(folder / LEGACY_WEIGHTS_NAME, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{folder} has {CONFIG_NAME} but neither {WEIGHTS_NAME} nor {LEGACY_WEIGHTS_NAME}")


def _rename(key: str, pairs: list[tuple[str, str]]) -> str:
    for old, new in pairs:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def _to_eyas_state(layout: str, foreign: dict[str, torch.Tensor], config: HeadConfig, folder: Path) -> dict[str, torch.Tensor]:
    """Rename foreign keys to ours, fill optional vocab maps, and check every key and shape."""
    if "fc.weight" not in foreign:
        raise ValueError(f"{folder}: no fc.weight among its weights, so it is not an EAGLE draft head (a full model folder?)")
    back = [(new, old) for old, new in RENAMES[layout]]
    state = {_rename(k, back): v for k, v in foreign.items() if k not in BORROWED_KEYS}
    if config.head_type == "eagle3":
        if "d2t" not in state:
            if config.draft_vocab_size != config.vocab_size:
                raise ValueError(f"{folder}: the draft vocab ({config.draft_vocab_size}) is reduced but the weights have no d2t map")
            state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        if "t2d" not in state:  # vLLM ignores t2d; rebuild it from d2t
            state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
            state["t2d"][torch.arange(config.draft_vocab_size) + state["d2t"]] = True
    with torch.device("meta"):
        expected = {k: v.shape for k, v in DraftHead(config).state_dict().items()}
    missing = sorted(_rename(k, RENAMES[layout]) for k in expected.keys() - state.keys())
    unexpected = sorted(_rename(k, RENAMES[layout]) for k in state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{folder}: weights do not fit a {layout} {config.head_type} head (missing {missing}, unexpected {unexpected})")
    wrong = [f"{_rename(k, RENAMES[layout])} {tuple(state[k].shape)} != {tuple(s)}" for k, s in expected.items() if state[k].shape != s]
    if wrong:
        raise ValueError(f"{folder}: weight shapes do not match its config: {wrong}")
    return state


# ---- export ---------------------------------------------------------------------------------

def export_head(source: str | Path, out: str | Path, format: str = "eyas", target=None) -> Path:
    """Write the head in `source` (a head folder in any layout, or a training checkpoint holding `head/`) as `format`.

    The output folder is written atomically; weights keep the source's floating-point dtype.
    `target` (an eyas Target) is checked against the head, and needed only for foreign EAGLE-3
    heads that do not record their fused layers.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose one of {FORMATS}")
    folder = _head_folder(Path(source))
    head = load_head(folder, target)
    head.to(_stored_dtype(folder))
    if format == "eyas":
        return save_head(head, out)
    config = _foreign_config(format, head.config, head.fc.weight.dtype)
    state = {_rename(k, RENAMES[format]): v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    with atomic_folder(out) as tmp:
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return Path(out)


def _head_folder(source: Path) -> Path:
    if (source / CONFIG_NAME).is_file():
        return source
    if (source / "head" / CONFIG_NAME).is_file():  # a training checkpoint: the trainer writes the head there
        return source / "head"
    raise FileNotFoundError(f"{source} is neither a head folder ({CONFIG_NAME}) nor a training checkpoint (head/{CONFIG_NAME})")


def _stored_dtype(folder: Path) -> torch.dtype:
    """The dtype the head was saved in (heads are rebuilt in fp32 on load)."""
    if (folder / WEIGHTS_NAME).is_file():
        with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as f:
            return f.get_tensor("fc.weight").dtype
    return _read_weights(folder)["fc.weight"].dtype


def _foreign_config(format: str, c: HeadConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of `format` for head config `c` (see the module docstring for the layer-id conventions)."""
    if c.head_type != HEAD_TYPE[format]:
        raise ValueError(f"the {format} layout holds {HEAD_TYPE[format]} heads only; this head is {c.head_type}")
    if c.attention_bias:
        raise ValueError("a head with q/k/v biases has no Llama-config equivalent (Llama's attention_bias also biases o_proj)")
    if c.num_layers > MAX_LAYERS.get(format, c.num_layers):
        raise ValueError(f"the {format} layout holds exactly {MAX_LAYERS[format]} decoder layer; this head has {c.num_layers}")
    llama = {
        "model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_scaling": None, "max_position_embeddings": c.max_position_embeddings, "attention_bias": False,
        "vocab_size": c.vocab_size, "num_hidden_layers": c.num_layers, "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if format == "eagle":
        return {"architectures": [EAGLE1_ARCHS[0]], **llama}
    if c.target is not None and c.target.num_hidden_layers in c.fused_layer_ids:
        raise ValueError(
            f"the head fuses layer {c.target.num_hidden_layers}, the target's final *normed* state; {format} captures "
            "that state before the final norm, so the exported head would see different features"
        )
    ids = [i + LAYER_ID_OFFSET[format] for i in c.fused_layer_ids]
    if format == "sglang":
        return {
            "architectures": [SGLANG_ARCHS[0]], **llama, "draft_vocab_size": c.draft_vocab_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        }
    verifier = c.target.name_or_path if c.target is not None else None
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": SPECULATIVE_TOKENS,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            # eyas does not record the target's architecture class; speculators only uses it to compare verifiers.
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
        "transformer_layer_config": llama,
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": False,  # eyas keeps the un-normed hidden as the residual
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": ids,
        "torch_dtype": llama["torch_dtype"],
    }
