"""A training run's W&B run as its tracker sets it up: its mode and id, the axes and tags it starts
with, what is said when it does not start, and where summary.json records it."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from mpexp.tracking.run_context import RunContext
from mpexp.tracking.wandb_mode import new_wandb_id, resolve_wandb_mode

log = logging.getLogger(__name__)

STEP_METRICS = ("train/loss", "amp/*", "opt/*", "lr", "diag/*")
EPOCH_METRICS = ("train/epoch_loss", "val/*", "perf/*", "mem/*")
JOB_TYPE = "train"  # a training run's W&B job_type; the sweep report's run is `report`


def wandb_tags(
    ran: dict[str, Any] | None, choices: dict[str, str | None], extra: list[str]
) -> list[str]:
    """What a run is, as W&B tags to filter by: precision, loss scaling (what ran, `auto`
    resolved; once known), model, dataset and experiment, then the user's `wandb.tags`."""
    tags = []
    if ran is not None:
        tags += [f"precision={ran['precision']}", f"loss_scaling={ran['loss_scaling']}"]
    tags += [f"{group}={choices[group]}" for group in ("model", "dataset", "experiment")
             if choices.get(group)]  # fmt: skip
    return [*tags, *(t for t in extra if t not in tags)]


class WandbSetup:
    """The W&B run's mode, id, start and tags, decided before it starts; the tracker sends it the
    rest through its WandbProcess."""

    def __init__(self, run: RunContext, wandb_cfg: Any, run_dir: Path) -> None:
        self._run, self._wandb_cfg, self._run_dir = run, wandb_cfg, run_dir
        self.init_timeout = wandb_cfg.get("init_timeout", 90)  # a config from Python may lack it
        self.mode = resolve_wandb_mode(wandb_cfg.mode)
        self.announce_sync = self.mode == "offline" and not run.in_sweep
        # chosen here, not by W&B: a checkpoint records the id at once, without waiting for a
        # start that an unreachable server can stretch to wandb.init_timeout
        self.id = None if self.mode == "disabled" else run.wandb_id or new_wandb_id()

    def start(self, config: dict, summaries: dict[str, Any]) -> dict[str, Any]:
        """What the W&B process needs to start the run (wandb_process.py's `init`), its
        validation metrics summarised as `summaries` says."""
        run, wandb_cfg = self._run, self._wandb_cfg
        # a run that validates every N steps plots its validations against steps, as its losses
        trainer = config.get("trainer", {})
        by_steps = trainer.get("eval_every_steps") or trainer.get("max_steps")
        axis = "step" if by_steps else "epoch"
        metrics = [("step", {}), ("epoch", {}), ("samples", {}), ("tokens", {})]
        metrics += [(pattern, {"step_metric": "step"}) for pattern in STEP_METRICS]
        metrics += [(pattern, {"step_metric": axis}) for pattern in EPOCH_METRICS]
        metrics += [(name, {"step_metric": axis, "summary": kinds})
                    for name, kinds in summaries.items()]  # fmt: skip
        return {
            "init": {
                "project": wandb_cfg.project,
                "entity": wandb_cfg.entity,
                "group": run.group,
                "name": run.name,
                "job_type": JOB_TYPE,
                "tags": wandb_tags(None, run.choices, list(run.tags)),
                "config": config,
                "dir": str(self._run_dir),
                "mode": self.mode,
                "id": self.id,
                "resume": "allow" if run.wandb_id else None,
            },
            "settings": {
                "init_timeout": self.init_timeout,
                "silent": True,  # W&B's own console lines are quiet; mpexp says where the run is
                "x_stats_pid": os.getpid(),  # system metrics of this process, not W&B's
                "program": sys.argv[0],
            },
            "argv": list(sys.argv),
            "metrics": metrics,
        }

    def problem(self, kind: str, text: str) -> None:
        """From the W&B process's reader thread: W&B did not start, or did not take something."""
        if kind != "failed":
            log.warning("%s", text)
            return
        hint = ""
        if "init_timeout" in text:  # W&B's hint names its own setting, not mpexp's key
            now = self.init_timeout
            hint = f" Give it longer: wandb.init_timeout=<seconds> (now {now:g})."
        said = text.splitlines()[0]
        log.warning("W&B could not start; logging to %s only.%s (%s)", self._run_dir, hint, said)

    def tags(self, ran: dict[str, Any]) -> list[str]:
        """The run's tags once what ran is known."""
        return wandb_tags(ran, self._run.choices, list(self._run.tags))

    def record(self) -> dict[str, Any]:
        """Where the W&B run is, for the report to log into the same project and group."""
        return {
            "mode": self.mode,
            "project": self._wandb_cfg.project,
            "entity": self._wandb_cfg.entity,
            "group": self._run.group,
            "id": self.id,
        }
