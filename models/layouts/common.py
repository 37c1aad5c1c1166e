"""What the head layouts share: file names, reading configs and weights, the Llama-style decoder fields,
and checking that a foreign state dict fits the head its config describes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..config import HeadConfig
from ..errors import InputError, MissingInput
from ..loading import load_safetensors

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
LEGACY_WEIGHTS_NAME = "pytorch_model.bin"  # what the EAGLE reference code saves and reads
HEAD_FILES = (CONFIG_NAME, WEIGHTS_NAME, LEGACY_WEIGHTS_NAME)  # all a head folder holds: what a new head may replace
# Foreign keys that are the target's borrowed modules, which eyas never stores: dropped on import.
BORROWED_KEYS = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise MissingInput(f"{folder} is not a head folder: {CONFIG_NAME} is missing")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise InputError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The head's tensors from model.safetensors or, for the reference layouts, pytorch_model.bin."""
    if (folder / WEIGHTS_NAME).is_file():
        return load_safetensors(folder / WEIGHTS_NAME)
    if (folder / LEGACY_WEIGHTS_NAME).is_file():
        return torch.load(folder / LEGACY_WEIGHTS_NAME, map_location="cpu", weights_only=True)
    raise MissingInput(f"{folder} has {CONFIG_NAME} but neither {WEIGHTS_NAME} nor {LEGACY_WEIGHTS_NAME}")


def stored_dtype(folder: Path) -> torch.dtype:
    """The dtype the head was saved in (heads are rebuilt in fp32 on load)."""
    if (folder / WEIGHTS_NAME).is_file():
        with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as f:
            return f.get_tensor("fc.weight").dtype
    return read_weights(folder)["fc.weight"].dtype


def target_architectures(target) -> list[str]:
    """The target's model classes as its config.json names them (a model built in-process has only its class)."""
    return list(target.model.config.architectures or [type(target.model).__name__])


def required(d: dict[str, Any], key: str, where: str) -> Any:
    if d.get(key) is None:
        raise InputError(f"{where}: required field {key!r} is missing")
    return d[key]


def rename(key: str, pairs: list[tuple[str, str]]) -> str:
    for old, new in pairs:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def shape_from_llama(d: dict[str, Any], where: str, o_bias: bool = False) -> dict[str, Any]:
    """HeadConfig shape fields from a Llama-style config dict; refuses what the eyas layer cannot run. o_bias: the
    head's attention_bias biases o_proj as well as q/k/v (DFlash's does), so a config's attention_bias, which
    biases all four in Llama and Qwen3, is its equivalent and is read."""
    if d.get("hidden_act", "silu") != "silu":
        raise InputError(f"{where}: hidden_act {d['hidden_act']!r} is not supported (eyas heads use silu)")
    if d.get("mlp_bias") or (d.get("attention_bias") and not o_bias):
        raise InputError(f"{where}: mlp_bias/attention_bias heads are not supported "
                         "(Llama's attention_bias also biases o_proj)")
    rope = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling")
    if not scaling and rope.get("rope_type", "default") != "default":
        scaling = {"rope_type": rope["rope_type"]}
    if scaling:
        raise InputError(f"{where}: rope scaling {scaling} is not supported (eyas heads use plain RoPE)")
    heads = int(required(d, "num_attention_heads", where))
    hidden = int(required(d, "hidden_size", where))
    return dict(
        hidden_size=hidden,
        intermediate_size=int(required(d, "intermediate_size", where)),
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        vocab_size=int(required(d, "vocab_size", where)),
        num_layers=int(d.get("num_hidden_layers", 1)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        attention_bias=bool(d.get("attention_bias")),
    )


def llama_fields(c: HeadConfig, dtype: torch.dtype, o_bias: bool = False) -> dict[str, Any]:
    """The Llama-style decoder fields of config `c` (what every foreign layout's config holds); o_bias as in
    `shape_from_llama`."""
    if c.attention_bias and not o_bias:
        raise InputError("a head with q/k/v biases has no Llama-config equivalent "
                         "(Llama's attention_bias also biases o_proj)")
    return {
        "model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_scaling": None, "max_position_embeddings": c.max_position_embeddings, "attention_bias": c.attention_bias,
        "vocab_size": c.vocab_size, "num_hidden_layers": c.num_layers, "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def check_state(state: dict[str, torch.Tensor], config: HeadConfig, folder: Path, layout: str,
                pairs: list[tuple[str, str]]) -> None:
    """Every key a head of `config` has, with its shape; `pairs` (eyas -> foreign prefixes) name keys as stored."""
    from ..drafters.base import DraftHead

    with torch.device("meta"):
        expected = {k: v.shape for k, v in DraftHead(config).state_dict().items()}
    missing = sorted(rename(k, pairs) for k in expected.keys() - state.keys())
    unexpected = sorted(rename(k, pairs) for k in state.keys() - expected.keys())
    if missing or unexpected:
        raise InputError(f"{folder}: weights do not fit a {layout} {config.head_type} head (missing {missing}, "
                         f"unexpected {unexpected})")
    wrong = [f"{rename(k, pairs)} {tuple(state[k].shape)} != {tuple(s)}"
             for k, s in expected.items() if state[k].shape != s]
    if wrong:
        raise InputError(f"{folder}: weight shapes do not match its config: {wrong}")


def vocab_maps(state: dict[str, torch.Tensor], config: HeadConfig, folder: Path) -> None:
    """Fill an EAGLE-3 state's optional d2t / t2d (identity when the draft vocab is the full vocab)."""
    if "d2t" not in state:
        if config.draft_vocab_size != config.vocab_size:
            raise InputError(f"{folder}: the draft vocab ({config.draft_vocab_size}) is reduced "
                             "but the weights have no d2t map")
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    if "t2d" not in state:  # vLLM ignores t2d; rebuild it from d2t
        state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
        state["t2d"][torch.arange(config.draft_vocab_size) + state["d2t"]] = True
