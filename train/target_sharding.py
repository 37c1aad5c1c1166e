"""Where the frozen target's weights live in a multi-process run: a whole copy per process, or sharded.

- DeepSpeed ZeRO-3: the target gets its own parameter-only DeepSpeed engine (no optimizer, the run's
  zero_optimization settings), which partitions every weight across the ranks and gathers each module's
  weights around its forward, as ZeRO-3 inference does. The head's engine is separate (accelerate).
- FSDP (and `distributed.target_placement=shard` under DDP): torch's FSDP2 `fully_shard` on the embedding,
  each decoder layer and the whole model, so each forward all-gathers one layer at a time. The trained
  head is unaffected; it is wrapped by accelerate as configured.
Either way every module of the target keeps its plain call interface (the draft head borrows the
embedding and, for EAGLE-1, the lm_head), so nothing downstream knows the target is sharded.
The target is loaded whole in each process first, so peak host memory at load is one full copy.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Literal

import torch

from eyas.models import Target

Placement = Literal["replicate", "zero3", "fsdp"]


def load_target(config, accelerator, log: Callable[[str], None]) -> Target:
    """The run's frozen target on the run's device, placed as `distributed.target_placement` says (logged)."""
    c, acc = config, accelerator
    plugin = acc.state.deepspeed_plugin
    with _unsharded_loading(plugin):
        target = Target.load(c.target.spec, dtype=c.target.dtype, device=acc.device)
    placement = choose_placement(c.distributed.target_placement, acc.distributed_type.name,
                                 plugin.zero_stage if plugin else None, acc.num_processes)
    shard_target(target, placement, plugin.deepspeed_config if plugin else None, c.batch.size)
    held, total = held_parameters(target)
    per_rank = acc.gather(torch.tensor([held], device=acc.device)).tolist()
    log(f"target placement {placement}: weights held per process {per_rank} of {total}")
    return target


@contextlib.contextmanager
def _unsharded_loading(plugin):
    """Under ZeRO-3 accelerate registers its DeepSpeed config with transformers, whose from_pretrained then
    shards the model at construction (zero.Init). The target is frozen and runs outside the head's engine,
    so it is loaded whole (then sharded by its own engine, see target_sharding); the registration is
    restored afterwards."""
    if plugin is None or plugin.zero_stage != 3:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()



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


def shard_target(target: Target, placement: Placement, deepspeed_config: dict | None = None,
                 micro_batch: int = 1) -> None:
    """Shard `target` in place across the current process group (no-op for `replicate`)."""
    if placement == "zero3":
        _zero3(target, deepspeed_config or {}, micro_batch)
    elif placement == "fsdp":
        _fsdp(target)


def _zero3(target: Target, run_config: dict, micro_batch: int) -> None:
    import deepspeed

    zero = {k: v for k, v in run_config.get("zero_optimization", {}).items()
            if v != "auto" and not k.startswith("offload_optimizer")}  # "auto" values are accelerate's to fill
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {**zero, "stage": 3},
              "bf16": {"enabled": target.dtype == torch.bfloat16}}
    # The engine partitions the parameters and installs ZeRO-3's gather/release hooks on every submodule,
    # so `target(...)`, `target.embed_tokens(...)` and `target.lm_head(...)` keep working unchanged.
    deepspeed.initialize(model=target, config=config)


def _fsdp(target: Target) -> None:
    from torch.distributed.fsdp import fully_shard

    embed, lm_head = target.embed_tokens, target.lm_head
    for layer in target._layers:
        fully_shard(layer)
    ignored: set[torch.nn.Parameter] = set()
    if lm_head.weight is embed.weight:
        # A tied weight is called through two modules that share no FSDP unit: it stays whole.
        ignored = {embed.weight}
    else:  # own units: the head calls them on their own (embedding; EAGLE-1 lm_head; offline logits)
        fully_shard(embed)
        fully_shard(lm_head)
    fully_shard(target.model.get_decoder(), ignored_params=ignored)  # the rest (final norm) as the root


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
        else:
            held += p.numel()
            total += p.numel()
    return held, total
