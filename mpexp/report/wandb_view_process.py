"""The sweep's W&B view saved in a process of its own, which the report ends at its deadline.

W&B's client cannot be bounded from inside: `wandb.Api()` starts W&B's service process and waits
on it, call by call, with timeouts of its own, and at interpreter exit it waits, without any
timeout, for that service to end. Where a request was given up (no network, a server that never
answers), the service can miss the request to end and live on, and the process that used the API
with it: a sweep's report that had printed all it had to say did not exit (wandb 0.31, W&B's base
URL refusing connections: 2 tries of 11 on a shared 2-core machine). So the report never calls
W&B for the view itself. `save_view` starts this file as a process, writes it the view's spec
(JSON) on stdin and reads one answer on stdout, a JSON line `[kind, payload]`: `saved` with the
view's URL, or `failed` with why. An answer that has not come by the deadline is not waited for:
the process is killed, and W&B's service, which watches the process that started it, ends with
it.

The file imports only the standard library (and wandb and wandb_workspaces, once asked to save)
and runs by its path, as tracking/wandb_process.py does, so that it starts wherever the report
runs: installed, from a checkout, or from a script that put mpexp on sys.path.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from typing import Any

# Run as a script, not as `-m mpexp.report.wandb_view_process`: the package need not be on the
# child's path.
_RUN_BY_PATH = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
# seconds W&B may take to save the view (mpexp-report --view-timeout); a network that drops W&B's
# requests would otherwise hold the report for many minutes
TIMEOUT = 60.0


class ViewNotCreated(Exception):
    """The view could not be saved; the message says why, in a few words."""


def save_view(spec: dict, timeout: float = TIMEOUT) -> str:
    """Save the spec as a view of its W&B project, in a process of its own; the view's URL.
    Raises ViewNotCreated: W&B's API failed, or gave no answer within `timeout` seconds."""
    with subprocess.Popen(
        [sys.executable, "-c", _RUN_BY_PATH, __file__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # W&B's own chatter; the answer says why it failed
        env={**os.environ, "WANDB_SILENT": os.environ.get("WANDB_SILENT", "true")},
    ) as child:
        try:
            out, _ = child.communicate(json.dumps(spec).encode(), timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ViewNotCreated(
                f"W&B did not answer within {timeout:g} s; --view-timeout gives it longer"
            ) from None
        finally:
            if child.poll() is None:  # timed out, or this process was interrupted
                child.kill()
    try:
        kind, payload = json.loads(out)
    except (TypeError, ValueError):
        said = f"its process ended without an answer (exit code {child.returncode})"
        raise ViewNotCreated(said) from None
    if kind != "saved":
        raise ViewNotCreated(payload)
    return payload


def to_workspace(spec: dict, entity: str) -> Any:
    """The spec as a `wandb_workspaces` Workspace of `entity`, not yet saved (no network)."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    groups = spec["runs"]["groups"]
    in_group = (
        ws.Metric("Group") == groups[0] if len(groups) == 1 else ws.Metric("Group").isin(groups)
    )
    return ws.Workspace(
        entity=entity,
        project=spec["project"],
        name=spec["name"],
        sections=[
            ws.Section(
                name=section["name"],
                is_open=section["open"],
                panels=[_panel(wr, panel, spec["seeds"]) for panel in section["panels"]],
            )
            for section in spec["sections"]
        ],
        settings=ws.WorkspaceSettings(max_runs=spec["max_runs"]),
        runset_settings=ws.RunsetSettings(
            filters=[in_group, ws.Metric("JobType") == spec["runs"]["job_type"]],
            groupby=[ws.Config(key) for key in spec["group_by"]],
        ),
    )


def _panel(wr: Any, panel: dict, seeds: dict) -> Any:
    """One panel; a group's runs (its seeds) drawn as their mean with a band from min to max, or
    the bottom line's text."""
    if panel["kind"] == "markdown":  # the report's bottom line
        return wr.MarkdownPanel(markdown=panel["text"])
    grouped = {"groupby_aggfunc": seeds["line"], "groupby_rangefunc": seeds["band"]}
    if panel["kind"] == "bar":
        return wr.BarPlot(title=panel["title"], metrics=panel["y"], **grouped)
    if panel["kind"] == "scatter":  # a point per run: a summary value against a config value
        return wr.ScatterPlot(
            title=panel["title"],
            x=wr.Config(panel["x"]),
            y=wr.SummaryMetric(panel["y"][0]),
            log_x=panel["log_x"],
        )
    return wr.LinePlot(
        title=panel["title"], x=panel["x"], y=panel["y"], log_y=panel["log_y"], **grouped
    )


# --- the view's process itself ---------------------------------------------------------------


def _save(spec: dict) -> tuple[str, str]:
    try:
        import wandb

        entity = spec["entity"] or wandb.Api().default_entity
        workspace = to_workspace(spec, entity)
        with contextlib.redirect_stderr(io.StringIO()):  # W&B's own "View saved" line
            return "saved", workspace.save().url
    except Exception as err:  # W&B's API failing costs the view, never the report
        said = str(err).strip().splitlines() or [type(err).__name__]
        return "failed", said[0][:200]


def main() -> None:
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    # W&B's service inherits stdout: pointed elsewhere, it cannot hold the answers' pipe open
    # after this process has ended
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    answers.write(json.dumps(_save(json.load(sys.stdin))) + "\n")
    answers.flush()
    # Not W&B's exit hook: it waits for W&B's service to end, without a timeout, and a service
    # that gave up a request can miss being told to. The service ends when this process does.
    os._exit(0)


if __name__ == "__main__":
    main()
