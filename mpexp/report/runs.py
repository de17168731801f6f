"""Finding run directories on disk and reading back what each run wrote.

A run directory is what `python -m mpexp.train` leaves behind: `metrics.jsonl`, `summary.json`,
`train.log` and Hydra's `.hydra/`, in `outputs/<date>/<time>/` for a single run and in
`outputs/multirun/<date>/<time>/<job>/` for a sweep's jobs (`<number>_<overrides it varies>`,
mpexp/job_names.py).
Only local files are read; nothing here touches the network.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from yaml import YAMLError

from mpexp.errors import UserError

RUN_MARKERS = ("summary.json", "metrics.jsonl", ".hydra/config.yaml")


@dataclass
class Run:
    """One run as its files describe it. `problem` says why it cannot be reported, if it can't."""

    path: Path
    status: str
    config: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    choices: dict[str, Any] = field(default_factory=dict)  # Hydra's: the option of each group
    summary: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    diagnostics: list[dict[str, Any]] = field(default_factory=list)  # diag/ rows, by step
    problem: str | None = None
    cut_off: bool = False  # metrics.jsonl's last line was cut off (a crash mid-write)

    @property
    def ran(self) -> dict[str, Any]:
        return self.summary.get("ran", {})

    @property
    def step_budget(self) -> bool:
        """Whether it trained to a step budget (`trainer.max_steps`) or validated every
        `trainer.eval_every_steps`: its validation rows are then not one per epoch."""
        trainer = self.config.get("trainer", {})
        return bool(trainer.get("max_steps") or trainer.get("eval_every_steps"))

    def chosen(self, group: str) -> str:
        """The option picked for a config group (`precision`, `model`, ...), '?' if unknown."""
        return str(self.choices.get(group) or self.ran.get("choices", {}).get(group) or "?")


def is_run_dir(path: Path) -> bool:
    return any((path / marker).is_file() for marker in RUN_MARKERS)


def find_run_dirs(paths: list[Path]) -> list[Path]:
    """Run directories given directly or found below the given directories, in job order."""
    found: list[Path] = []
    for path in paths:
        if not path.exists():
            raise UserError(f"{path} does not exist; give a run directory or a multirun directory.")
        if not path.is_dir():
            raise UserError(
                f"{path} is not a directory; give a run directory (outputs/<date>/<time>) or a "
                "multirun directory (outputs/multirun/<date>/<time>)."
            )
        for top, dirs, _ in os.walk(path):
            here = Path(top)
            if is_run_dir(here):
                found.append(here.resolve())
                dirs.clear()  # a run's own subfolders (wandb/, .hydra/) hold no further runs
            else:
                dirs[:] = [d for d in dirs if not d.startswith(".") and d != "wandb"]
    unique = sorted(set(found), key=_natural_key)
    if not unique:
        raise UserError(
            f"No runs found under {', '.join(map(str, paths))}: a run directory holds "
            f"{', '.join(RUN_MARKERS)}. Point at outputs/<date>/<time> or "
            "outputs/multirun/<date>/<time>."
        )
    return unique


def job_number(folder: str) -> str:
    """A sweep job's folder without the overrides it is named by: `seeds-2-4/3` for
    `seeds-2-4/3_precision=fp16,trainer.seed=3`; any other folder as it is."""
    head, _, name = folder.rpartition("/")
    number, sep, _ = name.partition("_")
    shown = number if sep and number.isdigit() else name
    return f"{head}/{shown}" if head else shown


def _natural_key(path: Path) -> list:
    # job folders are numbered: 2 sorts before 10
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def load_run(path: Path) -> Run:
    """Read one run directory; problems are recorded on the Run, never raised."""
    run = Run(path=path, status="not started")
    hydra_dir = path / ".hydra"
    try:
        run.config = _read_yaml(hydra_dir / "config.yaml") or {}
        run.overrides = [str(o) for o in _read_yaml(hydra_dir / "overrides.yaml") or []]
        hydra = _read_yaml(hydra_dir / "hydra.yaml") or {}
        run.choices = hydra.get("hydra", {}).get("runtime", {}).get("choices", {})
    except (OSError, YAMLError) as err:
        run.problem = f"its Hydra config cannot be read ({err})"
        return run

    summary_file = path / "summary.json"
    if not summary_file.is_file():
        run.problem = _why_not(path, "it never started training (no summary.json)")
        return run
    try:
        summary = json.loads(summary_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        run.problem = f"summary.json cannot be read ({err})"
        return run
    if not isinstance(summary, dict):
        run.problem = (
            f"summary.json holds {_json_kind(summary)}, not an object of the run's results"
        )
        return run
    run.summary = summary
    run.status = str(summary.get("status", "unknown"))
    _own_record(run)

    error = run.summary.get("error")
    if run.status == "failed" and not (path / "metrics.jsonl").exists():
        # failed before its first step, e.g. on a bad value: summary.json holds the error
        what = "it never started training"
        run.problem = f"{what}: {error}" if error else _why_not(path, what)
        return run
    try:
        run.steps, run.epochs, run.diagnostics, run.cut_off = _read_metrics(path / "metrics.jsonl")
    except (OSError, ValueError) as err:
        run.problem = f"metrics.jsonl cannot be read ({err})"
        return run

    trainer = run.config.get("trainer", {})
    if trainer.get("max_steps"):
        step = run.steps[-1]["step"] if run.steps else 0
        done = f"after {step} of {trainer['max_steps']} steps"
    else:
        done = f"after {len(run.epochs)} of {trainer.get('epochs', '?')} epochs"
    if run.status == "failed":
        run.problem = f"it failed {done}: {error}" if error else _why_not(path, f"it failed {done}")
    elif run.status == "interrupted":
        run.problem = f"it was stopped by a signal {done}; continue it with trainer.resume={path}"
    elif run.status == "running":
        run.problem = f"it is still running or was killed ({done}; summary.json says running)"
    elif run.status != "finished":
        run.problem = f"summary.json has status {run.status!r}, not 'finished'"
    elif not run.epochs:
        run.problem = "it finished but metrics.jsonl holds no epoch rows"
    if run.problem and run.cut_off:
        run.problem += "; the last line of metrics.jsonl was cut off mid-write and is left out"
    return run


def _own_record(run: Run) -> None:
    """Take the config, overrides and choices from summary.json where the run recorded them: the
    process that trained wrote it along with the metrics, while `.hydra/` is written by whichever
    process Hydra started there last. Runs from before mpexp recorded them keep `.hydra/`'s."""
    if isinstance(run.summary.get("config"), dict):
        run.config = run.summary["config"]
    if isinstance(run.summary.get("overrides"), list):
        run.overrides = [str(o) for o in run.summary["overrides"]]
    if isinstance(run.ran.get("choices"), dict):
        run.choices = run.ran["choices"]


def _read_yaml(path: Path) -> Any:
    # unresolved: Hydra saves interpolations such as ${now:...} that only resolve inside a job
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) if path.is_file() else None


def _read_metrics(path: Path) -> tuple[list[dict], list[dict], list[dict], bool]:
    """Step rows, epoch rows and diagnostics rows (diagnostics.*: their own rows, by step), and
    whether the last line was cut off: a process killed mid-write leaves half a line, which is
    left out. Any other line that is not JSON makes the file unreadable."""
    steps, epochs, diagnostics = [], [], []
    lines = path.read_text().splitlines()
    cut_off = False
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                cut_off = True
                break
            raise ValueError(f"line {number} is not JSON") from None
        if not isinstance(row, dict):
            raise ValueError(f"line {number} holds {_json_kind(row)}, not an object of metrics")
        # epoch rows also carry `step` (the step count so far), so test for `epoch` first
        if "epoch" in row:
            epochs.append(row)
        elif "train/loss" in row:
            steps.append(row)
        else:
            diagnostics.append(row)
    return steps, epochs, diagnostics, cut_off


def _json_kind(value: Any) -> str:
    """What a JSON value is, for a message: "a list", "a number", ..."""
    kinds = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


def _why_not(path: Path, what: str) -> str:
    """`what`, with the error the run logged, when train.log holds one."""
    log_file = path / "train.log"
    errors = []
    if log_file.is_file():
        errors = [line for line in log_file.read_text().splitlines() if "][ERROR] - " in line]
    if errors:
        return f"{what}: {errors[-1].split('][ERROR] - ', 1)[1]}"
    return f"{what}; see {log_file}"
