"""The command that adds seeds to a sweep: the sweep's own command, as Hydra recorded it in the
sweep's multirun.yaml, with new values of `trainer.seed`, run into a folder inside the sweep's
(so that a report on the sweep finds the old runs and the new), in the same W&B group, and the
report on the sweep again.

Runs that no multirun.yaml describes (single runs, gathered by mpexp-report) get a sweep
command of their overrides: each key with the values its runs gave it, as a comma list.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from omegaconf import OmegaConf

from mpexp.report.overrides import SEED, override_key
from mpexp.report.table import Report

TRAIN = ["python", "-m", "mpexp.train", "-m"]
REPORT = ["python", "-m", "mpexp.report"]
# the sweep's own Hydra overrides that a new sweep must not repeat: it gets its own folder
NOT_REPEATED = ("hydra.sweep.dir", "hydra.mode")


def new_seeds(report: Report, count: int) -> list[int]:
    """`count` seeds that no reported run used, after the highest one that did."""
    used = [r.seed for r in report.rows if isinstance(r.seed, int)]
    first = max(used, default=-1) + 1
    return list(range(first, first + count))


def more_seeds_command(report: Report, seeds: list[int]) -> str:
    """The shell command that runs the report's configurations again with `seeds` and reports on
    old and new runs together, into the same folder, with the same tolerance and target."""
    sweep = _sweep_record(report)
    if sweep is None:
        task, hydra, where = _as_a_sweep(report), [], report.out_dir
        folders = [str(p) for p in dict.fromkeys(r.run.path.parent for r in report.rows)]
    else:
        where, saved = sweep
        folders = [str(where)]
        task = [str(o) for o in OmegaConf.select(saved, "hydra.overrides.task", default=[])]
        hydra = [str(o) for o in OmegaConf.select(saved, "hydra.overrides.hydra", default=[])
                 if override_key(str(o)) not in NOT_REPEATED]  # fmt: skip
    task = [o for o in task if override_key(o) != SEED]
    group = _wandb_group(report)
    if group and not any(override_key(o) == "wandb.group" for o in task):
        task.append(f"wandb.group={group}")
    name = f"seeds-{seeds[0]}" + (f"-{seeds[-1]}" if len(seeds) > 1 else "")
    new = where / name
    train = [*TRAIN, *task, f"{SEED}={','.join(map(str, seeds))}", *hydra,
             f"hydra.sweep.dir={new}"]  # fmt: skip
    again = [*REPORT, *folders]
    if sweep is None:
        again.append(str(new))  # not below the folders of the runs gathered
    if sweep is None or where != report.out_dir:
        again += ["--out", str(report.out_dir)]
    if report.tolerance is not None:
        again += ["--tolerance", f"{report.tolerance:g}"]
    if report.target is not None:
        again += ["--target", f"{report.target:g}"]
    return f"{shlex.join(train)} && {shlex.join(again)}"


def _sweep_record(report: Report) -> tuple[Path, object] | None:
    """The folder and multirun.yaml of the sweep the runs came from: the report's own folder's
    where it is a sweep's, else the first run's sweep's; None for runs of no sweep."""
    folders = dict.fromkeys(r.run.path.parent for r in report.rows)
    found = [f for f in folders if (f / "multirun.yaml").is_file()]
    if not found:
        return None
    chosen = next((f for f in found if f == report.out_dir), found[0])
    try:
        return chosen, OmegaConf.load(chosen / "multirun.yaml")
    except (OSError, ValueError):
        return None


def _as_a_sweep(report: Report) -> list[str]:
    """The runs' overrides as one sweep: each key with its values, in the order first given."""
    values: dict[str, dict[str, None]] = {}
    for row in report.rows:
        for override in row.run.overrides:
            key, _, value = override.partition("=")
            values.setdefault(key, {})[value] = None
    return [f"{key}={','.join(given)}" for key, given in values.items()]


def _wandb_group(report: Report) -> str | None:
    """The W&B group the runs went to, where they went to W&B: the new runs join it."""
    for row in report.rows:
        where = row.run.summary.get("wandb") or {}
        if where.get("group"):
            return str(where["group"])
    return None
