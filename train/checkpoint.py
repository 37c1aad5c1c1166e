"""Checkpoints: one folder per step, written under a temporary name and renamed when complete.

    <output_dir>/checkpoints/step-00000100/
        head/           the head in eyas head format (config.json + model.safetensors, vocab map
                        installed): `eyas export` and `load_head` read it directly
        state/          accelerator.save_state: wrapped model, optimizer, scheduler, RNG of every rank
                        (DeepSpeed: its own sharded layout)
        trainer.json    step, consumed stream positions, world size, tokens seen
        state-universal/  (DeepSpeed only, written on the first resume at another world size) the ZeRO
                        state converted to DeepSpeed's world-size independent universal layout

All ranks write `state/` into the same temporary folder; the main process adds head/ and
trainer.json and renames the folder, so a crash leaves the previous checkpoints and at most
one `.step-*.tmp` folder, which is ignored and removed by the next save or resume.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from eyas.models import DraftHead, save_head
from eyas.models.atomic import atomic_file
from eyas.models.errors import MissingInput

STATE, HEAD, TRAINER = "state", "head", "trainer.json"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.name.startswith("step-") and (p / TRAINER).is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def remove_partial(output_dir: str | Path) -> None:
    """Remove checkpoint folders a killed run left half-written (main process; nothing else writes them then)."""
    root = checkpoints_dir(output_dir)
    if root.is_dir():
        for partial in root.glob(".step-*.tmp"):
            shutil.rmtree(partial, ignore_errors=True)


def save_checkpoint(accelerator, model, head_state: dict[str, Any] | None, head_config, trainer_state: dict[str, Any],
                    output_dir: str | Path, keep: int) -> Path:
    """Collective: every rank must call it. head_state is the full head state dict (main process)."""
    root = checkpoints_dir(output_dir)
    final = root / f"step-{trainer_state['step']:08d}"
    tmp = root / f".{final.name}.tmp"
    if accelerator.is_main_process:
        remove_partial(output_dir)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / STATE))
    # every rank's part of the state is written before the main process finishes the folder and renames it: save_state
    # writes each rank's files (its RNG state; under DeepSpeed its optimizer shard) without waiting for the others, and
    # a rank still writing into the folder as it moved failed the save (a lost connection at the next barrier, seen in
    # a 2-process ZeRO-2 run)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_head(head_state, head_config, tmp / HEAD, {"step": trainer_state["step"]})
        with atomic_file(tmp / TRAINER) as f:
            json.dump(trainer_state, f, indent=2)
        if final.exists():  # re-saving the same step (e.g. stop right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def write_head(head_state: dict[str, Any], head_config, folder: Path, extra: dict[str, Any]) -> None:
    """Save a full head state dict (gathered from any sharding) as an fp32 eyas head folder."""
    head = DraftHead(head_config)
    head.load_state_dict(head_state)
    save_head(head.float(), folder, extra=extra)


def load_checkpoint(accelerator, folder: Path) -> dict[str, Any]:
    """Restore model/optimizer/scheduler/RNG into the prepared objects; return trainer.json."""
    if not (folder / TRAINER).is_file():
        raise MissingInput(f"{folder} is not a complete checkpoint ({TRAINER} missing)")
    state = json.loads((folder / TRAINER).read_text())
    if accelerator.state.deepspeed_plugin is not None and state["world_size"] != accelerator.num_processes:
        _load_universal(accelerator, folder)
    else:
        accelerator.load_state(str(folder / STATE))
    return state


UNIVERSAL, DS_TAG = "state-universal", "pytorch_model"  # DS_TAG: the folder accelerate's save_state gives DeepSpeed


def _load_universal(accelerator, folder: Path) -> None:
    """DeepSpeed refuses ZeRO shards saved by another number of processes. Convert them once (main process)
    with DeepSpeed's own converter to its universal, world-size independent layout in <checkpoint>/state-universal
    (the rest of state/ copied alongside; state/ itself is left as saved), and load that."""
    universal = folder / UNIVERSAL
    if accelerator.is_main_process and not universal.is_dir():
        tmp = folder / f".{UNIVERSAL}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(folder / STATE, tmp, ignore=shutil.ignore_patterns(DS_TAG))  # scheduler, RNG states
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               str(folder / STATE / DS_TAG), "--output_folder", str(tmp / DS_TAG), "--inject_missing_state",
               "--num_extract_workers", "1", "--num_merge_workers", "1"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"could not convert {folder} to a DeepSpeed universal checkpoint for a different "
                               f"number of processes:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        os.replace(tmp, universal)
    accelerator.wait_for_everyone()
    config = accelerator.deepspeed_engine_wrapped.engine._config  # DeepSpeed reads the flag at load time
    config.load_universal_checkpoint = True
    try:
        accelerator.load_state(str(universal))
    finally:
        config.load_universal_checkpoint = False
