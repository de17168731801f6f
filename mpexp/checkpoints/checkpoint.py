"""Checkpoints: a run's complete training state, written atomically, and resuming from it exactly.

A checkpoint holds everything that decides what the run does next: the model, optimizer and
loss-scaler state (each scaler owns its `state_dict`: the scale and growth tracker, or a custom
strategy's state), every random number generator, the position in the data order (an epoch's
order is a function of the seed and the epoch, so the epoch and the batches done in it are enough)
and what the metric log needs to carry on: the running skip count, the epoch's losses so far and
how far `metrics.jsonl` had got. Resuming rewinds `metrics.jsonl` to that point, so the steps a
killed run trained after its last checkpoint are trained again, not logged twice.

Stop signals (SIGTERM from a cluster's pre-emption, Ctrl-C; mpexp/stopping.py) only set a flag;
the loop checks it once per step and stops at the step boundary with a checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import re
import shutil
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from mpexp.checkpoints import sharded
from mpexp.checkpoints.checksums import sha256_of
from mpexp.config import to_dict
from mpexp.errors import OutputError, ResumeRefused
from mpexp.launch import is_rank_zero
from mpexp.rundir import (
    AUTO,
    SUBDIR,
    best_validated,
    check_not_locked,
    checkpoint_files,
    checkpoint_step,
    leftover_files,
    put_back_replaced,
    resume_command,
    run_dir_of,
    validated_losses,
)
from mpexp.stopping import Preempted
from mpexp.targets import rewrite_targets, spans_run
from mpexp.tracking.records import flatten

log = logging.getLogger(__name__)

FORMAT = 1

# What may change when a run is resumed: how long it trains, how often it reports and checkpoints,
# the peak its MFU is measured against, how W&B connects, how many processes decode its data (the
# batches are the same with any number), where a text corpus's tokens are cached (a cache is
# checked against its source, wherever it lies). Any other change would make the resumed run a
# different experiment.
RESUMABLE_KEYS = frozenset(
    {
        "dataset.num_workers",
        "dataset.cache_dir",
        "trainer.resume",
        "trainer.epochs",
        "trainer.max_steps",
        "trainer.eval_every_steps",
        "trainer.progress",
        "trainer.log_every",
        "trainer.checkpoint_every_steps",
        "trainer.keep_checkpoints",
        "trainer.peak_tflops",
        "trainer.compute_only_steps",
        "wandb.mode",
        "wandb.init_timeout",
        "wandb.samples",
    }
)


# Keys that later versions of mpexp added, with the value that does what runs from before them
# did: a run checkpointed before a key existed resumes when the key has that value now
ADDED_KEYS = {
    "dataset.augment.crop_padding": 0,
    "dataset.augment.flip": False,
    "optimizer.decay_norms_and_biases": True,
    "trainer.max_steps": None,
    "trainer.eval_every_steps": None,
    "trainer.z_loss": 0.0,
    "trainer.label_smoothing": 0.0,
    "trainer.mixup_alpha": 0.0,
    "trainer.cutmix_alpha": 0.0,
    "trainer.ema_decay": None,
    "trainer.ema_every": 32,
    "trainer.ema_warmup_steps": 0,
    "model.zero_init_residual": False,
    "model.bias": True,
    "model.qk_norm": False,
    "precision.fp8.exclude": [],
    "precision.fp8.min_size": 0,
    "precision.weights": "float32",
    "precision.update_rounding": None,
    "precision.optimizer_states": None,
    "diagnostics.updates_lost": None,
}


# Keys that a run resolves from null to a value its data's resume key keeps (an image folder's
# normalisation, computed and logged): given back as logged, they change nothing, and
# Resume.check_data compares the value with the one the run used
RESOLVED_KEYS = {"dataset.mean": "mean", "dataset.std": "std"}


# what every checkpoint holds (Checkpointer.save), and what a single-file one adds to it
STATE_KEYS = ("position", "scaler", "schedule", "log", "metrics_bytes", "wandb_id", "config",
              "overrides")  # fmt: skip
FILE_KEYS = ("model", "optimizer", "rng")
POSITION = ("epoch", "batch", "step")
CHANGES_NAMED = 4  # differences of the data a refused resume names; the rest are counted


@dataclass(frozen=True)
class Position:
    """Where training stands: `batch` batches of epoch `epoch` done, `step` steps in all."""

    epoch: int = 1
    batch: int = 0
    step: int = 0


def checksum_file(checkpoint: Path) -> Path:
    """Where a checkpoint's SHA-256 is kept, in `sha256sum` format (`sha256sum -c` checks it).
    A kill while a checkpoint of the same name was replaced can leave it listing two sums, one of
    them the file's (write_atomically): `sha256sum -c` then calls the other one failed."""
    return checkpoint.with_name(checkpoint.name + ".sha256")


def write_atomically(state: dict, path: Path) -> None:
    """Write a temporary file, fsync it, rename it: `path` holds the old file or all of the new.

    Its SHA-256 is written beside it first, so that a resume can tell a damaged file. A checkpoint
    that replaces one of the same name (an epoch's end at a step that already has one) is
    renamed in while the checksum file lists both files' sums: whichever one a kill leaves in
    place is verified, not called corrupt. Whatever stops the write (a full disk, which
    torch.save reports as a RuntimeError; a second Ctrl-C), the partial files are removed.
    """
    tmp = path.with_name(path.name + ".tmp")
    sums, sums_tmp = checksum_file(path), checksum_file(tmp)
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        line = f"{sha256_of(tmp)}  {path.name}\n"
        # the old file's sum as written, or as it is where its checksum file is missing or bad
        old = (written_sums(sums) or [sha256_of(path)]) if path.is_file() else []
        replaced = "".join(f"{digest}  {path.name}\n" for digest in old)
        _write_synced(sums_tmp, replaced + line)
        os.replace(sums_tmp, sums)
        os.replace(tmp, path)
        if replaced:  # the old file is gone: its sum goes too, where the disk allows
            with contextlib.suppress(OSError):  # the two-sum file verifies the new file as well
                _write_synced(sums_tmp, line)
                os.replace(sums_tmp, sums)
    except BaseException:
        for partial in (tmp, sums_tmp):  # a partial file only takes space from a full disk
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
        raise
    # make the rename itself durable; some platforms cannot open a directory, which is harmless
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:  # on disk before the rename, or a crash leaves it empty
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def written_sums(sums: Path) -> list[str]:
    """The SHA-256 sums a checkpoint's checksum file holds (two while a checkpoint of the same
    name is being replaced); none where it is missing, empty or damaged."""
    try:
        lines = sums.read_text(errors="replace").splitlines()
    except OSError:
        return []
    found = (line.split()[:1] for line in lines)
    return [f[0] for f in found if f and re.fullmatch(r"[0-9a-f]{64}", f[0])]


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
                state["model"] = self.model.state_dict()
                state["optimizer"] = self.optimizer.state_dict()
                state["rng"] = rng_state(self.device)
                write_atomically(state, path)
        except (OSError, RuntimeError) as err:  # torch.save reports a full disk as RuntimeError
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


@dataclass
class Resume:
    """A checkpoint to continue a run from, checked against the run's config."""

    path: Path
    state: dict

    @property
    def run_dir(self) -> Path:
        return run_dir_of(self.path)

    @property
    def position(self) -> Position:
        return Position(**self.state["position"])

    @property
    def world_size(self) -> int:
        return self.state.get("world_size", 1)

    @property
    def wandb_id(self) -> str | None:
        return self.state["wandb_id"]

    @property
    def log_state(self) -> dict:
        return self.state["log"]

    def check_fits(self, model) -> None:
        """Refuse a checkpoint whose weights do not fit `model` (names and shapes), before the
        run changes anything; a sharded checkpoint is checked by torch.distributed.checkpoint as
        it loads."""
        if self.state.get("sharded"):
            return
        saved, now = self.state["model"], model.state_dict()
        odd = sorted(saved.keys() ^ now.keys())
        if odd:
            where = "the checkpoint" if odd[0] in saved else "the model"
            problem = f"{odd[0]} is only in {where} ({len(odd)} names differ)"
        else:
            shapes = ((k, _shape(saved[k]), _shape(now[k])) for k in now)
            problem = next(
                (f"{k} is {a} in the checkpoint, {b} in the model" for k, a, b in shapes if a != b),
                None,
            )
        if problem is not None:
            raise ResumeRefused(
                f"trainer.resume: {self.path} does not fit the run's model: {problem}.\n"
                f"{_other(self.path)}"
            )

    def check_data(self, now: dict | None) -> None:
        """Refuse a resume whose data is not what the checkpoint trained on (`now`: the data's
        resume_key), before the run changes anything; and one whose checkpoint keeps no key
        where the data now has one (written before mpexp kept it): nothing says that the data is
        the same, and an image folder's split by val_fraction has been drawn otherwise since."""
        saved = self.state.get("data")
        if saved == now:
            return
        if saved is None:
            raise ResumeRefused(
                f"trainer.resume: {self.path} was written by an mpexp that kept no record of the "
                "data it trained on, so a resume cannot check that the data is the same (an "
                "image folder's split is drawn per class since): start a new run."
            )
        now = now or {}
        # in the key's own order: what the data puts first says most
        keys = [*now, *(k for k in saved if k not in now)]
        differ = [k for k in keys if saved.get(k) != now.get(k)]
        changed = ", ".join(
            f"{key} {saved.get(key, 'absent')} then, {now.get(key, 'absent')} now"
            for key in differ[:CHANGES_NAMED]
        ) + (f" and {len(differ) - CHANGES_NAMED} more" if len(differ) > CHANGES_NAMED else "")
        raise ResumeRefused(
            f"trainer.resume: {self.path} was written while training on other data ({changed}): "
            "a resume would go on with other samples and validate on others. Put the data back "
            "as it was, or start a new run."
        )

    def rewind(self) -> None:
        """Forget what the run wrote after this checkpoint: later metrics rows and checkpoints."""
        metrics, size = self.run_dir / "metrics.jsonl", self.state["metrics_bytes"]
        if metrics.exists() and metrics.stat().st_size >= size:
            with metrics.open("r+b") as f:
                f.truncate(size)
        else:  # never pad: truncate() past the end would fill the file with zero bytes
            log.warning("%s is shorter than at the checkpoint: earlier rows are missing.", metrics)
        later = [
            p for p in checkpoint_files(self.run_dir) if checkpoint_step(p) > self.position.step
        ]
        if later:
            log.warning(
                "Resuming from step %d: removing the later checkpoints %s, which this run redoes.",
                self.position.step,
                ", ".join(p.name for p in later),
            )
            for path in later:
                remove_checkpoint(path)

    def restore(self, model, optimizer, scaler, world, schedule=None) -> Position:
        """Load the saved state into freshly built objects and the RNGs; return the position.

        A sharded (FSDP) checkpoint loads on any number of ranks: its weights and optimizer state
        are resharded; each rank's random generators come back when the number of ranks is the
        same, and otherwise start from the seed (which the run says).
        """
        if self.state.get("sharded"):
            sharded.load_into(self.path, model, optimizer)
            rng = sharded.load_rng(self.path, world.rank)
        else:
            model.load_state_dict(self.state["model"])
            optimizer.load_state_dict(self.state["optimizer"])
            rng = self.state["rng"]
        scaler.load_state_dict(self.state["scaler"])
        if schedule is not None:
            schedule.load_state_dict(self.state["schedule"])
        if world.size != self.world_size:
            if world.is_main:
                log.warning(
                    "Resuming a run of %d processes on %d: the weights and optimizer state are "
                    "the same%s, the data continues from the same sample, but each process's "
                    "random generators start from the seed, so the run will not repeat an "
                    "uninterrupted one exactly.",
                    self.world_size,
                    world.size,
                    " (resharded)" if self.state.get("sharded") else "",
                )
        elif rng is not None:
            restore_rng(rng, world.device)
            if "optimizer" in rng:  # a sharded checkpoint's per-rank optimizer state
                optimizer.load_rank_state(rng["optimizer"])
        # the same on any number of ranks: a step takes the next dataset.batch_size samples of
        # the epoch's order, which the ranks share (rank r every world_size-th of them)
        return self.position


def _shape(value) -> tuple | None:
    shape = getattr(value, "shape", None)  # a module's extra state need not be a tensor
    return None if shape is None else tuple(shape)


def remove_checkpoint(path: Path) -> None:
    """A checkpoint with its checksum, or a leftover of one (mpexp.rundir.leftover_files)."""
    if path.is_dir():
        shutil.rmtree(path)
        return
    path.unlink()
    if path.suffix != ".sha256":
        checksum_file(path).unlink(missing_ok=True)


def find_checkpoint(target: str | Path) -> Path:
    """The checkpoint `trainer.resume` names: that file, or the newest one in a run directory."""
    path = Path(str(target))
    if path.is_file() or (path.is_dir() and (path / sharded.COMMON).is_file()):
        return path
    if path.is_dir():
        put_back_replaced(path)
    found = checkpoint_files(path) if path.is_dir() else []
    if not found:
        where = (
            f"no checkpoint in {path / SUBDIR}" if path.is_dir() else "no such file or directory"
        )
        raise ResumeRefused(
            f"trainer.resume={target}: {where}.\nGive a run directory (the one holding "
            f"metrics.jsonl) or a checkpoint file in its {SUBDIR}/ folder."
        )
    return found[-1]


def load(path: Path, mmap: bool = False) -> dict:
    """A checkpoint's state on the CPU, its checksum verified and its parts all there; a damaged
    or incomplete one is refused."""
    verify(path)
    try:
        if path.is_dir():
            state = sharded.load_common(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:
        raise ResumeRefused(
            f"trainer.resume: {path} cannot be read as a checkpoint ({err}).\n{_other(path)}"
        ) from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ResumeRefused(f"trainer.resume: {path} is not an mpexp checkpoint (format {FORMAT}).")
    parts = STATE_KEYS if state.get("sharded") else (*STATE_KEYS, *FILE_KEYS)
    missing = [key for key in parts if key not in state]
    position = state.get("position")
    if not missing and not (isinstance(position, dict) and position.keys() == {*POSITION}):
        missing = [f"a whole position ({', '.join(POSITION)})"]
    if missing:
        what = ", ".join(missing)
        raise ResumeRefused(
            f"trainer.resume: {path} is not a complete mpexp checkpoint: it lacks {what}.\n"
            f"{_other(path)}"
        )
    return state


def verify(path: Path) -> None:
    """Compare a checkpoint with the SHA-256 written beside it; a checkpoint without one (written
    by an older mpexp) is taken as it is. A sharded checkpoint's folder lists every file's."""
    if path.is_dir():
        bad = sharded.corrupt_files(path)
        if bad:
            raise ResumeRefused(
                f"trainer.resume: {path} is corrupt: {', '.join(bad)} no longer match the "
                f"checksums written with them ({sharded.SUMS}).\n{_other(path)}"
            )
        return
    sums = checksum_file(path)
    if not sums.is_file():
        log.warning("%s has no checksum beside it (%s): it is not verified.", path, sums.name)
        return
    expected = written_sums(sums)
    if not expected:
        # e.g. empty after a power loss: the checkpoint is loaded and checked as one without
        log.warning(
            "%s holds no SHA-256 (it is empty or damaged): %s is not verified.", sums.name, path
        )
        return
    if sha256_of(path) not in expected:
        raise ResumeRefused(
            f"trainer.resume: {path} is corrupt: its SHA-256 does not match the one written with "
            f"it ({sums.name}), so the file changed after it was saved.\n{_other(path)}"
        )


def _other(path: Path) -> str:
    """Where else a resume could start from: only a checkpoint that exists is suggested."""
    others = [p for p in checkpoint_files(run_dir_of(path)) if p != path]
    if others:
        return f"Resume from an earlier checkpoint instead: trainer.resume={others[-1]}"
    return (
        "The run keeps no other checkpoint (trainer.keep_checkpoints), so it has to start again; "
        "a higher trainer.keep_checkpoints keeps a spare."
    )


def check_batch_meaning(state: dict, path: Path) -> None:
    """Refuse a run of several processes saved when dataset.batch_size was each process's: the
    same config now trains a step of 1/N of the batch it did, with no other sign of it."""
    n = state.get("world_size", 1)
    if n == 1 or state.get("batch") == "global":
        return
    batch = state["config"]["dataset"]["batch_size"]
    raise ResumeRefused(
        f"trainer.resume: {path} was saved by a run of {n} processes when dataset.batch_size "
        f"was each process's batch ({n} x {batch} = {n * batch} samples a step); it is now the "
        f"step's over all processes, so the same config would continue with {batch} a step. "
        f"Start the run again with dataset.batch_size={n * batch} (its learning rate as it was)."
    )


def check_not_finished(state: dict, cfg: DictConfig, target: str | Path) -> None:
    """Refuse a resume that has nothing left to train, saying how to train on."""
    if cfg.trainer.max_steps is not None:
        _check_steps_left(state, cfg, target)
        return
    done = Position(**state["position"]).epoch - 1  # epochs completed at the checkpoint
    wanted = cfg.trainer.epochs
    if done < wanted:
        return
    planned = state["config"]["trainer"]["epochs"]
    longer = (
        f"give more epochs: trainer.epochs={done + max(1, planned)}"
        if not spans_run(state["config"]["scheduler"].get("_target_"))
        else "start a new, longer run: its learning-rate schedule spans the run's length"
    )
    what = (
        f"already trained all its {done} epochs"
        if wanted == done
        else f"has trained {done} epochs, more than trainer.epochs={wanted} asks for"
    )
    raise ResumeRefused(
        f"trainer.resume={target}: the run {what}; there is nothing to resume and nothing was "
        f"changed. To train on, {longer}."
    )


def _check_steps_left(state: dict, cfg: DictConfig, target: str | Path) -> None:
    """`check_not_finished` for a run measured in steps (trainer.max_steps)."""
    done, wanted = Position(**state["position"]).step, cfg.trainer.max_steps
    if done < wanted:
        return
    longer = (
        f"give more steps: trainer.max_steps={2 * done}"
        if not spans_run(state["config"]["scheduler"].get("_target_"))
        else "start a new, longer run: its learning-rate schedule spans the run's length"
    )
    raise ResumeRefused(
        f"trainer.resume={target}: the run has taken {done} steps, and trainer.max_steps="
        f"{wanted} asks for no more; there is nothing to resume and nothing was changed. To "
        f"train on, {longer}."
    )


def check_weights(state: dict, cfg: DictConfig, target: str | Path) -> None:
    """Refuse to resume a run's weights in another dtype (pure bf16 against fp32 master weights):
    converting them would change the experiment from that step on, silently in one direction
    (fp32 to bf16 rounds every weight) and pointlessly in the other."""
    saved = state["config"]["precision"].get("weights", "float32")
    now = str(cfg.precision.get("weights", "float32"))
    if saved != now:
        asked = "precision=bf16_pure" if now == "bfloat16" else "float32 master weights"
        raise ResumeRefused(
            f"trainer.resume={target}: the run was written with {saved} weights, this config asks "
            f"for {now} ({asked}); a checkpoint is not converted between the two: resume it with "
            "the run's own precision, or start a new run."
        )


def check_config(state: dict, cfg: DictConfig, target: str | Path) -> None:
    """Refuse to resume under a config that would make the result a different experiment."""
    saved = flatten(state["config"], sep=".")
    now = flatten(to_dict(cfg), sep=".")
    missing = object()
    for key, before in ADDED_KEYS.items():
        if key not in saved and now.get(key, missing) == before:
            saved[key] = before  # the run predates the key and did what its value does
    data = state.get("data") or {}
    for key, kept in RESOLVED_KEYS.items():
        if saved.get(key, missing) is None and kept in data and key in now:
            saved[key] = now[key]  # for Resume.check_data to compare with what the run used
    changed = sorted(
        key
        for key in saved.keys() | now.keys()
        if key not in RESUMABLE_KEYS and saved.get(key, missing) != now.get(key, missing)
    )
    length = ("trainer.epochs", "trainer.max_steps")
    if not changed and spans_run(saved.get("scheduler._target_")):
        # e.g. a cosine schedule spans the whole run: more epochs would bend the curve mid-run
        changed = [k for k in length if saved.get(k, missing) != now.get(k, missing)]
    if not changed:
        return

    def show(values: dict, key: str) -> str:
        return repr(values[key]) if key in values else "absent"

    lines = [f"  {k}: {show(saved, k)} in the run, {show(now, k)} now" for k in changed[:8]]
    if len(changed) > 8:
        lines.append(f"  ... and {len(changed) - 8} more")
    may_change = ", ".join(sorted(RESUMABLE_KEYS - {"trainer.resume"}))
    raise ResumeRefused(
        f"trainer.resume={target}: this config differs from the run's, so training on would not "
        "continue that run:\n" + "\n".join(lines) + "\nResume with the run's own overrides:\n  "
        f"{resume_command(state['overrides'], target)}\n(only {may_change} may change on resume)"
    )


def open_resume(cfg: DictConfig, run_dir: Path | None = None, mmap: bool = False) -> Resume | None:
    """The checkpoint `trainer.resume` names, loaded and checked; None for a new run.

    `trainer.resume=auto` takes the newest checkpoint in `run_dir` (the run's own directory), or
    starts a new run when there is none: what a requeued cluster job needs.
    """
    target = cfg.trainer.resume
    if not target:
        return None
    if target == AUTO:
        if run_dir is not None:
            put_back_replaced(run_dir)
        found = checkpoint_files(run_dir) if run_dir is not None else []
        if not found:
            log.info("trainer.resume=auto: no checkpoint in %s, so the run starts afresh.", run_dir)
            return None
        target = found[-1]
    path = find_checkpoint(target)
    if is_rank_zero():  # ranks > 0 follow rank 0, which holds the lock
        # A live run in the folder is refused before its checkpoints are read: it may be
        # replacing one of them, which would read as missing or corrupt.
        check_not_locked(run_dir_of(path))
    state = load(path, mmap=mmap)
    rewrite_targets(state["config"])  # saved before a module moved: compared by today's paths
    check_weights(state, cfg, target)
    check_config(state, cfg, target)
    check_batch_meaning(state, path)
    check_not_finished(state, cfg, target)
    return Resume(path, state)
