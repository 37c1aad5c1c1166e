"""The training recipe: setup → train → save → cleanup, one process or many under `accelerate launch`.

- The frozen target is loaded in every process, outside `accelerator.prepare`: it is never in the
  optimizer, holds no gradients and runs under no_grad. Under ZeRO-3/FSDP each process loads only its shard
  (see target_sharding.py; `distributed.target_placement`), otherwise each process holds it whole.
- The head and its loss are one module (`DistillationLoss`), the only thing prepared with the optimizer.
- Teacher logits are computed only at the rows that carry loss, in chunks, by the target's own head
  (`Target.logits` over those rows' hidden states): never [B, T, V].
- Data order is global and world-size independent (see data.py); the trainer does its own sharding (a
  DataLoader over data.StepSampler), so no dataloader is prepared and `accelerate` never re-scales the scheduler.
- Host syncs: metrics stay on the device, summed over a logging window, and cross to the host once per window
  (one reduce), together with every micro-step's loss (a NaN anywhere stops the run there) and the stop flags.
  A checkpoint or evaluation forces that sync first, so nothing is saved after a non-finite loss.
- Illegal combinations rejected at setup: a launch whose process count/type differs from what was
  expected; an offline cache that does not hold the states the head reads; a draft vocab for a head without an
  lm_head of its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import resource
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from eyas.models import DraftHead, head_config_for
from eyas.models.atomic import atomic_file, make_folder
from eyas.models.errors import ConfigError, EyasError
from eyas.models.signals import GracefulStop

from . import checkpoint
from .config import RunConfig, dump_config
from .data import (
    ExampleStream,
    StepSampler,
    collate,
    draft_vocab,
    lengths_of,
    load_examples,
    loader_workers,
    micro_batch_start,
    train_batches,
)
from .launch import TRACKERS, LaunchMismatch, check_launch, make_accelerator
from .losses import DistillationLoss, acceptance, target_teacher
from .optim import optimizer_and_schedule
from .target_sharding import load_target

logger = logging.getLogger(__name__)


class NonFiniteLoss(EyasError):
    """The loss became NaN/inf: training stops; the last checkpoint on disk is the last good state."""


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class Trainer:
    """Distill a draft head from a frozen target as described by a RunConfig."""

    def __init__(self, config: RunConfig) -> None:
        """Setup, in order: accelerator, frozen target, data, head (and its draft vocabulary), optimizer, resume."""
        from accelerate.utils import set_seed

        self.config = c = config
        self.out = make_folder(c.output_dir)  # a file in the way is named now, not after loading the target
        self.accelerator = acc = make_accelerator(c)
        self.log(check_launch(acc, c))
        set_seed(c.seed)
        self.target = load_target(c, acc, self.log)
        with acc.main_process_first():
            self.train_set, self.held_out, summary = load_examples(c.data, self.target, c.seed)
        self.log(f"data: {summary}; {len(self.train_set)} train / {len(self.held_out)} held-out examples")
        self.head = self._build_head()
        self.world = acc.num_processes
        self.global_batch = c.batch.size * self.world * c.batch.grad_accum
        self.total_steps = c.schedule.total_steps or max(1, math.ceil(c.schedule.epochs * len(self.train_set)
                                                                      / self.global_batch))
        self.model, self.optimizer, self.scheduler = self._prepare_optimizer()
        self.step, self.consumed, self.tokens_seen = 0, 0, 0
        self.metrics_rows = 0  # lines in metrics.jsonl (main process): a resume cuts the file back to its checkpoint's
        self.stream = ExampleStream(self.train_set, c.seed)
        self.pad_id = self.target.tokenizer.pad_token_id if self.target.tokenizer.pad_token_id is not None else 0
        self._stop = GracefulStop(self.log, "saving a checkpoint at the next logging step, then exiting"
                                  if self.world > 1 else "saving a checkpoint after this step, then exiting")
        self._resume()
        self.lengths = lengths_of(self.train_set) if c.batch.group_by_length else None
        if acc.is_main_process:
            with atomic_file(self.out / "config.yaml") as f:
                f.write(dump_config(c))
        if TRACKERS[c.logging.backend]:
            acc.init_trackers(c.logging.project, config=_flat(c.to_dict()))

    def _build_head(self) -> DraftHead:
        """The head the config describes, on the run's device, with its draft vocabulary installed (EAGLE-3)."""
        c, acc = self.config, self.accelerator
        hc = c.head
        head_config = head_config_for(self.target, hc.type, draft_vocab_size=hc.draft_vocab_size,
                                      fused_layer_ids=hc.fused_layer_ids, num_layers=hc.num_layers,
                                      options=hc.options)
        head = DraftHead(head_config, self.target).to(acc.device)
        self.reads = head.reads(self.target.num_layers)  # the target states the head trains on
        if c.data.hidden_states == "offline":
            self.cached_states = self.train_set.reader(self.reads, self.target.num_layers, c.data.cache_dir)
        if head_config.draft_vocab_size < head_config.vocab_size:
            head.set_vocab_map(draft_vocab(c, self.target, self.train_set, head_config.draft_vocab_size, acc, self.log))
        return head

    def _prepare_optimizer(self):
        """(wrapped loss module, optimizer, scheduler): the head and its loss are the only prepared model."""
        c, acc = self.config, self.accelerator
        model = DistillationLoss(self.head, c.loss)
        optimizer, scheduler = optimizer_and_schedule(c, self.head.parameters(), self.total_steps)
        if acc.state.deepspeed_plugin is not None:
            ds = acc.state.deepspeed_plugin.deepspeed_config
            ds["train_micro_batch_size_per_gpu"] = c.batch.size  # no prepared dataloader to infer it from
            ds["gradient_clipping"] = c.optim.grad_clip
        model, optimizer = acc.prepare(model, optimizer)
        acc.register_for_checkpointing(scheduler)
        return model, optimizer, scheduler

    # ---- setup helpers -------------------------------------------------------------------------
    def log(self, message: str) -> None:
        if self.accelerator.is_main_process:
            logger.info("[eyas train] %s", message)

    @property
    def exit_status(self) -> int:
        """0, or 128 + the signal that stopped the run (130 Ctrl-C, 143 SIGTERM): a scheduler tells preemption
        from success by it."""
        return self._stop.exit_status

    def _resume(self) -> None:
        c = self.config.checkpoint
        if self.accelerator.is_main_process:
            checkpoint.remove_partial(self.out)
        found = checkpoint.list_checkpoints(self.out)
        if c.resume == "none":
            if found:
                raise ConfigError(f"{self.out} already has checkpoints; use checkpoint.resume=auto or another "
                                  "output_dir")
        if c.resume in ("auto", "none"):
            folder = found[-1] if found and c.resume == "auto" else None
        else:
            folder = Path(c.resume)
        if folder is None:
            self._cut_metrics(0)  # a run that starts over drops the rows of one killed before its first checkpoint
            return
        state = checkpoint.load_checkpoint(self.accelerator, folder)
        self.step, self.consumed, self.tokens_seen = state["step"], state["consumed"], state["tokens_seen"]
        self._cut_metrics(state.get("metrics_rows"))
        self.log(f"resumed from {folder} at step {self.step} (saved by {state['world_size']} process(es), "
                 f"now {self.world})")

    def _cut_metrics(self, rows: int | None) -> None:
        """Keep the first `rows` lines of metrics.jsonl (those written up to the checkpoint resumed from): the steps
        run again after a resume are not logged twice, nor a line half-written by a kill kept."""
        path = self.out / "metrics.jsonl"
        if rows is None or not self.accelerator.is_main_process or not path.is_file():
            self.metrics_rows = rows or 0
            return
        lines = path.read_bytes().splitlines()[:rows]
        self.metrics_rows = len(lines)
        with atomic_file(path, "wb") as f:
            f.write(b"".join(line + b"\n" for line in lines))

    # ---- one micro-batch -------------------------------------------------------------------------
    def _batch(self, rows: dict[str, torch.Tensor] | list[dict[str, Any]]) -> dict[str, Any]:
        """A collated batch (or rows to collate) on the run's device; pinned host tensors copy asynchronously. With
        `seeds`: a seed per row for the head's own random choices in its unroll (P-EAGLE's rows, DFlash's anchors),
        from the run's seed, the step and the row's tokens, so a row draws the same at any world size and after a
        resume."""
        batch = rows if isinstance(rows, dict) else collate(rows, self.pad_id)
        seeds = [row_seed(self.config.seed, self.step, ids[real])  # the row's own tokens: padding depends on the batch
                 for ids, real in zip(batch["input_ids"], batch["attention_mask"])]
        return {**{k: v.to(self.accelerator.device, non_blocking=True) for k, v in batch.items()}, "seeds": seeds}

    def _target_states(self, batch: dict[str, torch.Tensor]):
        """-> (states [B, T, F], teacher): the states the head reads, from the frozen target or the offline cache (the
        final hidden state or the fused layers it holds); the teacher maps
        flat rows [n] of the batch to the target's logits there [n, V], through the target's own head (losses.py
        asks only for the rows that carry loss, in chunks)."""
        with torch.no_grad():
            if "hidden" in batch:  # offline cache (what it holds checked at setup)
                hidden = batch["hidden"]
                states = self.cached_states(batch)
            else:
                out = self.target(batch["input_ids"], padding_mask=batch["attention_mask"], layer_ids=self.reads,
                                  logits=False)
                hidden, states = out.hidden, out.features
        return states, target_teacher(self.target, hidden)

    def _forward(self, batch: dict[str, torch.Tensor]):
        states, teacher = self._target_states(batch)
        valid = batch["attention_mask"] & batch["loss_mask"]
        return self.model(batch["input_ids"], valid, states, teacher, batch["seeds"])

    def _sync(self, window: dict[str, torch.Tensor], losses: list[torch.Tensor],
              tokens: int) -> tuple[dict[str, float], list[float], float, bool]:
        """The one host sync of a logging window: the window's metric sums, every micro-step's loss, the token count
        and the stop flags, summed over processes in one reduce -> (sums, losses, tokens, stop requested somewhere).
        A loss that is not finite on any process is not finite in the sum."""
        acc = self.accelerator
        keys = sorted(window)
        flat = [window[k].double().reshape(1) for k in keys] + [x.detach().double().reshape(1) for x in losses]
        flat.append(torch.tensor([float(tokens), float(bool(self._stop))], dtype=torch.float64).to(acc.device))
        values = acc.reduce(torch.cat(flat), "sum").tolist()
        return dict(zip(keys, values)), values[len(keys):-2], values[-2], values[-1] > 0

    def _check_finite(self, losses: list[float], first_step: int) -> None:
        """Raise NonFiniteLoss at the first micro-step whose loss (summed over processes) is NaN/inf."""
        for i, value in enumerate(losses):
            if not math.isfinite(value):
                step, micro = first_step + i // self.config.batch.grad_accum, i % self.config.batch.grad_accum
                raise NonFiniteLoss(
                    f"loss is {value} at step {step} (micro-batch {micro}); stopped without saving. Last good "
                    f"checkpoint: {_newest(self.out)}. Try a lower optim.lr, precision=fp32 or a smaller "
                    "optim.grad_clip")

    # ---- the loop --------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Train to the end of the schedule; returns the final held-out metrics ({} if stopped by a signal)."""
        from tqdm.auto import tqdm

        acc, c = self.accelerator, self.config
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not acc.is_local_main_process,
                   desc="training", dynamic_ncols=True)
        sampler = StepSampler(self.stream, self.consumed, c.batch.size, self.world, acc.process_index,
                              c.batch.grad_accum, self.lengths)
        batches = train_batches(self.train_set, sampler, self.pad_id, loader_workers(c.data.loader_workers,
                                acc.device), pin_memory=acc.device.type == "cuda")
        window: dict[str, torch.Tensor] = {}  # metric sums on the device
        losses: list[torch.Tensor] = []  # every micro-step's loss since the last sync
        window_tokens, window_start, window_first = 0, time.perf_counter(), self.step + 1
        stopped = False
        with self._stop, contextlib.closing(bar):
            if c.logging.eval_every and self.step == 0:
                self.evaluate()  # the baseline of the held-out acceptance curve
            self.model.train()
            while self.step < self.total_steps:
                for _ in range(c.batch.grad_accum):
                    host = next(batches)
                    window_tokens += int(host["attention_mask"].sum())  # a host tensor: no device sync
                    batch = self._batch(host)
                    with acc.accumulate(self.model):
                        loss, metrics = self._forward(batch)
                        acc.backward(loss)
                        if acc.sync_gradients and c.optim.grad_clip > 0:
                            acc.clip_grad_norm_(self.model.parameters(), c.optim.grad_clip)
                        self.optimizer.step()
                        self.optimizer.zero_grad()
                    losses.append(loss.detach())
                    for k, v in metrics.items():
                        window[k] = window[k] + v if k in window else v.detach().clone()
                self.scheduler.step()
                self.step += 1
                self.consumed += self.global_batch
                bar.update(1)
                log_now = self.step % c.logging.every == 0 or self.step == self.total_steps
                save_now = self.step % c.checkpoint.every == 0
                eval_now = bool(c.logging.eval_every) and self.step % c.logging.eval_every == 0 and (
                    self.step < self.total_steps)
                # one process acts on a stop at once; several agree on it at their next sync
                if not (log_now or save_now or eval_now or (self.world == 1 and self._stop)):
                    continue
                sums, step_losses, tokens, stop = self._sync(window, losses, window_tokens)
                self._check_finite(step_losses, window_first)
                if log_now:
                    elapsed = time.perf_counter() - window_start
                    sums["loss"] = sum(step_losses) / c.batch.grad_accum
                    sums["steps"] = float(self.step - window_first + 1)
                    logs = self._log_window(sums, tokens, elapsed)
                    bar.set_postfix(loss=f"{logs['train/loss']:.4f}", tau=f"{logs['train/tau']:.2f}")
                    window, window_tokens, window_start, window_first = {}, 0, time.perf_counter(), self.step + 1
                    losses = []
                if eval_now:
                    self.evaluate()
                if save_now:
                    self.save()
                if stop:  # agreed by all ranks, so all save and leave together
                    stopped = True
                    break
        if stopped:
            if self.step % c.checkpoint.every:
                self.save()
            self.log(f"stopped at step {self.step}; resume with the same command (checkpoint.resume=auto)")
            return {}
        if self.step % c.checkpoint.every:
            self.save()
        self.check_replicas()
        result = self.evaluate()
        self.save_final()
        return result

    def _log_window(self, total: dict[str, float], tokens: float, elapsed: float) -> dict[str, float]:
        """Log a window's sums (already summed over processes; `loss` over micro-steps / grad_accum, `steps` the
        window's optimizer steps), append to metrics.jsonl."""
        acc = self.accelerator
        steps = max(total["steps"], 1.0)
        logs = {"train/loss": total["loss"] / (steps * self.world), "lr": self.scheduler.get_last_lr()[0],
                "tokens_per_s": tokens / max(elapsed, 1e-9), "peak_memory_mib": peak_memory_mib(acc.device)}
        logs.update({f"train/{k}": v for k, v in acceptance(total).items()})
        for k, v in total.items():
            if k.startswith("loss/"):
                count = total.get(k.replace("loss/", "count/"), total["count/step0"])
                logs[f"train/{k}"] = v / max(count, 1.0)
        self.tokens_seen += int(tokens)
        self._emit(logs)
        return logs

    def _emit(self, logs: dict[str, float]) -> None:
        acc = self.accelerator
        if self.config.logging.backend != "none":
            acc.log(logs, step=self.step)
        if acc.is_main_process:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": self.step, **logs}) + "\n")
            self.metrics_rows += 1

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out per-step top-1 acceptance and tau (see losses.acceptance); every rank runs the same
        number of batches so sharded models stay in lockstep."""
        acc, c = self.accelerator, self.config
        if len(self.held_out) == 0:
            return {}
        stream = ExampleStream(self.held_out, c.seed, shuffle=False)
        per_rank = max(1, min(c.logging.eval_batches, math.ceil(len(self.held_out) / c.batch.size)) // self.world)
        totals: dict[str, torch.Tensor] = {}  # metric sums on the device: one sync at the end
        self.model.eval()
        for b in range(per_rank):
            start = micro_batch_start(b * c.batch.size * self.world, 0, acc.process_index, c.batch.size, self.world)
            _, metrics = self._forward(self._batch(stream.rows(start % len(self.held_out), c.batch.size)))
            for k, v in metrics.items():
                totals[k] = totals[k] + v if k in totals else v.clone()
        self.model.train()
        keys = sorted(totals)
        sums = acc.reduce(torch.stack([totals[k].double() for k in keys]), "sum")
        result = {f"eval/{k}": v for k, v in acceptance(dict(zip(keys, sums.tolist()))).items()}
        self._emit(result)
        self.log(f"step {self.step}: held-out tau {result['eval/tau']:.3f}, acc "
                 + " ".join(f"{result[k]:.3f}" for k in sorted(result) if k.startswith("eval/acc/")))
        return result

    def check_replicas(self) -> None:
        """Unsharded ranks must end with identical head weights; a silent loss of gradient sync fails here."""
        acc = self.accelerator
        params = [p for p in self.model.parameters() if p.numel()]
        zero3 = acc.state.deepspeed_plugin is not None and acc.state.deepspeed_plugin.zero_stage == 3
        if self.world == 1 or zero3 or acc.distributed_type.name == "FSDP":
            return
        flat = torch.cat([p.detach().double().flatten() for p in params])
        probe = torch.rand(flat.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        digest = torch.stack([flat.sum(), flat.abs().sum(), (flat * probe.to(flat.device)).sum()])
        every = acc.gather(digest[None]).cpu()  # [world, 3]
        spread = (every - every[0]).abs().max().item()
        self._emit({"replica_max_diff": spread})
        if spread > 1e-6 * max(1.0, every[0].abs().max().item()):
            raise LaunchMismatch(f"the {self.world} ranks hold different head weights (digest spread {spread:.3g}): "
                                 "gradients were not synchronised; check the launch command")

    # ---- saving ----------------------------------------------------------------------------------
    def _head_state(self) -> dict[str, torch.Tensor] | None:
        """Full head weights on the main process, gathered from any sharding (collective)."""
        state = self.accelerator.get_state_dict(self.model)
        if not self.accelerator.is_main_process:
            return None
        return {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")}

    def save(self) -> Path:
        trainer_state = {"step": self.step, "consumed": self.consumed, "tokens_seen": self.tokens_seen,
                         "world_size": self.world, "total_steps": self.total_steps, "metrics_rows": self.metrics_rows}
        return checkpoint.save_checkpoint(self.accelerator, self.model, self._head_state(), self.head.config,
                                          trainer_state, self.out, self.config.checkpoint.keep)

    def save_final(self) -> None:
        state = self._head_state()
        if self.accelerator.is_main_process:
            checkpoint.write_head(state, self.head.config, self.out / "head", {"step": self.step})
            self.log(f"final head written to {self.out / 'head'}")
        self.accelerator.wait_for_everyone()

    def cleanup(self) -> None:
        self.accelerator.end_training()


def row_seed(run_seed: int, step: int, input_ids: torch.Tensor) -> int:
    """A seed from the run's seed, the step and a host row of token ids."""
    return zlib.crc32(input_ids.numpy().tobytes(), zlib.crc32(f"{run_seed}:{step}".encode()))


def _newest(output_dir: Path) -> str:
    found = checkpoint.list_checkpoints(output_dir)
    return str(found[-1]) if found else "none yet"


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v) if isinstance(v, (list, tuple)) or v is None else v
    return out


def run(config: RunConfig) -> dict[str, float]:
    """Train; the final held-out metrics, {} for a run stopped by a signal (it saved a checkpoint)."""
    return run_with_status(config)[0]


def run_with_status(config: RunConfig) -> tuple[dict[str, float], int]:
    """(final held-out metrics, exit status: 0, or 130/143 for a run stopped by SIGINT/SIGTERM)."""
    trainer = Trainer(config)
    try:
        return trainer.train(), trainer.exit_status
    finally:
        trainer.cleanup()
