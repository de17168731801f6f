"""Where metrics go: `metrics.jsonl` and `summary.json` in the run dir always, W&B when enabled.

Metric names are a contract read by dashboards and the report:
  per step   step, train/loss, amp/scale (the scale the step used), amp/skipped_steps
             (cumulative), lr; with trainer.on_nonfinite_loss=skip also amp/nonfinite_loss_steps
             (cumulative)
  per epoch  epoch, train/epoch_loss, val/loss, val/acc (val/acc5 with 5 classes or more;
             val_ema/... with trainer.ema_decay), perf/epoch_time_s, perf/samples_per_s
             (samples actually trained on: a last partial batch counts its size), perf/tflops,
             mem/peak_allocated_mib and mem/peak_reserved_mib (CUDA) or mem/peak_rss_mib
             (CPU); perf/mfu where the device's peak is known (mpexp/step/flops.py);
             perf/data_wait_s and perf/data_wait_share (the time the step waited for its
             batches, a GPU's idle time between steps, and that over the epoch's time:
             mpexp/step/data_wait.py)
  at the end  test/loss, test/acc (the task's validation metrics on a held-out test set, where the
             data has one: an image folder's test/), once, in a row with `step` and in the summary;
             perf/compute_only_samples_per_s likewise, with trainer.compute_only_steps
  diagnostics  diag/... rows keyed by step, only when enabled (see mpexp/step/diagnostics.py); they
             share `step` with the step rows, so readers tell rows apart by their other keys
  summary    the final epoch's metrics, amp/skipped_steps, and under `ran` what ran, with
             final_scale: the scale after the last update, the one a next step would use;
             summary.json also keeps the run's `config` and command-line `overrides`. In W&B,
             `ran` is the run's config (not its summary), and the task's validation metrics are
             summarised as their best epoch's (`.max`, `.min`) and their last (`.last`)
  yours      `mpexp.log(values)` from the user's own code: `step` and the values, plotted in W&B
             against `step`; never under mpexp's own names above (OWN_PREFIXES, OWN_KEYS). Tensor
             values wait on their device and are read with the loop's own, once per log interval;
             nested dicts are flattened, a value that cannot be logged is dropped with a warning
metrics.jsonl deleted (or replaced) while the run trains is written again, whole, from the file the
tracker holds open. W&B is optional at every point: if it cannot start or stops accepting data,
training goes on with the local files and one warning.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mpexp.tasks.base import Task
from mpexp.tracking.histogram import Histogram
from mpexp.tracking.metrics_file import MetricsFile
from mpexp.tracking.records import flatten, write_json_atomically
from mpexp.tracking.run_context import RunContext
from mpexp.tracking.user_logs import UserRows, take_user_logs
from mpexp.tracking.validations import Validations
from mpexp.tracking.wandb_process import LogLines, WandbProcess
from mpexp.tracking.wandb_setup import WandbSetup

log = logging.getLogger(__name__)


class Tracker:
    """One run's metric sink.

    W&B runs in a process of its own (mpexp/tracking/wandb_process.py), started with the tracker:
    its import and start, a second or more of work, use another core while this process builds the
    optimizer and begins training. Rows go to it through a queue, in order, whether or not it has
    started; only the end of the run waits for it.

    The tracker starts before the run knows everything that ran (the optimizer's path, the
    scaler's settings): `record_ran` adds that to summary.json and to the W&B run's config once
    it is known.
    """

    def __init__(
        self,
        run: RunContext,
        config: dict,
        wandb_cfg: Any,
        task: Task | type[Task],
    ):
        """`task` (mpexp/tasks/) says which validation metrics W&B summarises and which one is
        the run's result, whose best epoch earns a checkpoint the `best` alias."""
        # W&B summarises these as the best epoch's and the last: the report and Optuna's sweeper
        # use the last (the run's result), a dashboard's "best" the other
        self._summaries = dict(task.summaries)
        self.run_dir = Path(run.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = MetricsFile(self.run_dir / "metrics.jsonl")
        # wall-clock start and end: the report warns when a sweep's jobs overlapped in time. The
        # config and overrides that ran, written by the process that writes the metrics: the
        # report reads them here, not from `.hydra/`, which another process could have rewritten
        self._summary: dict[str, Any] = {
            "status": "running",
            "started_at": _now(),
            "config": config,
            "overrides": list(run.overrides),
        }
        self._write_summary()
        self._wandb_setup = WandbSetup(run, wandb_cfg, self.run_dir)
        self.wandb_mode = self._wandb_setup.mode
        self._wandb: WandbProcess | None = None
        self._log_lines: LogLines | None = None
        self._logged = False  # any metrics row yet
        self.step = 0  # the step being trained, set by the loop: where `mpexp.log` logs
        self._user_rows = UserRows()
        # a resumed run's earlier epochs count towards the `best` checkpoint
        self._validations = Validations.read(self.run_dir / "metrics.jsonl", task.result)
        if self.wandb_mode != "disabled":
            try:
                self._wandb = WandbProcess(
                    self._wandb_setup.start(config, self._summaries),
                    self.run_dir / "wandb" / "process.log",
                    self._wandb_setup.problem,
                )
            except OSError as err:  # no process to be had: W&B must never stop a training run
                self._wandb_setup.problem("failed", f"its process did not start: {err}")
            else:
                self._log_lines = LogLines(self._wandb)
                logging.getLogger().addHandler(self._log_lines)
        take_user_logs(self)

    @property
    def wandb_id(self) -> str | None:
        """The W&B run's id (None with W&B disabled), known before W&B has started; a resume
        continues that run, or creates it if W&B never got to."""
        return self._wandb_setup.id

    def record_ran(self, ran: dict[str, Any]) -> None:
        """What ran (device, dtypes, TF32, scaler, optimizer path): into summary.json, and into
        the W&B run's config and tags."""
        self._summary["ran"] = ran
        self._write_summary()
        if self._wandb is not None:
            self._wandb.send("config", {"ran": ran})
            self._wandb.send("tags", self._wandb_setup.tags(ran))

    def flush(self) -> int:
        """Push metrics.jsonl to disk, with the user's rows still held; return its size in bytes
        (a checkpoint's place in it)."""
        self._write_waiting()
        return self._metrics.flush()

    def log_checkpoint(self, path: Path, step: int) -> None:
        """Upload a checkpoint as a W&B artifact of the run (wandb.log_checkpoints=true), with
        aliases `latest`, `step-<N>` and, on the epoch with the best result so far (the task's
        result metric: val/acc, val/loss), `best`; its metadata holds the step, the precision and,
        at an epoch's end, the epoch and its val metrics."""
        if self._wandb is None:
            return
        metadata = {"step": step, "precision": self._summary.get("ran", {}).get("precision")}
        aliases = ["latest", f"step-{step}"]
        epoch = self._validations.last
        if epoch is not None and epoch["step"] == step:  # the weights that epoch validated
            metadata.update(epoch["metrics"])
            aliases += ["best"] if epoch["best"] else []
        self._wandb.send_and_wait("artifact", (str(path), metadata, aliases))

    def log(self, row: dict[str, Any]) -> None:
        """One metrics row (it must hold `step` or `epoch`)."""
        self._metrics.write(row)
        self._logged = True
        self._validations.add(row)
        if self._wandb is not None:
            histograms = {
                k: (v.counts, v.edges) for k, v in row.items() if isinstance(v, Histogram)
            }
            # a copy: the row is written out later, on another thread
            plain = {k: v for k, v in row.items() if k not in histograms}
            self._wandb.send("log", (plain, histograms))

    def log_own(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """`mpexp.log`: the user's values as a row at `step` (default: the step being trained).

        A row holding tensors is not read here: it waits, with every row logged after it (so that
        rows stay in call order), for the loop to read its tensors with the step's own values.
        """
        row = self._user_rows.row(values, self.step if step is None else step)
        if row is None:
            return
        new = self._user_rows.new_keys(row)
        if new and self._wandb is not None:  # W&B plots them against `step`, as the step rows
            self._wandb.send("metrics", [(key, {"step_metric": "step"}) for key in new])
        if not self._user_rows.hold(row):
            self.log(row)

    def take_waiting(self) -> list[dict[str, Any]]:
        """The user's rows held since the last call, in call order, their tensors still on the
        device: the loop reads them with its own values and logs them (mpexp/step/readback.py)."""
        return self._user_rows.take_waiting()

    def _write_waiting(self) -> None:
        """Write the user's rows still held: at a checkpoint and at the end."""
        for row in self._user_rows.read_waiting():
            self.log(row)

    def log_samples(self, samples: list[tuple[str, str]]) -> None:
        """A language model's sampled texts, (how, text) each: `samples.txt` in the run dir and a
        W&B table `samples`."""
        text = "".join(f"--- {how}\n{sample}\n" for how, sample in samples)
        (self.run_dir / "samples.txt").write_text(text, encoding="utf-8")
        if self._wandb is not None:
            self._wandb.send(
                "table", ("samples", ["checkpoint", "text"], [list(s) for s in samples])
            )

    def update_summary(self, values: dict[str, Any]) -> None:
        self._summary.update(values)
        self._write_summary()
        if self._wandb is not None:
            if "ran" in values:  # what ran is the run's config in W&B, kept in one place there
                self._wandb.send("config", {"ran": values["ran"]})
            results = {k: v for k, v in values.items() if k != "ran"}
            flat = {k: v for k, v in flatten(results).items() if k not in self._summaries}
            self._wandb.send("summary", flat)

    def close(self, status: str = "finished", error: str | None = None) -> None:
        take_user_logs(None, self)
        try:
            self._write_waiting()
            ended = {"status": status, "ended_at": _now(), **({"error": error} if error else {})}
            self.update_summary(ended)
        finally:  # even when summary.json cannot be written (a full disk)
            self._metrics.close()
            if self._wandb is not None:
                logging.getLogger().removeHandler(self._log_lines)
                # a run that ended before it logged a row (a stop signal, an error while it was
                # built) does not wait for W&B to start and finish: its process does that alone
                exit_code = 0 if status == "finished" else 1
                where = self._wandb.finish(exit_code, wait=self._logged)
                self._wandb = None
                if where is not None:
                    self._record_wandb_run()
                if where is not None and self._wandb_setup.announce_sync:
                    log.info(
                        "W&B run kept offline in %s; upload it with `wandb sync %s`", where, where
                    )

    def _record_wandb_run(self) -> None:
        """Where the W&B run is, for the report to log into the same project and group."""
        self._summary["wandb"] = self._wandb_setup.record()
        try:
            self._write_summary()
        except OSError as err:
            log.warning("Could not record the W&B run in %s (%s).", self.run_dir, err)

    def _write_summary(self) -> None:
        write_json_atomically(self._summary, self.run_dir / "summary.json")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")
