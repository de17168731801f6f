"""Where metrics go: `metrics.jsonl` and `summary.json` in the run dir always, W&B when enabled.

Metric names are a contract read by dashboards and the report:
  per step   step, train/loss, amp/scale (the scale the step used), amp/skipped_steps
             (cumulative), lr; with trainer.on_nonfinite_loss=skip also amp/nonfinite_loss_steps
             (cumulative)
  per epoch  epoch, train/epoch_loss, val/loss, val/acc, perf/epoch_time_s, perf/samples_per_s
             (samples actually trained on: a last partial batch counts its size), perf/tflops,
             mem/peak_allocated_mib (CUDA) or mem/peak_rss_mib (CPU); perf/mfu where the device's
             peak is known (mpexp/step/flops.py)
  diagnostics  diag/... rows keyed by step, only when enabled (see mpexp/step/diagnostics.py); they
             share `step` with the step rows, so readers tell rows apart by their other keys
  summary    the final epoch's metrics, amp/skipped_steps, and under `ran` what ran, with
             final_scale: the scale after the last update, the one a next step would use;
             summary.json also keeps the run's `config` and command-line `overrides`. In W&B,
             `ran` is the run's config (not its summary), and val/acc and val/loss are summarised
             as their best epoch's (`.max`, `.min`) and their last (`.last`)
  yours      `mpexp.log(values)` from the user's own code: `step` and the values, plotted in W&B
             against `step`
metrics.jsonl deleted (or replaced) while the run trains is written again, whole, from the file the
tracker holds open. W&B is optional at every point: if it cannot start or stops accepting data,
training goes on with the local files and one warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mpexp.tracking.records import write_json_atomically
from mpexp.tracking.wandb_mode import new_wandb_id, resolve_wandb_mode
from mpexp.tracking.wandb_process import LogLines, WandbProcess

log = logging.getLogger(__name__)

STEP_METRICS = ("train/loss", "amp/*", "lr", "diag/*")
EPOCH_METRICS = ("train/epoch_loss", "val/*", "perf/*", "mem/*")
# W&B summarises these as the best epoch's and the last: the report and Optuna's sweeper use the
# last (the run's result), a dashboard's "best" the other
SUMMARIES = {"val/acc": "max,last", "val/loss": "min,last"}
JOB_TYPE = "train"  # a training run's W&B job_type; the sweep report's run is `report`
CHECK_FILE_EVERY_S = 1.0  # how often logging rows looks whether metrics.jsonl is still there


@dataclass(frozen=True)
class Histogram:
    """Counts over bins (len(edges) == len(counts) + 1): a W&B histogram in W&B, and
    {"edges": [...], "counts": [...]} in metrics.jsonl."""

    counts: list[float]
    edges: list[float]


@dataclass
class RunContext:
    """Where a run writes and how it is named in W&B."""

    run_dir: Path
    name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    wandb_id: str | None = None  # set to continue an existing W&B run (a resumed training run)
    overrides: list[str] = field(default_factory=list)  # the command line's, to say how to resume
    choices: dict[str, str | None] = field(default_factory=dict)  # option per group (Hydra's)
    in_sweep: bool = False  # a multirun job: the sweep prints one `wandb sync` for all its jobs


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

    def __init__(self, run: RunContext, config: dict, wandb_cfg: Any):
        self.run_dir = Path(run.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics_path = self.run_dir / "metrics.jsonl"
        # a+: readable too, so that the rows can be copied back if the file is deleted mid-run
        self._metrics = self._metrics_path.open("a+", buffering=1)
        self._checked_at = time.monotonic()
        self._restorable = True  # until a copy back has failed
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
        self._run, self._wandb_cfg = run, wandb_cfg
        self._init_timeout = wandb_cfg.get("init_timeout", 90)  # a config from Python may lack it
        self.wandb_mode = resolve_wandb_mode(wandb_cfg.mode)
        self._announce_sync = self.wandb_mode == "offline" and not run.in_sweep
        # chosen here, not by W&B: a checkpoint records the id at once, without waiting for a
        # start that an unreachable server can stretch to wandb.init_timeout
        self._wandb_id = None
        self._wandb: WandbProcess | None = None
        self._log_lines: LogLines | None = None
        self._logged = False  # any metrics row yet
        self.step = 0  # the step being trained, set by the loop: where `mpexp.log` logs
        self._own_keys: set[str] = set()  # keys that mpexp.log has defined in W&B
        # a resumed run's earlier epochs count towards the `best` checkpoint
        self._validations = Validations.read(self.run_dir / "metrics.jsonl")
        if self.wandb_mode != "disabled":
            self._wandb_id = run.wandb_id or new_wandb_id()
            try:
                self._wandb = WandbProcess(
                    self._wandb_start(run, config, wandb_cfg),
                    self.run_dir / "wandb" / "process.log",
                    self._wandb_problem,
                )
            except OSError as err:  # no process to be had: W&B must never stop a training run
                self._wandb_problem("failed", f"its process did not start: {err}")
            else:
                self._log_lines = LogLines(self._wandb)
                logging.getLogger().addHandler(self._log_lines)
        _take_user_logs(self)

    def _wandb_start(self, run: RunContext, config: dict, wandb_cfg: Any) -> dict[str, Any]:
        """What the W&B process needs to start the run (wandb_process.py's `init`)."""
        metrics = [("step", {}), ("epoch", {})]
        metrics += [(pattern, {"step_metric": "step"}) for pattern in STEP_METRICS]
        metrics += [(pattern, {"step_metric": "epoch"}) for pattern in EPOCH_METRICS]
        metrics += [(name, {"step_metric": "epoch", "summary": kinds})
                    for name, kinds in SUMMARIES.items()]  # fmt: skip
        return {
            "init": {
                "project": wandb_cfg.project,
                "entity": wandb_cfg.entity,
                "group": run.group,
                "name": run.name,
                "job_type": JOB_TYPE,
                "tags": wandb_tags(None, run.choices, list(run.tags)),
                "config": config,
                "dir": str(self.run_dir),
                "mode": self.wandb_mode,
                "id": self._wandb_id,
                "resume": "allow" if run.wandb_id else None,
            },
            "settings": {
                "init_timeout": self._init_timeout,
                "silent": True,  # W&B's own console lines are quiet; mpexp says where the run is
                "x_stats_pid": os.getpid(),  # system metrics of this process, not W&B's
                "program": sys.argv[0],
            },
            "argv": list(sys.argv),
            "metrics": metrics,
        }

    def _wandb_problem(self, kind: str, text: str) -> None:
        """From the W&B process's reader thread: W&B did not start, or did not take something."""
        if kind != "failed":
            log.warning("%s", text)
            return
        hint = ""
        if "init_timeout" in text:  # W&B's hint names its own setting, not mpexp's key
            now = self._init_timeout
            hint = f" Give it longer: wandb.init_timeout=<seconds> (now {now:g})."
        said = text.splitlines()[0]
        log.warning("W&B could not start; logging to %s only.%s (%s)", self.run_dir, hint, said)

    @property
    def wandb_id(self) -> str | None:
        """The W&B run's id (None with W&B disabled), known before W&B has started; a resume
        continues that run, or creates it if W&B never got to."""
        return self._wandb_id

    def record_ran(self, ran: dict[str, Any]) -> None:
        """What ran (device, dtypes, TF32, scaler, optimizer path): into summary.json, and into
        the W&B run's config and tags."""
        self._summary["ran"] = ran
        self._write_summary()
        if self._wandb is not None:
            self._wandb.send("config", {"ran": ran})
            self._wandb.send("tags", wandb_tags(ran, self._run.choices, list(self._run.tags)))

    def flush(self) -> int:
        """Push metrics.jsonl to disk; return its size in bytes (a checkpoint's place in it)."""
        self._keep_metrics_file()
        self._metrics.flush()
        os.fsync(self._metrics.fileno())
        return os.fstat(self._metrics.fileno()).st_size

    def log_checkpoint(self, path: Path, step: int) -> None:
        """Upload a checkpoint as a W&B artifact of the run (wandb.log_checkpoints=true), with
        aliases `latest`, `step-<N>` and, on the best val/acc epoch so far, `best`; its metadata
        holds the step, the precision and, at an epoch's end, the epoch and its val metrics."""
        if self._wandb is None:
            return
        metadata = {"step": step, "precision": self._summary.get("ran", {}).get("precision")}
        aliases = ["latest", f"step-{step}"]
        epoch = self._validations.last
        if epoch is not None and epoch["step"] == step:  # the weights that epoch validated
            metadata.update({k: epoch[k] for k in ("epoch", "val/acc", "val/loss")})
            aliases += ["best"] if epoch["best"] else []
        self._wandb.send_and_wait("artifact", (str(path), metadata, aliases))

    def log(self, row: dict[str, Any]) -> None:
        """One metrics row (it must hold `step` or `epoch`)."""
        if time.monotonic() - self._checked_at > CHECK_FILE_EVERY_S:
            self._keep_metrics_file()
        self._metrics.write(json.dumps(row, default=_histogram_json) + "\n")
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
        """`mpexp.log`: the user's values as a row at `step` (default: the step being trained)."""
        row = {"step": self.step if step is None else step, **_checked(values)}
        new = [key for key in values if key not in self._own_keys]
        if new and self._wandb is not None:  # W&B plots them against `step`, as the step rows
            self._wandb.send("metrics", [(key, {"step_metric": "step"}) for key in new])
        self._own_keys.update(new)
        self.log(row)

    def update_summary(self, values: dict[str, Any]) -> None:
        self._summary.update(values)
        self._write_summary()
        if self._wandb is not None:
            if "ran" in values:  # what ran is the run's config in W&B, kept in one place there
                self._wandb.send("config", {"ran": values["ran"]})
            results = {k: v for k, v in values.items() if k != "ran"}
            flat = {k: v for k, v in flatten(results).items() if k not in SUMMARIES}
            self._wandb.send("summary", flat)

    def close(self, status: str = "finished", error: str | None = None) -> None:
        _take_user_logs(None, self)
        try:
            ended = {"status": status, "ended_at": _now(), **({"error": error} if error else {})}
            self.update_summary(ended)
        finally:  # even when summary.json cannot be written (a full disk)
            self._keep_metrics_file()
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
                if where is not None and self._announce_sync:
                    log.info(
                        "W&B run kept offline in %s; upload it with `wandb sync %s`", where, where
                    )

    def _record_wandb_run(self) -> None:
        """Where the W&B run is, for the report to log into the same project and group."""
        self._summary["wandb"] = {
            "mode": self.wandb_mode,
            "project": self._wandb_cfg.project,
            "entity": self._wandb_cfg.entity,
            "group": self._run.group,
            "id": self._wandb_id,
        }
        try:
            self._write_summary()
        except OSError as err:
            log.warning("Could not record the W&B run in %s (%s).", self.run_dir, err)

    def _write_summary(self) -> None:
        write_json_atomically(self._summary, self.run_dir / "summary.json")

    def _keep_metrics_file(self) -> None:
        """If metrics.jsonl was deleted (or replaced) since it was opened, write it again from
        the open file, which still holds every row, and go on appending there.

        A stat per call: the rows call it once a second at most, checkpoints and the end always.
        """
        self._checked_at = time.monotonic()
        if not self._restorable:
            return
        opened = os.fstat(self._metrics.fileno())
        try:
            there = os.stat(self._metrics_path)
            if (there.st_dev, there.st_ino) == (opened.st_dev, opened.st_ino):
                return
        except FileNotFoundError:
            pass
        try:
            self._metrics.flush()
            self._metrics.seek(0)
            tmp = self._metrics_path.with_name(self._metrics_path.name + ".tmp")
            with tmp.open("w") as copy:
                shutil.copyfileobj(self._metrics, copy)
            tmp.replace(self._metrics_path)
            reopened = self._metrics_path.open("a+", buffering=1)
        except OSError as err:  # training goes on; the rows stay in the open (deleted) file
            log.warning("%s is gone and could not be written again (%s).", self._metrics_path, err)
            self._restorable = False  # one warning, not one a second
            return
        self._metrics.close()
        self._metrics = reopened
        log.warning(
            "%s was deleted or replaced while the run went on; it is written again with every "
            "row the run has logged (%d bytes), and the run keeps appending to it.",
            self._metrics_path,
            opened.st_size,
        )


class Validations:
    """The epochs' validation results as they are logged, for a checkpoint's W&B artifact: which
    epoch's weights it holds, their val metrics, and whether they are the best so far."""

    def __init__(self) -> None:
        self.best_acc: float | None = None
        self.last: dict[str, Any] | None = None  # the last epoch's, with `best`

    def add(self, row: dict[str, Any]) -> None:
        if "epoch" not in row or "val/acc" not in row:
            return
        acc = row["val/acc"]
        best = acc == acc and (self.best_acc is None or acc > self.best_acc)  # a NaN never is
        if best:
            self.best_acc = acc
        keys = ("epoch", "step", "val/acc", "val/loss")
        self.last = {**{k: row.get(k) for k in keys}, "best": best}

    @classmethod
    def read(cls, metrics: Path) -> Validations:
        """The epochs already in `metrics` (a resumed run's; none for a new run)."""
        found = cls()
        if metrics.is_file() and metrics.stat().st_size:
            for line in metrics.read_text().splitlines():
                with contextlib.suppress(ValueError):  # a cut-off line holds no epoch
                    found.add(json.loads(line))
        return found


class NullTracker:
    """The sink of ranks > 0 in a distributed run: rank 0 alone writes metrics and the W&B run."""

    wandb_id = None

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.step = 0
        _take_user_logs(self)

    def log(self, row: dict[str, Any]) -> None:
        pass

    def log_own(self, values: Mapping[str, Any], step: int | None = None) -> None:
        _checked(values)  # the same mistakes fail on every rank

    def update_summary(self, values: dict[str, Any]) -> None:
        pass

    def record_ran(self, ran: dict[str, Any]) -> None:
        pass

    def flush(self) -> int:
        return 0

    def log_checkpoint(self, path: Path, step: int) -> None:
        pass

    def close(self, status: str = "finished", error: str | None = None) -> None:
        _take_user_logs(None, self)


# The run that `mpexp.log` logs into, and the process it belongs to: a process forked from it (a
# DataLoader worker) holds a copy whose files and W&B pipe are not its own.
_user_logs: tuple[Tracker | NullTracker, int] | None = None


def _take_user_logs(tracker: Tracker | NullTracker | None, closing: Any = None) -> None:
    """Make `tracker` the one `mpexp.log` logs into; None (from `closing`): no run any more."""
    global _user_logs
    if tracker is not None:
        _user_logs = (tracker, os.getpid())
    elif _user_logs is not None and _user_logs[0] is closing:
        _user_logs = None


def log_values(values: Mapping[str, Any], step: int | None = None) -> None:
    """`mpexp.log`: values of your own into the run that is training, `mpexp.log({"my/v": 0.5})`.

    For code of yours that mpexp runs (a model, dataset, loss scaler or schedule): the values go
    into the run's metrics.jsonl as a row `{"step": ..., **values}` and into its W&B run, plotted
    against `step`. `step` defaults to the training step in progress (0 before the first). Values
    are numbers, booleans, strings or `mpexp.tracking.Histogram`s; a tensor must be turned into a
    number first (`.item()`, which waits for the device: do it no more often than you need). Does
    nothing outside a run, in processes other than the run's (DataLoader workers), and on ranks
    other than 0 of a distributed run, which write no metrics.
    """
    if _user_logs is None or _user_logs[1] != os.getpid():
        return
    _user_logs[0].log_own(values, step)


def _checked(values: Mapping[str, Any]) -> Mapping[str, Any]:
    """`values` as mpexp.log takes them, or a TypeError naming the key and the fix."""
    if not isinstance(values, Mapping):
        raise TypeError(f"mpexp.log takes a dict of values, not {type(values).__name__}.")
    for key, value in values.items():
        if not isinstance(key, str) or key in ("step", "epoch"):
            raise TypeError(
                f"mpexp.log: {key!r} cannot be a key (step and epoch are mpexp's own); name "
                "values with strings such as 'my/value', and pass the step as step=..."
            )
        if not isinstance(value, bool | int | float | str | Histogram):
            raise TypeError(
                f"mpexp.log: the value of {key!r} is a {type(value).__name__}; pass a number "
                "(a tensor's .item(), which waits for the device), a bool, a string or a "
                "mpexp.tracking.Histogram."
            )
    return values


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _histogram_json(value: Any) -> dict:
    if isinstance(value, Histogram):
        return {"edges": value.edges, "counts": value.counts}
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def flatten(values: dict[str, Any], sep: str = "/", prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level: {"ran": {"device": x}} -> {"ran/device": x}."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, sep, f"{prefix}{key}{sep}"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
