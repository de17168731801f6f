"""A Hydra callback that writes the sweep report when a multirun ends and prints its path.

Registered under `hydra.callbacks` in conf/train.yaml; drop it for one sweep with
`~hydra.callbacks.sweep_report`.
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from mpexp.errors import UserError
from mpexp.report.runs import find_run_dirs
from mpexp.report.wandb_view_process import TIMEOUT


class SweepReport(Callback):
    """`mpexp-report <sweep dir>`, run by Hydra at the end of every multirun."""

    def __init__(
        self,
        tolerance: float | None = None,
        wandb_mode: str = "auto",
        target: float | None = None,
        target_acc: float | None = None,
        view_timeout: float = TIMEOUT,
    ):
        """`tolerance`, `target` and `view_timeout` as mpexp-report's options (None: the task's
        own tolerance, the reference's result); `target_acc` is `target`'s name in configs from
        before tasks."""
        self.tolerance = tolerance
        self.wandb_mode = wandb_mode
        self.target = target if target is not None else target_acc
        self.view_timeout = view_timeout
        self.sweep_dir: Path | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra's sweeper re-raises a failed job's error after the batch and never calls
        # on_multirun_end; a sweep with a failed run is when the report matters most, so it is
        # also written at interpreter exit unless on_multirun_end got there first.
        self.sweep_dir = Path(config.hydra.sweep.dir)
        atexit.register(self._write_if_any_job_ran)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        atexit.unregister(self._write_if_any_job_ran)
        self.write()

    def _write_if_any_job_ran(self) -> None:
        try:
            find_run_dirs([self.sweep_dir])
        except UserError:
            return  # the sweep stopped before its first job (a bad override): nothing to report
        self.write()

    def write(self) -> None:
        from mpexp.report.cli import make_report  # plotting imports only when a sweep ends

        try:
            make_report(
                [self.sweep_dir],
                self.tolerance,
                wandb_mode=self.wandb_mode,
                target=self.target,
                view_timeout=self.view_timeout,
            )
        except UserError as err:
            print(f"No sweep report: {err}")
