"""The sweep's W&B view: its runs grouped by what the sweep varied, seeds collapsed into bands.

The view is written twice over. Its spec, plain data, goes to `wandb-view.json` in the report's
folder whatever the W&B mode, so that an offline sweep keeps it and `mpexp-report <dir>
--wandb-view` creates it after `wandb sync` without reading the runs again. The view itself, a
saved workspace of the W&B project, is made from the spec with the `wandb-workspaces` package
(the `wandb-view` extra), imported only then, and saved when the runs are online, by a process
of its own that is ended after `--view-timeout` seconds (wandb_view_process.py). Without the
package or the network the report is written all the same, in bounded time, and one line says
how to create the view later.

The spec:

    name        the sweep's W&B group (groups, joined by ", ", for runs of several sweeps)
    entity, project   where the runs went
    runs        {"groups": [...], "job_type": "train"}: the runset's filter
    group_by    W&B config keys, precision first (`ran.precision`), then any other key that
                varies across the runs; never the seed, so that seeds collapse into a group
    seeds       how a group is drawn: {"line": "mean", "band": "minmax"}
    max_runs    lines (groups) a panel shows at most
    sections    [{"name", "open", "panels": [{"kind": "line" | "bar" | "scatter", "title", "x",
                "y", "log_y" (lines), "log_x" (scatters)} or {"kind": "markdown", "title",
                "text"}]}], in the order a reader asks: report.md's bottom line (Markdown), the
                result (and, for a sweep over a numeric key beside the precision, each run's
                final result against that key: report.md's sweep figure), loss (train/loss by
                step, val/loss by epoch, the learning rate), loss scale, speed (with the data
                wait), memory, the user's own mpexp.log values, diagnostics (closed); those but
                the result and loss present only when logged. Validation values are drawn by
                step rather than epoch for runs that trained to a step budget.
    url         the saved view's address, once it has been created
"""

from __future__ import annotations

import contextlib
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from mpexp.errors import UserError
from mpexp.report.axes import sweep_axis
from mpexp.report.bottom_line import markdown
from mpexp.report.overrides import NOT_CONFIG, in_groups
from mpexp.report.row import MEMORY_KEYS
from mpexp.report.runs import Run
from mpexp.report.table import Report
from mpexp.report.wandb_run import wandb_target
from mpexp.report.wandb_view_process import TIMEOUT, ViewNotCreated, save_view
from mpexp.tasks.base import Result
from mpexp.tracking.records import write_json_atomically
from mpexp.tracking.user_values import OWN_KEYS, OWN_PREFIXES
from mpexp.tracking.wandb_mode import has_wandb_key, sweep_group
from mpexp.tracking.wandb_setup import JOB_TYPE

SPEC_FILE = "wandb-view.json"
INSTALL = 'pip install -e ".[wandb-view]"'
SEEDS = {"line": "mean", "band": "minmax"}
WALL_TIME = "RelativeTime(Wall)"  # W&B's x-axis of wall-clock time since the run started
SPEED = ("perf/epoch_time_s", "perf/samples_per_s", "perf/tokens_per_s", "perf/tflops", "perf/mfu",
         "perf/data_wait_s", "perf/data_wait_share")  # fmt: skip
MAX_OPEN_OWN = 12  # the user's own values: more panels than this, and their section starts closed
# what ran, `auto` resolved: the names the report and the runs' tags give them
RAN_KEYS = {"precision": "ran.precision", "loss_scaling": "ran.loss_scaling"}
MIN_PANEL_RUNS = 10  # W&B's own default


def result_metric(run: Run) -> str:
    """The metric that is the run's result: its task's, or `val/acc` for runs from before tasks."""
    return Result.from_record(run.ran.get("task")).metric


def write_spec(report: Report) -> dict | None:
    """Write the view's spec into the report's folder and return it; None, and no file, for runs
    in no W&B group (single runs). A view created before keeps its URL in the file."""
    spec = view_spec(report)
    if spec is None:
        return None
    path = report.out_dir / SPEC_FILE
    with contextlib.suppress(UserError):
        before = read_spec(report.out_dir)
        if before.get("url") and before.get("name") == spec["name"]:
            spec["url"] = before["url"]
    write_json_atomically(spec, path)
    return spec


def read_spec(out_dir: Path) -> dict:
    """The spec written with the report into `out_dir`."""
    path = out_dir / SPEC_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(
            f"{path} does not exist: write the report first (mpexp-report {out_dir}); runs "
            "that are in no W&B group (single runs) have no view."
        ) from None
    except (OSError, ValueError) as err:
        raise UserError(f"{path} cannot be read ({err}); write the report again.") from None


def view_spec(report: Report) -> dict | None:
    """The view of the report's runs, as plain data (the module's docstring lists its keys)."""
    runs = [row.run for row in report.rows]
    groups = sorted({group for group in map(wandb_group, runs) if group})
    if not groups:
        return None
    where = wandb_target(report)
    results = list(dict.fromkeys(map(result_metric, runs)))
    axis = sweep_axis(report.configs)
    swept = None if axis is None else Swept(_wandb_key(axis.key, runs[0]), axis.key, axis.log)
    return {
        "name": ", ".join(groups),  # W&B refuses symbols such as "+" in a view's name
        "entity": where.get("entity"),
        "project": where.get("project"),
        "runs": {"groups": groups, "job_type": JOB_TYPE},
        "group_by": group_by(runs),
        "seeds": SEEDS,
        "max_runs": max(len(runs), MIN_PANEL_RUNS),
        "sections": [
            *_bottom_line(report),
            *sections(
                results,
                logged_keys(runs),
                swept,
                progress="step" if any(run.step_budget for run in runs) else "epoch",
            ),
        ],
    }


def _bottom_line(report: Report) -> list[dict]:
    """The view's first section: report.md's bottom line, as a Markdown panel."""
    text = markdown(report)
    if not text:
        return []
    panel = {"kind": "markdown", "title": "Bottom line", "text": text}
    return [{"name": "Bottom line", "open": True, "panels": [panel]}]


def wandb_group(run: Run) -> str | None:
    """The run's W&B group: as it recorded it, or as its config set it, or, for a sweep's job
    that logged nothing to W&B, the group training would have given it."""
    where = run.summary.get("wandb") or run.config.get("wandb") or {}
    if where.get("group"):
        return where["group"]
    if (run.path.parent / "multirun.yaml").is_file():  # Hydra's record of the sweep
        return sweep_group(run.path.parent)
    return None


def group_by(runs: list[Run]) -> list[str]:
    """The W&B config keys that tell configurations apart: precision first, then every other key
    whose override differs between the runs, in the order given; the seed, resume and W&B
    settings never."""
    given = [dict(_split(o) for o in run.overrides) for run in runs]
    keys = dict.fromkeys(key for overrides in given for key in overrides)
    varying = [
        key
        for key in keys
        if not in_groups(key, NOT_CONFIG) and len({overrides.get(key) for overrides in given}) > 1
    ]
    wandb_keys = [_wandb_key(key, runs[0]) for key in ["precision", *varying]]
    if any(run.ran.get("update_rounding") for run in runs):
        # bf16_pure's roundings are one ran.precision; their legs differ in this
        wandb_keys.insert(1, "ran.update_rounding")
    return list(dict.fromkeys(wandb_keys))


def _split(override: str) -> tuple[str, str]:
    """`+optimizer.lr=1e-3` -> (`optimizer.lr`, `1e-3`)."""
    key, _, value = override.lstrip("+~").partition("=")
    return key, value


def _wandb_key(key: str, run: Run) -> str:
    """Where an override's value is in the W&B run's config, which holds the composed config
    nested by its dots (`optimizer.lr`) and what ran under `ran`. A config group's override picks
    an option, recorded in `ran.choices`; the config holds only that option's keys."""
    if key in RAN_KEYS:
        return RAN_KEYS[key]
    if key in run.choices:
        return f"ran.choices.{key}"
    return key


def logged_keys(runs: list[Run]) -> set[str]:
    """The metrics with numbers in the runs' rows (text and histograms cannot be plotted)."""
    return {
        key
        for run in runs
        for row in (*run.steps, *run.epochs, *run.diagnostics)
        for key, value in row.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


UPDATES_LOST = "opt/updates_lost"


@dataclass(frozen=True)
class Swept:
    """The numeric key a sweep varied beside the precision (axes.sweep_axis)."""

    wandb_key: str  # where the W&B run's config holds it
    key: str  # the override's key
    log: bool  # its values span a decade: a log axis


def sections(
    results: list[str], logged: set[str], swept: Swept | None = None, progress: str = "epoch"
) -> list[dict]:
    """The view's sections, in the order a reader asks; those with nothing to show are left out.
    `progress`: what validation values are drawn against, `epoch` or (step budgets) `step`."""
    result = [
        panel
        for metric in results
        for panel in (
            _line(f"{metric} by {progress}", progress, metric),
            _line(f"{metric} by wall-clock time", WALL_TIME, metric),
            *([_scatter(metric, swept)] if swept else []),
        )
    ]
    scale = [
        # halvings and doublings are even steps on a log axis; on a linear one the back-offs
        # below the first vanish into the floor
        _line("loss scale (log axis)", "step", "amp/scale", log_y=True),
        _line("skipped steps", "step", "amp/skipped_steps"),
    ]
    loss = [
        _line("train/loss by step", "step", "train/loss"),
        _line(f"val/loss by {progress}", progress, "val/loss"),
        *([_line("learning rate", "step", "lr")] if "lr" in logged else []),
    ]
    speed = [_bar(key) for key in SPEED if key in logged]
    if "perf/data_wait_s" in logged:  # when in the run the data held the step up
        speed.append(_line(f"perf/data_wait_s by {progress}", progress, "perf/data_wait_s"))
    own = [_line(k, "step", k) for k in sorted(logged) if _users(k)]
    # pure bf16's updates that rounding left out of the weights (mpexp/precision/pure_updates.py)
    lost = [_line("updates lost", "step", UPDATES_LOST)] if UPDATES_LOST in logged else []
    found = [
        ("Result", True, result),
        ("Loss", True, loss),
        ("Loss scale", True, scale),
        ("Updates lost", True, lost),
        ("Speed", True, speed),
        ("Memory", True, [_bar(key) for key in MEMORY_KEYS if key in logged]),
        ("Your values (mpexp.log)", len(own) <= MAX_OPEN_OWN, own),
        ("Diagnostics", False, [_line(k, "step", k) for k in sorted(logged) if _diagnostic(k)]),
    ]
    return [
        {"name": name, "open": open_, "panels": panels} for name, open_, panels in found if panels
    ]


def _line(title: str, x: str, y: str, log_y: bool = False) -> dict:
    return {"kind": "line", "title": title, "x": x, "y": [y], "log_y": log_y}


def _scatter(metric: str, swept: Swept) -> dict:
    # each run's final value (W&B's summary keeps it as `<metric>.last`, beside the min or max
    # that the task's summaries ask for) against the swept key in its config; grouped runs are
    # coloured by group, so the precisions and the other swept keys tell apart
    return {"kind": "scatter", "title": f"{metric} against {swept.key}", "x": swept.wandb_key,
            "y": [f"{metric}.last"], "log_x": swept.log}  # fmt: skip


def _bar(metric: str) -> dict:
    # a bar is the run's summary value, which W&B keeps as the last epoch's
    return {"kind": "bar", "title": f"{metric} (last epoch)", "y": [metric]}


def _users(key: str) -> bool:
    """A value the user logged with mpexp.log: none of mpexp's own names (user_values.OWN_*)."""
    return not (key in OWN_KEYS or key.startswith(OWN_PREFIXES))


def _diagnostic(key: str) -> bool:
    """Whole-model diagnostics: `diag/total/...`, `diag/<count>` and the non-finite guards'
    counts. The per-layer `diag/<layer>/...` are many; report.md's underflow plot has them."""
    whole = key.startswith("diag/") and key.count("/") == 1
    return whole or key.startswith(("diag/total/", "amp/nonfinite_"))


def after_report(spec: dict | None, out_dir: Path, mode: str, timeout: float = TIMEOUT) -> None:
    """The report's one line on its view: its URL (the view is created when the runs are online,
    within `timeout` seconds), or how to create it later. Nothing for runs in no group or with
    W&B disabled."""
    if spec is None or mode == "disabled":
        return
    if mode == "online" or spec.get("url"):
        open_view(spec, out_dir, timeout)
    else:
        missing = _workspaces_missing()
        needs = f" ({missing}: {INSTALL})" if missing else ""
        print(f"W&B view: once the runs are synced, create it with `{_later(out_dir)}`{needs}")


def open_view(spec: dict, out_dir: Path, timeout: float = TIMEOUT) -> None:
    """Print the view's URL, creating the view unless the spec records one made before (a second
    view of the same runs would only clutter the project); or one line saying why it could not
    be created and how to try again."""
    if spec.get("url"):
        print(f"W&B view: {spec['url']}")
        return
    try:
        url = create_view(spec, out_dir, timeout)
    except ViewNotCreated as why:
        print(f"W&B view not created ({why}); create it later with `{_later(out_dir)}`")
    else:
        print(f"W&B view: {url}")


def create_view(spec: dict, out_dir: Path, timeout: float = TIMEOUT) -> str:
    """Save the spec as a view of its W&B project and record its URL in the spec's file; the URL.
    W&B is called in a process of its own, ended after `timeout` seconds (wandb_view_process.py).
    Raises ViewNotCreated: without the package, an API key or W&B's API, or past the timeout."""
    missing = _workspaces_missing()
    if missing:
        raise ViewNotCreated(f"{missing}: {INSTALL}")
    if not has_wandb_key():  # W&B's client would ask for one on a terminal
        raise ViewNotCreated("no W&B API key here: `wandb login`")
    url = save_view(spec, timeout)
    with contextlib.suppress(OSError):  # the view stands; only a later report might add another
        write_json_atomically({**spec, "url": url}, out_dir / SPEC_FILE)
    return url


def _workspaces_missing() -> str | None:
    """Why the `wandb_workspaces` package cannot be used here, or None when it can."""
    try:
        import wandb_workspaces.workspaces  # noqa: F401
    except ImportError:
        return "it needs the wandb-workspaces package"
    return None


def _later(out_dir: Path) -> str:
    return f"mpexp-report {shlex.quote(str(out_dir))} --wandb-view"
