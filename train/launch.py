"""The accelerator a run gets, and the check that it got what was asked for.

A wrong launch on a CPU machine silently runs one process or unsynchronised copies (see the notes on
distributed training without a GPU), so the process count and distributed type are checked against the
launcher's WORLD_SIZE and the config's expectations before anything is loaded.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch

from eyas.models.errors import EyasError

from .config import RunConfig, run_precision

TRACKERS = {"none": None, "tensorboard": ["tensorboard"], "wandb": ["wandb"], "all": ["tensorboard", "wandb"]}


class LaunchMismatch(EyasError):
    """The run got a different process count or distributed type than the launcher or config asked for."""


def make_accelerator(config: RunConfig):
    """The run's Accelerator: its precision, gradient accumulation and trackers; gloo where no GPU exists."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    # The other ranks wait in the process group while the main one tokenizes the data and counts the draft vocab
    # (main_process_first): the timeout must outlast that on large data, on every backend.
    kwargs = {"timeout": timedelta(minutes=config.distributed.timeout_minutes)}
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Without a GPU, DeepSpeed/DDP need gloo; otherwise accelerate believes it has one process.
        kwargs["backend"] = "gloo"
    handlers = [InitProcessGroupKwargs(**kwargs)]
    return Accelerator(
        mixed_precision="bf16" if run_precision(config) == "bf16" else "no",
        gradient_accumulation_steps=config.batch.grad_accum,
        log_with=TRACKERS[config.logging.backend], project_dir=str(Path(config.output_dir) / "logs"),
        kwargs_handlers=handlers,
    )


def check_launch(accelerator, config: RunConfig) -> str:
    """Refuse a run whose process count/type differs from the launcher's WORLD_SIZE or the config."""
    got_n, got_type = accelerator.num_processes, accelerator.distributed_type.name
    line = f"launch: {got_n} process(es), distributed type {got_type}, device {accelerator.device}"
    problems = []
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if env_world != got_n:
        problems.append(f"the launcher started WORLD_SIZE={env_world} processes but accelerate sees {got_n} "
                        "(on CPU use: ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N)")
    want = config.distributed
    if want.expect_processes is not None and want.expect_processes != got_n:
        problems.append(f"distributed.expect_processes={want.expect_processes} but the run has {got_n} process(es)")
    if want.expect_type is not None and want.expect_type.upper() != got_type:
        problems.append(f"distributed.expect_type={want.expect_type} but the run is {got_type}")
    if got_n > 1 and got_type == "NO":
        problems.append(f"{got_n} processes without a distributed type: they would train unsynchronised copies")
    if problems:
        raise LaunchMismatch(line + "; " + "; ".join(problems))
    return line
