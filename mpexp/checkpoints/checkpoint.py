"""Checkpoints: a run's complete training state, saved by the Checkpointer as the run asks (every
few steps, at an epoch's end, when stopped), the newest few and the best kept. The file on disk:
mpexp/checkpoints/files.py; resuming from it exactly: mpexp/checkpoints/resume.py.

A checkpoint holds everything that decides what the run does next: the model (its frozen weights
only by their fingerprint: mpexp/checkpoints/frozen.py), optimizer and
loss-scaler state (each scaler owns its `state_dict`: the scale and growth tracker, or a custom
strategy's state), every random number generator, the position in the data order (an epoch's
order is a function of the seed and the epoch, so the epoch and the batches done in it are enough)
and what the metric log needs to carry on: the running skip count, the epoch's losses so far and
how far `metrics.jsonl` had got.

Stop signals (SIGTERM from a cluster's pre-emption, Ctrl-C; mpexp/stopping.py) only set a flag;
the loop checks it once per step and stops at the step boundary with a checkpoint.
"""

from __future__ import annotations

import math
import random
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from mpexp.checkpoints import sharded
from mpexp.checkpoints.files import FORMAT, remove_checkpoint, write_atomically
from mpexp.checkpoints.frozen import trained_state
from mpexp.config import to_dict
from mpexp.errors import OutputError
from mpexp.rundir import (
    SUBDIR,
    best_validated,
    checkpoint_files,
    checkpoint_step,
    leftover_files,
    put_back_replaced,
    resume_command,
    validated_losses,
)
from mpexp.stopping import Preempted, stopped_again


@dataclass(frozen=True)
class Position:
    """Where training stands: `batch` batches of epoch `epoch` done, `step` steps in all."""

    epoch: int = 1
    batch: int = 0
    step: int = 0


def rng_state(device: torch.device) -> dict:
    """Every random number generator the run may draw from."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # plain numbers, so that checkpoints load with torch.load(weights_only=True)
        "numpy": [keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict, device: torch.device) -> None:
    """Put every generator back as `rng_state` found it."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class Checkpointer:
    """Saves one run's training state into `<run dir>/checkpoints`, keeping the newest few and
    the one with the lowest val/loss (what mpexp-sample samples from) beside them.

    A replicated run (one process, DDP) writes one file from rank 0; an FSDP run, whose ranks each
    hold a shard of the state, writes a folder from every rank (mpexp/checkpoints/sharded.py).
    """

    def __init__(
        self,
        cfg: DictConfig,
        overrides: list[str],
        world,
        model,
        optimizer,
        scaler,
        tracker,
        schedule=None,
        data_key: dict | None = None,
        frozen: dict | None = None,
    ):
        self.run_dir = Path(tracker.run_dir)
        self.directory = self.run_dir / SUBDIR
        self.keep = cfg.trainer.keep_checkpoints
        self.every_steps = cfg.trainer.checkpoint_every_steps
        self.upload = cfg.wandb.get("log_checkpoints", False)
        self.config = to_dict(cfg)
        self.overrides = [o for o in overrides if not o.startswith("trainer.resume=")]
        self.world, self.device = world, world.device
        self.sharded = world.strategy == "fsdp"
        self.model, self.optimizer = model, optimizer
        self.scaler, self.tracker, self.schedule = scaler, tracker, schedule
        self.data_key = data_key  # the data's resume_key(), checked by Resume.check_data
        self.frozen = frozen  # the frozen weights' fingerprint, checked by Resume.check_frozen
        self.best: tuple[float, Path] | None = None  # the lowest val/loss kept, and its file
        self.best_known = False  # whether `best` has read a resumed run's earlier validations

    def due(self, step: int) -> bool:
        """True when `trainer.checkpoint_every_steps` asks for a checkpoint after this step."""
        return self.every_steps is not None and step % self.every_steps == 0

    def save(self, position: Position, log_state: dict) -> Path | None:
        """Write a checkpoint at `position` (a step boundary) and drop the oldest beyond `keep`.

        Every rank calls it: an FSDP run's ranks all write their shards; otherwise rank 0 alone
        writes, and the other ranks, holding the same state, return None.
        """
        if not (self.sharded or self.world.is_main):
            return None
        name = f"step-{position.step:08d}"
        path = self.directory / (name if self.sharded else f"{name}.pt")
        try:
            state = {
                "format": FORMAT,
                "position": asdict(position),
                "world_size": self.world.size,
                # dataset.batch_size: the step's over all processes (mpexp/batches.py); a
                # checkpoint without this key was written when it was each process's
                "batch": "global",
                "scaler": self.scaler.state_dict(),
                "schedule": self.schedule.state_dict() if self.schedule is not None else None,
                "log": log_state,
                "metrics_bytes": self.tracker.flush(),
                "wandb_id": self.tracker.wandb_id,
                "config": self.config,
                "overrides": self.overrides,
                "data": self.data_key,
                "frozen": self.frozen,
            }
            if self.world.is_main:
                self.directory.mkdir(parents=True, exist_ok=True)
                # a crash's leftovers (half-written files, lone checksums) first: space a full
                # disk may need for this write
                put_back_replaced(self.run_dir)
                for stale in leftover_files(self.run_dir):
                    remove_checkpoint(stale)
            if self.sharded:
                state["sharded"] = True
                rng = rng_state(self.device)
                sharded.save(path, state, rng, self.model, self.optimizer, self.world.rank)
            else:
                state["model"] = trained_state(self.model)
                state["optimizer"] = self.optimizer.state_dict()
                state["rng"] = rng_state(self.device)
                write_atomically(state, path)
        except (OSError, RuntimeError) as err:  # torch.save reports a full disk as RuntimeError
            if stopped_again():  # a second Ctrl-C inside torch.save's writer, which it reports
                raise KeyboardInterrupt from err  # as a RuntimeError: out at once, as it asks
            raise OutputError(self._failure(path, err)) from err
        if not self.world.is_main:
            return path
        best = self._best(path, position.step, log_state)
        for old in checkpoint_files(self.run_dir)[: -self.keep]:
            if old != best:
                remove_checkpoint(old)
        if self.upload and not self.sharded:
            self.tracker.log_checkpoint(path, position.step)
        return path

    def _best(self, path: Path, step: int, log_state: dict) -> Path | None:
        """The checkpoint with the lowest val/loss so far, `path` included when the row logged
        just before it validated at its step. A resumed run's earlier ones are read once from
        metrics.jsonl, among the checkpoints still there."""
        if not self.best_known:
            self.best_known = True
            files = [p for p in checkpoint_files(self.run_dir) if p != path]
            losses = validated_losses(self.run_dir)
            if (found := best_validated(files, losses)) is not None:
                self.best = losses[checkpoint_step(found)], found
        row = log_state.get("epoch_row") or {}
        loss = row.get("val/loss")
        validated = row.get("step") == step and loss is not None and math.isfinite(loss)
        if validated and (self.best is None or loss < self.best[0]):
            self.best = loss, path
        return None if self.best is None else self.best[1]

    def _failure(self, path: Path, err: Exception) -> str:
        reason = getattr(err, "strerror", None) or str(err).strip().splitlines()[-1]
        previous = [p for p in checkpoint_files(self.run_dir) if p != path]
        if not previous:
            return (
                f"Could not write checkpoint {path}: {reason}. The run has no earlier checkpoint; "
                f"make {self.run_dir} writable (free space, fix permissions) and start it again."
            )
        return (
            f"Could not write checkpoint {path}: {reason}.\n"
            f"The previous checkpoint {previous[-1]} is intact. Free space (or fix permissions) "
            f"and continue with:\n  {resume_command(self.overrides, self.run_dir)}"
        )

    def stopped(self, signum: int, path: Path, position: Position, steps_per_epoch: int):
        """The exception that ends a run stopped by a signal, saying how to resume it."""
        return Preempted(
            signum,
            f"Stopped by {signal.Signals(signum).name} at step {position.step} (epoch "
            f"{position.epoch}, {position.batch} of {steps_per_epoch} batches done); checkpoint "
            f"written to {path}.\nResume with:\n  {resume_command(self.overrides, self.run_dir)}",
        )
