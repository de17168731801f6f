"""Where metrics go: `metrics.jsonl` and `summary.json` in the run dir always, W&B when enabled.

Metric names are a contract read by dashboards and the report:
  per step   step, train/loss, amp/scale (the scale the step used), amp/skipped_steps
             (cumulative), lr; with trainer.on_nonfinite_loss=skip also amp/nonfinite_loss_steps
             (cumulative)
  per epoch  epoch, train/epoch_loss, val/loss, val/acc, perf/epoch_time_s, perf/samples_per_s
             (samples actually trained on: a last partial batch counts its size), perf/tflops,
             mem/peak_allocated_mib (CUDA) or mem/peak_rss_mib (CPU); perf/mfu where the device's
             peak is known (mpexp/flops.py)
  diagnostics  diag/... rows keyed by step, only when enabled (see mpexp/diagnostics.py); they
             share `step` with the step rows, so readers tell rows apart by their other keys
  summary    the final epoch's metrics, amp/skipped_steps, and under `ran` what ran, with
             final_scale: the scale after the last update, the one a next step would use
W&B is optional at every point: if it cannot start or stops accepting data, training goes on with
the local files and one warning.
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import secrets
import string
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mpexp.errors import UserError

log = logging.getLogger(__name__)

STEP_METRICS = ("train/loss", "amp/*", "lr", "diag/*")
EPOCH_METRICS = ("train/epoch_loss", "val/*", "perf/*", "mem/*")
BEST_OF = {"val/acc": "max", "val/loss": "min"}  # W&B summarises these as the best epoch's


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


def wandb_tags(ran: dict[str, Any], choices: dict[str, str | None], extra: list[str]) -> list[str]:
    """What a run is, as W&B tags to filter by: precision, loss scaling (what ran, `auto`
    resolved), model, dataset and experiment, then the user's `wandb.tags`."""
    tags = [f"precision={ran['precision']}", f"loss_scaling={ran['loss_scaling']}"]
    tags += [f"{group}={choices[group]}" for group in ("model", "dataset", "experiment")
             if choices.get(group)]  # fmt: skip
    return [*tags, *(t for t in extra if t not in tags)]


def has_wandb_key() -> bool:
    """True when W&B could log online: an API key in the environment or in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_wandb_mode(mode: str) -> str:
    """auto: online when a key is configured, else offline (WANDB_MODE in the environment wins)."""
    if mode != "auto":
        return mode
    return os.environ.get("WANDB_MODE") or ("online" if has_wandb_key() else "offline")


class Tracker:
    """One run's metric sink.

    W&B starts in a background thread (its service process and the run take a second or more,
    longer against a slow server) while training begins; rows logged before it is up wait in a
    queue and reach it in order once it is. Whatever needs W&B itself (its run id for a checkpoint,
    the summary, the end of the run) waits for the start to finish.
    """

    def __init__(self, run: RunContext, config: dict, wandb_cfg: Any):
        self.run_dir = Path(run.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = (self.run_dir / "metrics.jsonl").open("a", buffering=1)
        # wall-clock start and end: the report warns when a sweep's jobs overlapped in time
        self._summary: dict[str, Any] = {
            "status": "running",
            "started_at": _now(),
            "ran": config.get("ran", {}),
        }
        self._write_summary()
        self.wandb_mode = resolve_wandb_mode(wandb_cfg.mode)
        self._announce_sync = self.wandb_mode == "offline" and not run.in_sweep
        self._wandb = None
        # chosen here, not by W&B: a checkpoint records the id at once, without waiting for a
        # start that an unreachable server can stretch to wandb.init_timeout
        self._wandb_id = None
        if self.wandb_mode != "disabled":
            self._wandb_id = run.wandb_id or new_wandb_id()
        self._queued: list[dict[str, Any]] = []  # rows logged while W&B was starting
        self._starting: threading.Thread | None = None
        self._start_result: tuple[Any, BaseException | None] = (None, None)
        if self.wandb_mode != "disabled":
            # W&B's own console lines (login, sync hints, run summaries) stay quiet unless asked
            os.environ.setdefault("WANDB_SILENT", "true")
            self._starting = threading.Thread(
                target=self._start_wandb, args=(run, config, wandb_cfg), name="wandb-start"
            )
            self._starting.daemon = True  # a run that ends first must not wait for it to exit
            self._starting.start()
        self._run, self._wandb_cfg = run, wandb_cfg

    def _start_wandb(self, run: RunContext, config: dict, wandb_cfg: Any) -> None:
        """In the background thread: start the W&B run; the outcome waits in _start_result."""
        try:
            import wandb

            wb = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                group=run.group,
                name=run.name,
                job_type="train",
                tags=wandb_tags(config.get("ran", {}), run.choices, list(run.tags)),
                config=config,
                dir=str(self.run_dir),
                mode=self.wandb_mode,
                id=self._wandb_id,
                resume="allow" if run.wandb_id else None,
                # W&B's own console lines are quieted; mpexp says where the run is, once
                settings=wandb.Settings(
                    init_timeout=wandb_cfg.get("init_timeout", 90), silent=True
                ),
            )
            wb.define_metric("step")
            wb.define_metric("epoch")
            for pattern in STEP_METRICS:
                wb.define_metric(pattern, step_metric="step")
            for pattern in EPOCH_METRICS:
                wb.define_metric(pattern, step_metric="epoch")
            # the run's summary holds the best of these, not whatever the last epoch gave
            for name, best in BEST_OF.items():
                wb.define_metric(name, step_metric="epoch", summary=best)
            self._start_result = (wb, None)
        except Exception as err:  # W&B must never stop a training run
            self._start_result = (None, err)

    def _wandb_up(self, wait: bool = True) -> bool:
        """Whether W&B takes data now; with wait, wait for a start under way to end first."""
        if self._starting is None:
            return self._wandb is not None
        if not wait and self._starting.is_alive():
            return False
        self._starting.join()
        self._starting = None
        wb, err = self._start_result
        if err is not None:
            self._warn_not_started(err)
            self._queued = []
            return False
        self._wandb = wb
        # the report reads this to log its table into the same project and group
        self._summary["wandb"] = {
            "mode": self.wandb_mode,
            "project": self._wandb_cfg.project,
            "entity": self._wandb_cfg.entity,
            "group": self._run.group,
            "id": wb.id,
        }
        self._write_summary()
        queued, self._queued = self._queued, []
        for row in queued:
            self._send(row)
        return self._wandb is not None

    def _warn_not_started(self, err: BaseException) -> None:
        hint = ""
        if "init_timeout" in str(err):  # W&B's hint names its own setting, not mpexp's key
            now = self._wandb_cfg.init_timeout
            hint = f" Give it longer: wandb.init_timeout=<seconds> (now {now:g})."
        said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        log.warning("W&B could not start; logging to %s only.%s (%s)", self.run_dir, hint, said)

    @property
    def wandb_run_dir(self) -> Path | None:
        return Path(self._wandb.dir).parent if self._wandb_up() else None

    @property
    def wandb_id(self) -> str | None:
        """The W&B run's id (None with W&B disabled), known before W&B has started; a resume
        continues that run, or creates it if W&B never got to."""
        return self._wandb_id

    def flush(self) -> int:
        """Push metrics.jsonl to disk; return its size in bytes (a checkpoint's place in it)."""
        self._metrics.flush()
        os.fsync(self._metrics.fileno())
        return os.fstat(self._metrics.fileno()).st_size

    def log_checkpoint(self, path: Path, step: int) -> None:
        """Upload a checkpoint as a W&B artifact of the run (wandb.log_checkpoints=true)."""
        if not self._wandb_up():
            return
        try:
            import wandb

            artifact = wandb.Artifact(f"checkpoint-{self._wandb.id}", type="model")
            artifact.add_file(str(path))
            self._wandb.log_artifact(artifact, aliases=["latest", f"step-{step}"])
        except Exception as err:
            log.warning("W&B did not take the checkpoint %s (%s).", path, err)

    def log(self, row: dict[str, Any]) -> None:
        """One metrics row (it must hold `step` or `epoch`)."""
        self._metrics.write(json.dumps(row, default=_histogram_json) + "\n")
        if self._wandb_up(wait=False):
            self._send(row)
        elif self._starting is not None:
            self._queued.append(row)

    def _send(self, row: dict[str, Any]) -> None:
        try:
            self._wandb.log(_for_wandb(row))
        except Exception as err:
            log.warning("W&B stopped accepting data (%s); local metrics continue.", err)
            self._wandb = None

    def update_summary(self, values: dict[str, Any]) -> None:
        self._summary.update(values)
        self._write_summary()
        if self._wandb_up():
            try:
                self._wandb.summary.update(
                    {k: v for k, v in flatten(values).items() if k not in BEST_OF}
                )
            except Exception as err:
                log.warning("W&B summary not updated (%s).", err)

    def close(self, status: str = "finished", error: str | None = None) -> None:
        try:
            ended = {"status": status, "ended_at": _now(), **({"error": error} if error else {})}
            self.update_summary(ended)
        finally:  # even when summary.json cannot be written (a full disk)
            self._metrics.close()
            if self._wandb_up():
                where = self.wandb_run_dir
                try:
                    self._wandb.finish(exit_code=0 if status == "finished" else 1)
                except Exception as err:
                    log.warning("W&B did not finish cleanly (%s).", err)
                if self._announce_sync:
                    log.info(
                        "W&B run kept offline in %s; upload it with `wandb sync %s`", where, where
                    )

    def _write_summary(self) -> None:
        write_json_atomically(self._summary, self.run_dir / "summary.json")


class NullTracker:
    """The sink of ranks > 0 in a distributed run: rank 0 alone writes metrics and the W&B run."""

    wandb_run_dir = None
    wandb_id = None

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)

    def log(self, row: dict[str, Any]) -> None:
        pass

    def update_summary(self, values: dict[str, Any]) -> None:
        pass

    def flush(self) -> int:
        return 0

    def log_checkpoint(self, path: Path, step: int) -> None:
        pass

    def close(self, status: str = "finished", error: str | None = None) -> None:
        pass


def write_json_atomically(value: Any, path: Path) -> None:
    """`path` holds the old JSON or all of the new, never half of it; no temporary file is left."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(value, indent=2, default=str) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def error_text(error: BaseException) -> str:
    """An error as a run's summary records it: a UserError's own message, else type and text."""
    return str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"


def record_end(run_dir: Path, status: str, error: BaseException | None = None) -> None:
    """Set a run's status in its summary.json (with the error), where a sweep's report looks.

    Also covers runs that end before training starts (a bad value, bf16 on a GPU without it, a
    stop signal), when no Tracker exists yet. Best effort: a run dir that cannot be written keeps
    what it has.
    """
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        summary = {}
    summary["status"] = status
    if error is not None:
        summary["error"] = error_text(error)
    try:
        write_json_atomically(summary, path)
    except OSError as err:
        log.warning("Could not record the %s run in %s (%s).", status, path, err)


def new_wandb_id() -> str:
    """A fresh W&B run id: 8 characters of [a-z0-9], as W&B makes them."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _histogram_json(value: Any) -> dict:
    if isinstance(value, Histogram):
        return {"edges": value.edges, "counts": value.counts}
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _for_wandb(row: dict[str, Any]) -> dict[str, Any]:
    if not any(isinstance(v, Histogram) for v in row.values()):
        return row
    import wandb

    return {
        k: wandb.Histogram(np_histogram=(v.counts, v.edges)) if isinstance(v, Histogram) else v
        for k, v in row.items()
    }


def flatten(values: dict[str, Any], sep: str = "/", prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level: {"ran": {"device": x}} -> {"ran/device": x}."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, sep, f"{prefix}{key}{sep}"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
