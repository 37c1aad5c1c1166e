"""Where the frozen target's weights live in a multi-process run, and how each process loads only its part.

- replicate: a whole copy per process, loaded by transformers straight onto the process's device (device_map:
  no copy in host memory first). Offline training (data.hidden_states=offline) needs only the embedding, the
  lm_head and what runs after the decoder (`Target.logits`): its decoder layers stay unread, on the meta device.
- fsdp (FSDP runs, and `distributed.target_placement=shard` under DDP): torch FSDP2 through transformers'
  own distributed loading (`DistributedConfig`): the model is built on the meta device, sharded, and each process
  reads only its own shard of every weight from the checkpoint. Each decoder layer is one unit (all-gathered
  around its forward, then freed); the embedding and the lm_head are units that stay whole once gathered
  (`keep_full_weight`), so the teacher logits' chunks gather nothing. Sharding spans one node
  (`distributed.shard_group_size`, default the node's processes) and replicates across nodes (HSDP), so the
  gathers stay on a node's fast links.
- zero3 (DeepSpeed ZeRO-3): the model is built under deepspeed.zero.Init with the target's own config, so each
  weight is partitioned as it is created and rank 0 streams the checkpoint into the partitions one tensor at a
  time (transformers' ZeRO-3 loading); a parameter-only DeepSpeed engine then gathers each module's weights
  around its forward, as ZeRO-3 inference does (also around each call of the lm_head by the teacher's chunks).
  Across nodes the forward gathers come from a node-local secondary copy (`zero_hpz_partition_size`, ZeRO++).
Under every placement the draft head reads its tokens' embeddings from rows looked up once per micro-batch
(losses.batch_embedding), so its TTT steps gather no embedding. Every module keeps its plain call interface
(the head borrows the embedding and, for EAGLE-1, the lm_head), so nothing downstream knows the target is sharded.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Literal

import torch

from eyas.models import Target
from eyas.models.loading import load_model_and_tokenizer
from eyas.models.target import resolve_dtype

from .config import target_dtype

Placement = Literal["replicate", "zero3", "fsdp"]


def load_target(config, accelerator, log: Callable[[str], None]) -> Target:
    """The run's frozen target on the run's device, placed as `distributed.target_placement` says (logged)."""
    c, acc = config, accelerator
    plugin = acc.state.deepspeed_plugin
    offline = c.data.hidden_states == "offline"
    # Offline, the target is only its embedding, lm_head and final layers: small enough to replicate.
    placement = "replicate" if offline else choose_placement(
        c.distributed.target_placement, acc.distributed_type.name, plugin.zero_stage if plugin else None,
        acc.num_processes)
    dtype = resolve_dtype(target_dtype(c))
    group = shard_group_size(c.distributed.shard_group_size, acc.num_processes)
    if placement == "fsdp":
        model, tokenizer, name = load_model_and_tokenizer(c.target.spec, dtype,
                                                          distributed=fsdp_config(c.target.spec, acc.num_processes,
                                                                                  group))
    elif placement == "zero3":
        ds_config = zero3_config(plugin.deepspeed_config, dtype, c.batch.size, acc.num_processes, group)
        with _zero3_construction(ds_config):
            model, tokenizer, name = load_model_and_tokenizer(c.target.spec, dtype, device=None)
    else:
        model, tokenizer, name = load_model_and_tokenizer(c.target.spec, dtype, device=acc.device, decoder=not offline)
    target = Target(model, tokenizer, name)
    if placement == "zero3":
        _zero3_engine(target, ds_config)
    held, total = held_parameters(target)
    per_rank = acc.gather(torch.tensor([held], device=acc.device)).tolist()
    what = " (decoder layers not loaded: offline)" if offline else ""
    if placement != "replicate":
        what = f" (sharded over groups of {group} process(es))"
    log(f"target placement {placement}: weights held per process {per_rank} of {total}{what}")
    return target


def choose_placement(requested: str, distributed_type: str, zero_stage: int | None, processes: int) -> Placement:
    """requested: auto | replicate | shard (config `distributed.target_placement`)."""
    if requested == "replicate" or processes == 1:
        return "replicate"
    if distributed_type == "DEEPSPEED":
        if zero_stage == 3:
            return "zero3"
        if requested == "shard":
            raise ValueError(f"distributed.target_placement=shard under DeepSpeed needs ZeRO stage 3 (got stage "
                             f"{zero_stage}); use the ZeRO-3 accelerate config or target_placement=auto")
        return "replicate"
    if distributed_type == "FSDP" or requested == "shard":
        return "fsdp"
    return "replicate"


def shard_group_size(requested: int | None, processes: int) -> int:
    """Processes per sharding group: `requested`, else the launcher's processes per node (LOCAL_WORLD_SIZE)."""
    group = requested or int(os.environ.get("LOCAL_WORLD_SIZE", processes))
    if group < 1 or processes % group:
        raise ValueError(f"distributed.shard_group_size={group} must divide the {processes} processes of the run")
    return group


def fsdp_config(spec: str, processes: int, group: int):
    """transformers' DistributedConfig for a target sharded over `group` processes, replicated across groups: each
    decoder layer its own FSDP2 unit, the embedding and lm_head units kept whole once gathered."""
    from transformers import AutoConfig
    from transformers.distributed import DistributedConfig

    from eyas.models.loading import resolve_spec

    where, gguf_file, _ = resolve_spec(spec)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(where, gguf_file=gguf_file))
    names = {m: n for n, m in model.named_modules()}
    layers = Target(model, None, spec, cpu_kernels=False)._layers
    plan = {f"{names[layers]}.*": "free_full_weight", names[model.get_input_embeddings()]: "keep_full_weight"}
    if model.get_output_embeddings() is not None:
        plan[names[model.get_output_embeddings()]] = "keep_full_weight"
    return DistributedConfig(fsdp_size=group, dp_replicate_size=processes // group, fsdp_plan=plan)


def zero3_config(run_config: dict, dtype: torch.dtype, micro_batch: int, processes: int, group: int) -> dict:
    """The target's own DeepSpeed config: the run's zero_optimization settings at stage 3, no optimizer; across
    nodes, forward gathers from a node-local secondary partition (ZeRO++ hpZ)."""
    zero = {k: v for k, v in run_config.get("zero_optimization", {}).items()
            if v != "auto" and not k.startswith("offload_optimizer")}  # "auto" values are accelerate's to fill
    if group < processes:
        zero.setdefault("zero_hpz_partition_size", group)
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "zero_optimization": {**zero, "stage": 3}, "bf16": {"enabled": dtype == torch.bfloat16}}


@contextlib.contextmanager
def _zero3_construction(ds_config: dict):
    """transformers builds (and loads) a model under deepspeed.zero.Init while an HfDeepSpeedConfig of stage 3 is
    registered: the target's own config for the time of its loading, then whatever accelerate registered before."""
    from transformers.integrations import deepspeed as hf_ds

    before = hf_ds._hf_deepspeed_config_weak_ref
    keep = hf_ds.HfDeepSpeedConfig(ds_config)  # registers itself (weakly): keep a reference while loading
    try:
        yield
    finally:
        del keep
        hf_ds._hf_deepspeed_config_weak_ref = before


def _zero3_engine(target: Target, ds_config: dict) -> None:
    import deepspeed

    # The engine installs ZeRO-3's gather/release hooks on every submodule, so `target(...)`,
    # `target.embed_tokens(...)` and `target.lm_head(...)` keep working unchanged.
    deepspeed.initialize(model=target, config=ds_config)


def held_parameters(target: Target) -> tuple[int, int]:
    """(elements of the target's weights stored in this process, elements of the whole target)."""
    from torch.distributed.tensor import DTensor

    held = total = 0
    for p in target.parameters():
        if hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3: the local partition (padded to equal shards)
            held += p.ds_tensor.numel()
            total += p.ds_numel
        elif isinstance(p, DTensor):
            held += p.to_local().numel()
            total += p.numel()
        elif p.device.type != "meta":
            held += p.numel()
            total += p.numel()
        else:  # not loaded (offline: decoder layers)
            total += p.numel()
    return held, total
