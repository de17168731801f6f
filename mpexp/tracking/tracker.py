"""Where metrics go: `metrics.jsonl` and `summary.json` in the run dir always, W&B when enabled.

Metric names are a contract read by dashboards and the report:
  per step   step, train/loss, amp/scale (the scale the step used), amp/skipped_steps
             (cumulative), lr; with trainer.on_nonfinite_loss=skip also amp/nonfinite_loss_steps
             (cumulative)
  per epoch  epoch, train/epoch_loss, val/loss, val/acc (val/acc5 with 5 classes or more;
             val_ema/... with trainer.ema_decay), perf/epoch_time_s, perf/samples_per_s
             (samples actually trained on: a last partial batch counts its size), perf/tflops,
             mem/peak_allocated_mib (CUDA) or mem/peak_rss_mib (CPU); perf/mfu where the device's
             peak is known (mpexp/step/flops.py); perf/data_wait_s and perf/data_wait_share (the
             time the step waited for its batches, a GPU's idle time between steps, and that over
             the epoch's time: mpexp/step/data_wait.py)
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

import contextlib
import json
import logging
import numbers
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mpexp.errors import LogError
from mpexp.tasks.base import Result, Task
from mpexp.tracking.records import write_json_atomically
from mpexp.tracking.wandb_mode import new_wandb_id, resolve_wandb_mode
from mpexp.tracking.wandb_process import LogLines, WandbProcess

log = logging.getLogger(__name__)

STEP_METRICS = ("train/loss", "amp/*", "opt/*", "lr", "diag/*")
EPOCH_METRICS = ("train/epoch_loss", "val/*", "perf/*", "mem/*")
JOB_TYPE = "train"  # a training run's W&B job_type; the sweep report's run is `report`
CHECK_FILE_EVERY_S = 1.0  # how often logging rows looks whether metrics.jsonl is still there
# mpexp's own metric names, refused to mpexp.log: a value of the user's under one of them would sit
# among mpexp's rows, where the report reads it as the loss or the accuracy and W&B plots it on
# mpexp's axes
OWN_PREFIXES = ("train/", "val/", "test/", "amp/", "opt/", "perf/", "mem/", "diag/")
OWN_KEYS = ("step", "epoch", "lr", "samples", "tokens")


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
        # mpexp.log's rows from the first one holding a tensor on, in call order, until the loop
        # reads them with its own values (take_waiting), or a checkpoint or the end writes them
        self._waiting: list[dict[str, Any]] = []
        self._warned_capture = False
        self._warned: set[tuple[str | None, str]] = set()  # mpexp.log's dropped values, said
        # a resumed run's earlier epochs count towards the `best` checkpoint
        self._validations = Validations.read(self.run_dir / "metrics.jsonl", task.result)
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
        # a run that validates every N steps plots its validations against steps, as its losses
        trainer = config.get("trainer", {})
        by_steps = trainer.get("eval_every_steps") or trainer.get("max_steps")
        axis = "step" if by_steps else "epoch"
        metrics = [("step", {}), ("epoch", {}), ("samples", {}), ("tokens", {})]
        metrics += [(pattern, {"step_metric": "step"}) for pattern in STEP_METRICS]
        metrics += [(pattern, {"step_metric": axis}) for pattern in EPOCH_METRICS]
        metrics += [(name, {"step_metric": axis, "summary": kinds})
                    for name, kinds in self._summaries.items()]  # fmt: skip
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
        """Push metrics.jsonl to disk, with the user's rows still held; return its size in bytes
        (a checkpoint's place in it)."""
        self._write_waiting()
        self._keep_metrics_file()
        self._metrics.flush()
        os.fsync(self._metrics.fileno())
        return os.fstat(self._metrics.fileno()).st_size

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
        """`mpexp.log`: the user's values as a row at `step` (default: the step being trained).

        A row holding tensors is not read here: it waits, with every row logged after it (so that
        rows stay in call order), for the loop to read its tensors with the step's own values.
        """
        values = _taken(values, self._warned)
        if not values:
            return
        tensors = [value for value in values.values() if _is_tensor(value)]
        if tensors and not self._values_to_keep(tensors):
            return
        row = {"step": self.step if step is None else step}
        row.update((k, _copied(v) if _is_tensor(v) else v) for k, v in values.items())
        new = [key for key in values if key not in self._own_keys]
        if new and self._wandb is not None:  # W&B plots them against `step`, as the step rows
            self._wandb.send("metrics", [(key, {"step_metric": "step"}) for key in new])
        self._own_keys.update(new)
        if tensors or self._waiting:
            self._waiting.append(row)
        else:
            self.log(row)

    def take_waiting(self) -> list[dict[str, Any]]:
        """The user's rows held since the last call, in call order, their tensors still on the
        device: the loop reads them with its own values and logs them (mpexp/step/loop.py)."""
        rows, self._waiting = self._waiting, []
        return rows

    def _values_to_keep(self, tensors: list[Any]) -> bool:
        """Whether a call's tensors hold values: not on the meta device (a pass that only works
        out shapes), nor in a CUDA graph's capture, whose replays run no Python (said once)."""
        if any(t.is_meta for t in tensors):
            return False
        if not (any(t.is_cuda for t in tensors) and _capturing()):
            return True
        if not self._warned_capture:
            log.warning(
                "mpexp.log was called inside the training step as it was captured as a CUDA "
                "graph: a replayed step runs no Python, so values logged from inside the step "
                "(the model's forward, say) are logged only from the steps that run eagerly (the "
                "warm-up steps before the capture, and steps that cannot be replayed). "
                "trainer.cuda_graph=false logs them at every step."
            )
            self._warned_capture = True
        return False

    def _write_waiting(self) -> None:
        """Write the user's rows still held, reading their tensors one by one: at a checkpoint
        and at the end, which wait for the device anyway."""
        rows, self._waiting = self._waiting, []
        try:
            rows = [{k: float(v) if _is_tensor(v) else v for k, v in row.items()} for row in rows]
        except RuntimeError as err:  # a device that failed: the error that ends the run says so
            log.warning("%d rows of mpexp.log could not be read (%s).", len(rows), err)
            return
        for row in rows:
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
        _take_user_logs(None, self)
        try:
            self._write_waiting()
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
    epoch's weights it holds, their val metrics, and whether they are the best so far by the
    task's result metric."""

    def __init__(self, result: Result) -> None:
        self.result = result
        self.best: float | None = None
        self.last: dict[str, Any] | None = None  # the last epoch's: step, metrics, best

    def add(self, row: dict[str, Any]) -> None:
        if "epoch" not in row or self.result.metric not in row:
            return
        value = row[self.result.metric]
        best = self.result.better(value, self.best)
        if best:
            self.best = value
        metrics = {k: v for k, v in row.items() if k == "epoch" or k.startswith("val/")}
        self.last = {"step": row.get("step"), "metrics": metrics, "best": best}

    @classmethod
    def read(cls, metrics: Path, result: Result) -> Validations:
        """The epochs already in `metrics` (a resumed run's; none for a new run)."""
        found = cls(result)
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
        _taken(values, None)  # the same mistakes fail on every rank; rank 0 warns

    def take_waiting(self) -> list[dict[str, Any]]:
        return []

    def update_summary(self, values: dict[str, Any]) -> None:
        pass

    def log_samples(self, samples: list[tuple[str, str]]) -> None:
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
_passes = threading.local()  # `off`: this thread runs a pass of the model that is no step


@contextlib.contextmanager
def user_logs_off() -> Iterator[None]:
    """`mpexp.log` does nothing in this thread meanwhile: for passes of the model that are no
    training step, as the FLOP count's on the meta device (mpexp/step/flops.py), whose values
    would land at whatever step trains meanwhile."""
    was, _passes.off = getattr(_passes, "off", False), True
    try:
        yield
    finally:
        _passes.off = was


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
    are real numbers (Python's, NumPy's scalars and one-element arrays, one-element tensors),
    booleans, strings or `mpexp.tracking.Histogram`s; nested dicts are flattened (`{"a": {"b": 1}}`
    logs `a/b`). A tensor is copied on its device as float32 and read with the loop's own values,
    once per `trainer.log_every` steps, so logging it never waits for the device. A value it cannot
    take is dropped with a warning naming the call, once per call site and key: training goes on.
    Keys under mpexp's own names (`train/`, `val/`, `amp/`, `perf/`, `mem/`, `diag/`, `lr`,
    `step`, `epoch`) are refused (LogError). Does nothing
    outside a run, in processes other than the run's (DataLoader workers), on ranks other than 0
    of a distributed run, which write no metrics, and in the FLOP count's pass (user_logs_off).
    See docs/wandb.md, "Your own values".
    """
    if _user_logs is None or _user_logs[1] != os.getpid() or getattr(_passes, "off", False):
        return
    _user_logs[0].log_own(values, step)


def _taken(values: Mapping[str, Any], warned: set | None) -> dict[str, Any]:
    """`values` as mpexp.log writes them: nested dicts flattened (`{"a": {"b": 1}}` -> `a/b`),
    NumPy numbers and one-element arrays as Python's, one-element tensors as 0-d ones. A key of
    mpexp's own or one that is no string raises a LogError naming the call (a name is fixed in
    the code: the first call finds it); a value it cannot take is dropped with a warning naming
    the call, once per call site and key (`warned`; None: silently, on ranks that write nothing),
    for a value's kind can change hours into a run, and must not end it."""
    if not isinstance(values, Mapping):
        raise _log_error(f"it takes a dict of values, not {type(values).__name__}.")
    taken = {}
    for key, value in _flat(values).items():
        if key in OWN_KEYS or key.startswith(OWN_PREFIXES):
            names = ", ".join([*OWN_PREFIXES, *OWN_KEYS])
            step = " (a row's step is mpexp.log's step=...)" if key == "step" else ""
            raise _log_error(
                f"{key!r} is one of mpexp's own metric names ({names}){step}; choose another "
                f"prefix for your values, e.g. 'my/{key}'."
            )
        value, problem = _value(key, value)
        if problem is None:
            taken[key] = value
        elif warned is not None:
            _warn_dropped(key, problem, warned)
    return taken


def _flat(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise _log_error(f"{key!r} cannot be a key; name values with strings, e.g. 'my/value'.")
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}/"))
        else:
            flat[prefix + key] = value
    return flat


def _value(key: str, value: Any) -> tuple[Any, str | None]:
    """(the value as written, None), or (None, why it cannot be logged and what to pass)."""
    if _is_tensor(value):
        return _tensor_value(key, value)
    numpy = sys.modules.get("numpy")  # loaded with torch; a NumPy value exists only once it is
    if numpy is not None and isinstance(value, numpy.generic | numpy.ndarray):
        if value.size != 1:
            return None, (
                f"the value of {key!r} is an array of shape {value.shape}; pass one value: "
                "reduce it first (.mean(), .max()), or log a mpexp.tracking.Histogram of it."
            )
        if value.dtype.kind in "biuf":  # bool, integers, floats
            return value.reshape(()).item(), None
    elif isinstance(value, bool | int | float | str | Histogram):
        return value, None
    if isinstance(value, numbers.Real):  # fractions, and numbers of other libraries
        return float(value), None
    return None, (
        f"the value of {key!r} is a {type(value).__name__}; pass a real number (Python's, "
        "NumPy's, or a one-element tensor), a bool, a string or a mpexp.tracking.Histogram."
    )


def _tensor_value(key: str, value: Any) -> tuple[Any, str | None]:
    if value.numel() != 1:
        return None, (
            f"the value of {key!r} is a tensor of shape {tuple(value.shape)}; pass one value, "
            "a 0-d tensor: reduce it first (.mean(), .max(), .norm()), or log a "
            "mpexp.tracking.Histogram of it."
        )
    if value.is_complex() or value.is_quantized:
        return None, (
            f"the value of {key!r} is a {value.dtype} tensor; pass a real one (.abs(), .real, "
            ".dequantize())."
        )
    return value.reshape(()), None


def _warn_dropped(key: str, problem: str, warned: set) -> None:
    where = _call_site()
    if (where, key) in warned:
        return
    warned.add((where, key))
    log.warning(
        "mpexp.log dropped a value: %s (called at %s; the run goes on, and further values of "
        "%r from there are dropped without a word)",
        problem,
        where or "an unknown place",
        key,
    )


def _call_site() -> str | None:
    """file:line of the user's call to mpexp.log: the first frame outside this module and torch
    (whose wrapper keeps torch.compile out of mpexp.log: mpexp/__init__.py)."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename == __file__
        or frame.f_globals.get("__name__", "").startswith("torch.")
    ):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame else None


def _log_error(text: str) -> LogError:
    """A LogError that names where mpexp.log was called."""
    where = _call_site()
    return LogError(f"mpexp.log: {text}" + (f" (mpexp.log called at {where})" if where else ""))


def _is_tensor(value: Any) -> bool:
    # without importing torch, which the command line leaves out until a run starts: a tensor
    # exists only once torch is loaded
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _copied(value: Any) -> Any:
    """A 0-d tensor's value as it is now, as float32 on its device: one small copy, no wait. A
    copy, not the tensor itself: it may change in place before it is read (a buffer, a
    parameter), or be overwritten (an output of CUDA graphs); detached, it keeps no autograd
    graph alive."""
    import torch

    return value.detach().to(torch.float32, copy=True)


def _capturing() -> bool:
    import torch

    return torch.cuda.is_current_stream_capturing()


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
