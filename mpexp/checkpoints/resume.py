"""Resuming a run from its checkpoint: whether this config may continue it (the same experiment,
the same weights' dtype, the same data, steps left to train), and the run put back as it was at
the checkpoint. Resuming rewinds `metrics.jsonl` to that point, so the steps a killed run trained
after its last checkpoint are trained again, not logged twice; later checkpoints go too."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from mpexp.checkpoints import sharded
from mpexp.checkpoints.checkpoint import Position, restore_rng
from mpexp.checkpoints.files import elsewhere, find_checkpoint, load, remove_checkpoint
from mpexp.checkpoints.frozen import first_difference, frozen_names, load_trained
from mpexp.config import to_dict
from mpexp.errors import ResumeRefused
from mpexp.launch import is_rank_zero
from mpexp.rundir import (
    AUTO,
    check_not_locked,
    checkpoint_files,
    checkpoint_step,
    put_back_replaced,
    resume_command,
    run_dir_of,
)
from mpexp.targets import rewrite_targets, spans_run
from mpexp.tracking.records import flatten

log = logging.getLogger(__name__)

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
    "model.freeze": [],
    "model.frozen_dtype": "autocast",
    "model.lora.r": None,
    "model.lora.alpha": None,
    "model.lora.dropout": 0.0,
    "model.lora.target_modules": None,
    "model.lora.dtype": None,
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


CHANGES_NAMED = 4  # differences of the data a refused resume names; the rest are counted


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
        now = model.state_dict()
        saved = self.state["model"] = named_as(self.state["model"], now)
        frozen = frozen_names(model)
        if not frozen & saved.keys():  # its frozen weights are the model's as built
            now = {k: v for k, v in now.items() if k not in frozen}
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
                f"{elsewhere(self.path)}"
            )

    def check_frozen(self, now: dict | None) -> None:
        """Refuse a checkpoint whose run froze other weights than the model built now holds
        (`now`: their fingerprint, mpexp/checkpoints/frozen.py): the checkpoint does not hold
        them, so the resume would go on over other ones."""
        problem = first_difference(self.state.get("frozen"), now)
        if problem is not None:
            raise ResumeRefused(
                f"trainer.resume: {self.path} was trained over other frozen weights: {problem}. "
                "A checkpoint holds only the weights that train; the frozen ones are built again "
                "from the config, and these are not the run's (its pretrained weights changed on "
                "disk, or the model's initialisation does not repeat from trainer.seed). Put "
                "them back as they were, or start a new run."
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
            load_trained(model, named_as(self.state["model"], model.state_dict()))
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


def named_as(saved: dict, now: dict) -> dict:
    """The saved weights under the model's own names: a DDP run's checkpoint written before DDP
    wrapped the compiled model (mpexp/build.py) named each weight `module.<name>`, DDP's."""
    if saved.keys() == now.keys() or not all(k.startswith("module.") for k in saved):
        return saved
    return {k.removeprefix("module."): v for k, v in saved.items()}


def _shape(value) -> tuple | None:
    shape = getattr(value, "shape", None)  # a module's extra state need not be a tensor
    return None if shape is None else tuple(shape)


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
