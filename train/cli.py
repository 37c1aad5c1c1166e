"""`eyas train` and `python -m eyas.train`: train a draft head from a run YAML with key=value overrides."""

from __future__ import annotations

import argparse
import os

EPILOG = """examples:
  eyas train --config configs/smollm2-135m-eagle3.yaml
  eyas train --config configs/smollm2-135m-eagle3.yaml optim.lr=5e-4 data.limit=200 output_dir=runs/try
  ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 -m eyas.train --config RUN.yaml
  accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml -m eyas.train --config RUN.yaml

An interrupted run (Ctrl-C, SIGTERM) saves a checkpoint; the same command resumes it."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="run YAML (see configs/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="override config entries by dotted path, e.g. optim.lr=3e-4 data.limit=200")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="distill a draft head from a frozen target (one process)",
                       description="Train a draft head from a run YAML (configs/*.yaml) with key=value overrides. "
                       "For several processes or GPUs: accelerate launch -m eyas.train --config RUN.yaml",
                       epilog=EPILOG)  # eyas's Parser: examples keep their lines
    add_arguments(p)
    p.set_defaults(func=train_command)


def train_command(args: argparse.Namespace) -> int:
    from .config import load_config
    from .trainer import run_with_status

    result, status = run_with_status(load_config(args.config, args.overrides))  # bad input raises EyasError
    if result and os.environ.get("RANK", "0") == "0":
        print(" ".join(f"{k}={v:.4f}" for k, v in sorted(result.items())))
    return status  # 130/143 after a stop by SIGINT/SIGTERM (checkpoint saved), so schedulers see the preemption
