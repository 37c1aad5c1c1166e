"""A training run's configuration: nested frozen dataclasses read from one YAML plus key=value overrides.

Every field is typed and checked on load: an unknown or mistyped key is an error that names it and
the nearest valid key; a value of the wrong type names the key and the expected type. The resolved
config (YAML + overrides + defaults) is written into each run folder, so a run can be repeated.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from eyas.models.errors import ConfigError, MissingInput


@dataclass(frozen=True)
class TargetConfig:
    # Local HF folder, .gguf file, hub id, or the alias `smollm2-135m`.
    spec: str = "smollm2-135m"
    # auto: bf16 on a GPU and on a CPU with native bf16 (AMX, AVX512-BF16), fp32 on other CPUs.
    dtype: Literal["auto", "fp32", "bf16"] = "auto"


@dataclass(frozen=True)
class HeadSection:
    # The drafter algorithm (models/drafters): eagle1, eagle3 (EAGLE-3 and its 3.1 norms as options) or peagle
    # (parallel drafting).
    type: str = "eagle3"
    # Decoder layers (null: the algorithm's default, 1 for EAGLE-1/3, 4 for P-EAGLE).
    num_layers: int | None = None
    # Algorithms with an lm_head of their own (eagle3, peagle): size of the reduced output vocabulary (null = full
    # target vocab, no vocab map).
    draft_vocab_size: int | None = None
    # Target layers whose inputs are fused (null: the algorithm's default, e.g. 2, N//2, N-3 for EAGLE-3).
    fused_layer_ids: tuple[int, ...] | None = None
    # The algorithm's own settings (the Options of models/drafters/<type>.py), e.g. {fc_norm: true, norm_output:
    # true} for EAGLE-3.1 or {depths: 8} for P-EAGLE.
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DataConfig:
    # A data-layer source (e.g. `sharegpt`, a .jsonl/.json file, a hub dataset), or a folder written by
    # datasets.save_to_disk that already holds `input_ids` and `loss_mask` columns.
    source: str = "sharegpt"
    # Renames from the source's field names to the data layer's (null = the data layer's defaults).
    field_map: dict[str, str] | None = None
    max_length: int = 2048
    # Which assistant turns count for the loss (passed to the data layer).
    assistant_turns: str = "all"
    # Fraction (<1) or number (>=1) of examples kept aside for held-out acceptance.
    held_out: float = 0.02
    limit: int | None = None
    # Tokenizer processes (null: one per 20k conversations, at most one per core, 16 at most).
    num_proc: int | None = None
    # online: the frozen target runs in the loop; offline: read `cache_dir` (eyas data cache-hidden).
    hidden_states: Literal["online", "offline"] = "online"
    cache_dir: str | None = None
    # Where the draft vocab map is cached (null = <output_dir>/vocab_map.safetensors).
    vocab_cache: str | None = None
    # Count the draft vocab on this source's loss-masked tokens instead of the training data's (null): a
    # small or self-distilled training set holds too few distinct tokens, so a vocab counted on it misses
    # many tokens of other text (the demo: 9 % of MT-bench answer tokens with 8192 counted on its 336k).
    vocab_source: str | None = None
    # DataLoader worker processes (null: 4 on a GPU, none on a CPU).
    loader_workers: int | None = None


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    # Max global grad norm; 0 disables clipping.
    grad_clip: float = 0.5


@dataclass(frozen=True)
class ScheduleConfig:
    kind: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0
    # Optimizer steps to train; if null, `epochs` passes over the training split decide.
    total_steps: int | None = None
    epochs: float = 1.0
    # Final lr as a fraction of optim.lr for cosine/linear decay.
    min_lr_ratio: float = 0.0


@dataclass(frozen=True)
class LossConfig:
    # EAGLE-3 training-time test: unrolled draft steps and the weight decay per step (weight = decay**i).
    ttt_steps: int = 7
    step_decay: float = 0.8
    # EAGLE-1: SmoothL1(feature) * feature_weight + soft CE * ce_weight (reference: 1.0 and 0.1).
    feature_weight: float = 1.0
    ce_weight: float = 0.1
    # Uniform noise on the head's step-0 input feature, scaled as in the EAGLE reference
    # ((U-0.5) * feature_noise * 512 / T); 0 disables.
    feature_noise: float = 0.0


@dataclass(frozen=True)
class BatchConfig:
    # Sequences per process per micro-batch; the global batch is size * processes * grad_accum.
    size: int = 4
    grad_accum: int = 1
    # Sort each optimizer step's examples by length before dealing them out as micro-batches (less padding; the
    # step's examples stay the same at any world size).
    group_by_length: bool = True


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 500
    keep: int = 2
    # auto: continue from the newest checkpoint in output_dir if one exists; none: start fresh
    # (refuses a non-empty checkpoints folder); or a path to a checkpoint folder.
    resume: str = "auto"


@dataclass(frozen=True)
class LoggingConfig:
    backend: Literal["none", "tensorboard", "wandb", "all"] = "none"
    every: int = 10
    # Held-out acceptance every N optimizer steps (0 = only at the end) over at most `eval_batches`.
    eval_every: int = 0
    eval_batches: int = 8
    project: str = "eyas"


@dataclass(frozen=True)
class DistributedConfig:
    # What this run must get from `accelerate launch`; a mismatch stops the run before training
    # (a wrong launch otherwise silently runs one process or unsynchronised copies).
    # null = derive from the launcher's WORLD_SIZE only.
    expect_processes: int | None = None
    # e.g. NO, MULTI_CPU, MULTI_GPU, DEEPSPEED, FSDP (accelerate's DistributedType names).
    expect_type: str | None = None
    # The frozen target's weights: auto = sharded (torch FSDP2, each process loading only its shard) under
    # DeepSpeed ZeRO-3 and FSDP, a whole copy per process otherwise; replicate = always whole (no gathers, fastest
    # when it fits); shard = sharded under DDP and ZeRO-1/2 too.
    target_placement: Literal["auto", "replicate", "shard"] = "auto"
    # Processes per sharding group (null: the processes of one node, LOCAL_WORLD_SIZE): the target (and an FSDP
    # head) is sharded within a group and replicated across groups, so its gathers stay on a node's fast links.
    shard_group_size: int | None = None
    # How long a rank waits for the others (e.g. while the main process tokenizes a large data set).
    timeout_minutes: int = 180


@dataclass(frozen=True)
class RunConfig:
    output_dir: str = "runs/default"
    seed: int = 0
    # The head's training precision: bf16 autocast or fp32 (TF32 matmuls on a GPU); auto: bf16 on a GPU and on a
    # CPU with native bf16 (AMX, AVX512-BF16), fp32 on other CPUs.
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    target: TargetConfig = field(default_factory=TargetConfig)
    head: HeadSection = field(default_factory=HeadSection)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        from eyas.models.drafters import NAMES, algorithm
        from eyas.models.errors import InputError

        if self.head.type not in NAMES:
            raise ConfigError(f"head.type {self.head.type!r} is not one of {', '.join(NAMES)}")
        algo = algorithm(self.head.type)
        try:
            algo.options_from_dict(self.head.options)
        except (InputError, TypeError) as e:
            raise ConfigError(f"head.options: {e}") from None
        checks = [
            (self.head.num_layers is None or self.head.num_layers >= 1, "head.num_layers must be >= 1"),
            (algo.reduced_vocab or self.head.draft_vocab_size is None,
             f"head.draft_vocab_size is for heads with an lm_head of their own "
             f"({', '.join(n for n in NAMES if algorithm(n).reduced_vocab)}); {self.head.type} heads predict "
             "through the target's full lm_head: remove it"),
            (self.loss.ttt_steps >= 1, "loss.ttt_steps must be >= 1"),
            (self.batch.size >= 1 and self.batch.grad_accum >= 1, "batch.size and batch.grad_accum must be >= 1"),
            (self.data.max_length >= 4, "data.max_length must be >= 4"),
            (self.data.held_out >= 0, "data.held_out must be >= 0"),
            (self.data.hidden_states == "online" or self.data.cache_dir,
             "data.hidden_states=offline needs data.cache_dir (the folder written by `eyas data cache-hidden`)"),
            (self.optim.lr > 0, "optim.lr must be > 0"),
            (self.checkpoint.every >= 1 and self.checkpoint.keep >= 1,
             "checkpoint.every and checkpoint.keep must be >= 1"),
            (self.logging.every >= 1, "logging.every must be >= 1"),
            (self.schedule.total_steps is None or self.schedule.total_steps >= 1, "schedule.total_steps must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))


def run_device() -> str:
    """The device a training process gets: CUDA when visible (accelerate picks the local GPU), else CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_precision(config: RunConfig) -> str:
    """config.precision with `auto` resolved for the device the run gets."""
    from eyas.models.loading import default_dtype

    return default_dtype(run_device()) if config.precision == "auto" else config.precision


def target_dtype(config: RunConfig) -> str:
    """config.target.dtype with `auto` resolved for the device the run gets."""
    from eyas.models.loading import default_dtype

    return default_dtype(run_device()) if config.target.dtype == "auto" else config.target.dtype


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---- building from dicts -------------------------------------------------------------------------
def from_dict(cls: type, raw: Any, path: str = "") -> Any:
    """Build dataclass `cls` from nested dicts, rejecting unknown keys and mistyped values."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        full = f"{path}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key {full!r}{_nearest(str(key), names, path)}")
        kwargs[key] = _coerce(hints[key], value, full)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path.rstrip('.') or 'config'}: {e}") from e


def _nearest(key: str, names: list[str], path: str) -> str:
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    hint = f"; did you mean {path + close[0]!r}?" if close else ""
    return f"{hint} (valid keys{' under ' + path.rstrip('.') if path else ''}: {', '.join(names)})"


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} fits none of {tp}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key} must be one of {list(args)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        item_types = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(item_types) != len(value):
            raise ConfigError(f"{key} must have {len(item_types)} items, got {len(value)}")
        return tuple(_coerce(t, v, f"{key}[{i}]") for i, (t, v) in enumerate(zip(item_types, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return {_coerce(args[0], k, key): _coerce(args[1], v, f"{key}.{k}") for k, v in value.items()}
    if tp is float:
        # YAML reads `3e-4` (no dot) as a string; accept it and ints as floats.
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be a number, got {value!r}") from None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is Any:  # checked where it is used (head.options: by the algorithm's Options)
        return value
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return str(value)
    raise TypeError(f"unsupported config type {tp} for {key}")


# ---- YAML + overrides ----------------------------------------------------------------------------
def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `dotted.key=value` strings (values parsed as YAML) to a nested dict, in order."""
    raw = _deep_copy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value (e.g. optim.lr=3e-4)")
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node[parts[-1]] = yaml.safe_load(text) if text else ""
    return raw


def _deep_copy(d: Any) -> Any:
    return {k: _deep_copy(v) for k, v in d.items()} if isinstance(d, dict) else d


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a run YAML (or only defaults when `path` is None) and apply key=value overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise MissingInput(f"run config {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            problem = " ".join(str(getattr(e, "problem", None) or e).split())
            raise ConfigError(f"{where}: {path.name} is not valid YAML ({problem})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path} is not UTF-8 text; re-save it as UTF-8") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of sections (target:, data:, head:, ...), "
                              f"got a {type(raw).__name__}; see configs/*.yaml")
    return from_dict(RunConfig, apply_overrides(raw, list(overrides)))


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
