"""Where the frozen target's weights live in a multi-process run, and how each process loads only its part.

- replicate: a whole copy per process, loaded by transformers straight onto the process's device (device_map:
  no copy in host memory first). Offline training (data.hidden_states=offline) needs only the embedding, the
  lm_head and what runs after the decoder (`Target.logits`): its decoder layers stay unread, on the meta device.
- shard (FSDP and DeepSpeed ZeRO-3 runs, and `distributed.target_placement=shard` under DDP or ZeRO-1/2): torch
  FSDP2 through transformers' own distributed loading (`DistributedConfig`): the model is built on the meta
  device, sharded, and each process reads only its own shard of every weight from the checkpoint. Each decoder
  layer is one unit (all-gathered around its forward, then freed); the embedding and the lm_head are units that
  stay whole once gathered (`keep_full_weight`), so the teacher logits' chunks gather nothing. Sharding spans one
  node (`distributed.shard_group_size`, default the node's processes) and replicates across nodes (HSDP), so the
  gathers stay on a node's fast links. The target is frozen and outside the head's engine, so whatever shards the
  head (DeepSpeed or accelerate's FSDP), FSDP2 shards the target: one mechanism, loaded shard by shard.
The draft head reads its tokens' embeddings from rows looked up once per micro-batch (losses.batch_embedding), so
its TTT steps gather no embedding. Every module keeps its plain call interface (the head borrows the embedding
and, for EAGLE-1, the lm_head), so nothing downstream knows the target is sharded.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Literal

import torch

from eyas.models import Target
from eyas.models.errors import ConfigError
from eyas.models.loading import load_model_and_tokenizer
from eyas.models.target import resolve_dtype

from .config import target_dtype

Placement = Literal["replicate", "shard"]


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
    with _without_hf_deepspeed():
        if placement == "shard":
            model, tokenizer, name = load_model_and_tokenizer(
                c.target.spec, dtype, distributed=fsdp_config(c.target.spec, acc.num_processes, group))
        else:
            model, tokenizer, name = load_model_and_tokenizer(c.target.spec, dtype, device=acc.device,
                                                              decoder=not offline)
    target = Target(model, tokenizer, name)
    held, total = held_parameters(target)
    per_rank = acc.gather(torch.tensor([held], device=acc.device)).tolist()
    what = " (decoder layers not loaded: offline)" if offline else ""
    if placement == "shard":
        what = f" (FSDP2, sharded over groups of {group} process(es))"
    log(f"target placement {placement}: weights held per process {per_rank} of {total}{what}")
    return target


@contextlib.contextmanager
def _without_hf_deepspeed():
    """accelerate registers a ZeRO-3 config with transformers (zero3_init_flag), whose from_pretrained would then
    build the target under deepspeed.zero.Init for the head's engine; the frozen target is placed here instead."""
    from transformers.integrations import deepspeed as hf_ds

    before = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = before


def choose_placement(requested: str, distributed_type: str, zero_stage: int | None, processes: int) -> Placement:
    """requested: auto | replicate | shard (config `distributed.target_placement`). auto shards where the head is
    sharded (FSDP, ZeRO-3) and replicates otherwise."""
    if requested == "replicate" or processes == 1:
        return "replicate"
    if requested == "shard" or distributed_type == "FSDP" or (distributed_type == "DEEPSPEED" and zero_stage == 3):
        return "shard"
    return "replicate"


def shard_group_size(requested: int | None, processes: int) -> int:
    """Processes per sharding group: `requested`, else the launcher's processes per node (LOCAL_WORLD_SIZE)."""
    group = requested or int(os.environ.get("LOCAL_WORLD_SIZE", processes))
    if group < 1 or processes % group:
        raise ConfigError(f"distributed.shard_group_size={group} must divide the {processes} processes of the run")
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


def held_parameters(target: Target) -> tuple[int, int]:
    """(elements of the target's weights stored in this process, elements of the whole target)."""
    from torch.distributed.tensor import DTensor

    held = total = 0
    for p in target.parameters():
        if isinstance(p, DTensor):
            held += p.to_local().numel()
            total += p.numel()
        elif p.device.type != "meta":
            held += p.numel()
            total += p.numel()
        else:  # not loaded (offline: decoder layers)
            total += p.numel()
    return held, total
