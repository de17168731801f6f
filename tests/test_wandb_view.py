"""The sweep's W&B view (mpexp/report/wandb_view.py): the spec that a real sweep writes into
wandb-view.json, checked against its offline W&B runs; the wandb_workspaces Workspace a spec
becomes; the one line printed when W&B cannot be reached, never answers or the package is
missing; and the save itself, against a stand-in for W&B's GraphQL API on this machine."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

import mpexp
from mpexp.models.simplecnn import SimpleCNN
from mpexp.report.runs import Run, load_run
from mpexp.report.wandb_view import (
    INSTALL,
    SEEDS,
    SPEC_FILE,
    WALL_TIME,
    Swept,
    group_by,
    logged_keys,
    result_metric,
    sections,
)
from mpexp.report.wandb_view_process import to_workspace
from mpexp.run.runner import train
from mpexp.tasks.language_model import LanguageModelling
from mpexp.tracking.run_context import RunContext
from tests.conftest import TINY, job_dir, make_cfg, run_cli
from tests.test_wandb import final_run, leet_records

# TINY for one short epoch, W&B and the sweep's keys left to each test
SWEEP = [
    *(o for o in TINY if not o.startswith(("wandb.mode", "optimizer.lr", "trainer.epochs"))),
    "dataset.train_size=256",
    "trainer.epochs=1",
]
FAKE_KEY = "a" * 40


def sweep_of(cwd: Path, *overrides: str) -> tuple[Path, str]:
    result = run_cli("mpexp.train", "-m", *SWEEP, *overrides, cwd=cwd)
    assert result.returncode == 0, result.stderr
    (sweep,) = (cwd / "outputs" / "multirun").glob("*/*")
    return sweep, result.stdout + result.stderr


@pytest.fixture(scope="module")
def offline_sweep(tmp_path_factory) -> tuple[Path, str]:
    """fp32 and bf16, two seeds each, W&B offline (as without network): the sweep and its output."""
    cwd = tmp_path_factory.mktemp("offline")
    return sweep_of(cwd, "wandb.mode=offline", "precision=fp32,bf16", "trainer.seed=0,1")


def view_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "W&B view" in line]


def spec_of(sweep: Path) -> dict:
    return json.loads((sweep / SPEC_FILE).read_text())


def panels(spec: dict, section: str) -> list[dict]:
    (found,) = [s["panels"] for s in spec["sections"] if s["name"] == section]
    return found


def config_value(config: dict, key: str):
    """A dotted key's value in a nested config, as W&B's grouping reads it."""
    for part in key.split("."):
        config = config[part]
    return config


@pytest.mark.slow
def test_a_sweeps_view_groups_by_precision_not_seed_in_the_sweeps_group(offline_sweep):
    sweep, output = offline_sweep
    spec = spec_of(sweep)
    runs = [final_run(leet_records(next((job_dir(sweep, j) / "wandb").glob("offline-run-*"))))
            for j in range(4)]  # fmt: skip

    # filtered to the group and job type the W&B runs have, named after the group
    assert spec["runs"] == {"groups": [runs[0]["run_group"]], "job_type": "train"}
    assert {(r["run_group"], r["job_type"]) for r in runs} == {(spec["name"], "train")}
    # grouped by a config key that the W&B runs hold, whose values are the precisions; the seed,
    # which also varied, is no grouping key, so each precision's seeds make one group
    assert spec["group_by"] == ["ran.precision"]
    assert [config_value(r["config"], "ran.precision") for r in runs] == [
        "fp32", "fp32", "bf16", "bf16"
    ]  # fmt: skip
    assert {config_value(r["config"], "trainer.seed") for r in runs} == {0, 1}
    assert spec["seeds"] == {"line": "mean", "band": "minmax"}

    assert [s["name"] for s in spec["sections"]] == [
        "Bottom line", "Result", "Loss", "Loss scale", "Speed", "Memory"
    ]  # fmt: skip
    (bottom,) = panels(spec, "Bottom line")  # the report's answer, above the figures
    assert bottom["kind"] == "markdown" and "bf16" in bottom["text"]
    result = panels(spec, "Result")
    assert [(p["x"], p["y"]) for p in result] == [("epoch", ["val/acc"]), (WALL_TIME, ["val/acc"])]
    (scale,) = [p for p in panels(spec, "Loss scale") if p["y"] == ["amp/scale"]]
    assert (scale["x"], scale["log_y"]) == ("step", True)
    speed = [(p["kind"], p["y"][0]) for p in panels(spec, "Speed")]
    assert speed == [  # no MFU on a CPU; the data wait as a bar per leg and along the run
        ("bar", "perf/epoch_time_s"), ("bar", "perf/samples_per_s"), ("bar", "perf/tflops"),
        ("bar", "perf/data_wait_s"), ("bar", "perf/data_wait_share"),
        ("line", "perf/data_wait_s"),
    ]  # fmt: skip
    assert {p["kind"] for p in panels(spec, "Memory")} == {"bar"}

    # offline (no network): the sweep ends as before, and one line says how to create the view
    (line,) = view_lines(output)
    assert f"`mpexp-report {sweep} --wandb-view`" in line
    assert "wandb sync" not in line  # the one sync command stays the report's

    # its Workspace groups by the key as W&B stores nested config: {"ran": {"value": {...}}}
    pytest.importorskip("wandb_workspaces")
    model = to_workspace(spec, "someone")._to_model()
    (runset,) = model.spec.section.run_sets
    assert [(k.section, k.name) for k in runset.grouping] == [("config", "ran.value.precision")]


@pytest.mark.slow
def test_a_sweep_that_varied_the_learning_rate_groups_by_both(tmp_path):
    sweep, output = sweep_of(tmp_path, "precision=fp32,bf16", "optimizer.lr=1e-3,3e-3",
                             "wandb.mode=disabled")  # fmt: skip
    spec = spec_of(sweep)  # written with W&B disabled too
    assert spec["group_by"] == ["ran.precision", "optimizer.lr"]
    # the group its runs would have had in W&B
    assert spec["runs"]["groups"] == [f"sweep-{sweep.parent.name}_{sweep.name}"]
    # the config W&B is sent, summary.json's, holds the learning rate where the view looks
    summaries = [json.loads((job_dir(sweep, j) / "summary.json").read_text()) for j in range(4)]
    assert [config_value(s["config"], "optimizer.lr") for s in summaries] == [1e-3, 3e-3] * 2
    assert view_lines(output) == []  # W&B disabled: nothing to say about a view


@pytest.mark.slow
def test_without_network_the_view_costs_one_line(offline_sweep, monkeypatch):
    sweep, _ = offline_sweep
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("WANDB_HTTP_TIMEOUT", "1")
    # W&B's client gives up in about 3 s here ("the service process is busy and did not respond
    # in time"); at exit it waited on its service, which in 2 tries of 11 never ended: the view's
    # process is killed at --view-timeout (60 s) instead
    result = run_cli("mpexp.report", str(sweep), "--wandb-view", cwd=sweep, timeout=180)
    assert result.returncode == 0, result.stderr
    (line,) = view_lines(result.stdout + result.stderr)
    assert line.startswith("W&B view not created (") and line.endswith(" --wandb-view`")
    assert "url" not in spec_of(sweep)


def wandb_services(base_url: str) -> list[int]:
    """The W&B service processes (wandb-core) alive on this machine that talk to `base_url`."""
    found = []
    setting = f"WANDB_BASE_URL={base_url}\0".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (
                b"wandb-core" in (proc / "cmdline").read_bytes()
                and setting in (proc / "environ").read_bytes()
            ):
                found.append(int(proc.name))
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return found


def test_a_server_that_never_answers_costs_the_view_its_timeout_not_the_report(tmp_path):
    """A proxy or firewall that takes W&B's connections and drops them: W&B's client waits 20 s a
    request, and at exit, without a timeout, on its service, which can miss being told to end.
    The report gives the view its --view-timeout, then says so and exits; no service is left."""
    pytest.importorskip("wandb_workspaces")
    spec = {"name": "sweep-a", "entity": None, "project": "mpexp",
            "runs": {"groups": ["sweep-a"], "job_type": "train"}, "group_by": ["ran.precision"],
            "seeds": SEEDS, "max_runs": 10, "sections": sections(["val/acc"], set())}  # fmt: skip
    (tmp_path / SPEC_FILE).write_text(json.dumps(spec))
    # a listening socket that never accepts: the kernel completes each connection, and the
    # request waits there unread
    with socket.create_server(("127.0.0.1", 0), backlog=64) as black_hole:
        url = f"http://127.0.0.1:{black_hole.getsockname()[1]}"
        started = time.monotonic()
        result = run_cli("mpexp.report", str(tmp_path), "--wandb-view", "--view-timeout", "3",
                         cwd=tmp_path, env={"WANDB_API_KEY": FAKE_KEY, "WANDB_BASE_URL": url},
                         timeout=90)  # fmt: skip
        took = time.monotonic() - started
        deadline = time.monotonic() + 5  # the service notices its parent's end within a second
        while wandb_services(url) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = wandb_services(url)
    assert result.returncode == 0, result.stderr
    (line,) = view_lines(result.stdout + result.stderr)
    assert line.startswith("W&B view not created (W&B did not answer within 3 s; --view-timeout")
    assert line.endswith(f"`mpexp-report {tmp_path} --wandb-view`")
    assert took < 15, f"the report took {took:.1f} s"  # about 5 s; W&B's own timeout is 20 s
    assert "url" not in spec_of(tmp_path)
    assert left == []


@pytest.mark.slow
def test_without_the_extra_the_view_costs_one_line(offline_sweep, tmp_path):
    sweep, _ = offline_sweep
    # a wandb_workspaces that cannot be imported, ahead of the installed one
    (tmp_path / "wandb_workspaces").mkdir()
    (tmp_path / "wandb_workspaces" / "__init__.py").write_text(
        "raise ImportError('No module named wandb_workspaces')\n"
    )
    result = run_cli("mpexp.report", str(sweep), "--wandb-view", cwd=tmp_path, pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    (line,) = view_lines(result.stdout + result.stderr)
    assert line.startswith("W&B view not created (") and INSTALL in line

    # the report written again says so too, beside how to create the view later
    out = tmp_path / "report"
    again = run_cli("mpexp.report", str(sweep), "--out", str(out), cwd=tmp_path,
                    pythonpath=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr
    (line,) = view_lines(again.stdout)
    assert INSTALL in line and f"`mpexp-report {out} --wandb-view`" in line


class FakeWandb(BaseHTTPRequestHandler):
    """W&B's GraphQL API as far as saving a view needs it: the signed-in user is `me`, and every
    view sent is kept in `views`."""

    views: ClassVar[list[dict]] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        query = json.loads(body) if self.path == "/graphql" else {}
        if "upsertView" in query.get("query", ""):
            FakeWandb.views.append(query["variables"])
            data = {"upsertView": {"view": {"id": "v1", "name": query["variables"]["name"]}}}
        else:  # the viewer: who the API key belongs to
            data = {"viewer": {"id": "u1", "entity": "me", "username": "me", "email": None,
                               "flags": "{}", "teams": {"edges": []}}}  # fmt: skip
        answer = json.dumps({"data": data}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_wandb(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeWandb)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.server_port}")
    FakeWandb.views = []
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_the_view_is_saved_once_and_its_url_printed(offline_sweep, fake_wandb, tmp_path):
    pytest.importorskip("wandb_workspaces")
    sweep = tmp_path / "sweep"
    shutil.copytree(offline_sweep[0], sweep, symlinks=True)
    result = run_cli("mpexp.report", str(sweep), "--wandb-view", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    (line,) = view_lines(result.stdout + result.stderr)
    assert line.startswith(f"W&B view: {fake_wandb}/me/mpexp?nw=")
    url = line.removeprefix("W&B view: ")
    assert spec_of(sweep)["url"] == url

    (view,) = FakeWandb.views
    spec = spec_of(sweep)
    assert (view["entityName"], view["projectName"]) == ("me", "mpexp")
    assert view["displayName"] == spec["name"]
    saved = json.loads(view["spec"])["section"]
    (runset,) = saved["runSets"]
    assert [(f["key"]["name"], f["value"]) for f in runset["filters"]["filters"]] == [
        ("group", spec["name"]),
        ("jobType", "train"),
    ]
    assert runset["grouping"] == [{"section": "config", "name": "ran.value.precision"}]
    bank = saved["panelBankConfig"]["sections"]
    assert [(s["name"], s["isOpen"]) for s in bank] == [(s["name"], True) for s in spec["sections"]]
    configs = [p["config"] for s in bank for p in s["panels"] if "metrics" in p["config"]]
    (scale,) = [c for c in configs if c["metrics"] == ["amp/scale"]]
    assert scale["yLogScale"] is True
    assert {(c["groupAgg"], c["groupArea"]) for c in configs} == {("mean", "minmax")}

    # the report written again prints the view it has, and adds no second one to the project
    again = run_cli("mpexp.report", str(sweep), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert view_lines(again.stdout) == [f"W&B view: {url}"]
    assert len(FakeWandb.views) == 1 and spec_of(sweep)["url"] == url


def test_a_spec_becomes_a_workspace_with_closed_diagnostics():
    pytest.importorskip("wandb_workspaces")
    logged = {"perf/epoch_time_s", "mem/peak_rss_mib", "diag/total/underflow", "diag/fc/underflow"}
    spec = {
        "name": "sweep-a, sweep-b",
        "entity": None,
        "project": "mpexp",
        "runs": {"groups": ["sweep-a", "sweep-b"], "job_type": "train"},
        "group_by": ["ran.precision", "optimizer.lr"],
        "seeds": {"line": "mean", "band": "minmax"},
        "max_runs": 24,
        "sections": [
            {"name": "Bottom line", "open": True, "panels": [
                {"kind": "markdown", "title": "Bottom line", "text": "- **bf16**: use it"}]},
            *sections(["val/loss"], logged),
        ],
    }  # fmt: skip
    workspace = to_workspace(spec, "someone")
    # report.md's bottom line first, as W&B's Markdown panel, which W&B's model takes
    workspace._to_model()
    (bottom,) = workspace.sections.pop(0).panels
    assert (type(bottom).__name__, bottom.markdown) == ("MarkdownPanel", "- **bf16**: use it")
    assert (workspace.entity, workspace.project, workspace.name) == (
        "someone",
        "mpexp",
        spec["name"],
    )
    assert [(s.name, s.is_open) for s in workspace.sections] == [
        ("Result", True), ("Loss", True), ("Loss scale", True), ("Speed", True), ("Memory", True),
        ("Diagnostics", False),
    ]  # fmt: skip
    # the whole model's diagnostics; the per-layer ones are report.md's underflow plot
    (diagnostic,) = workspace.sections[-1].panels
    assert diagnostic.y == ["diag/total/underflow"]
    lines = [p for s in workspace.sections for p in s.panels]
    assert {(p.groupby_aggfunc, p.groupby_rangefunc) for p in lines} == {("mean", "minmax")}
    assert [p.y for p in workspace.sections[0].panels] == [["val/loss"], ["val/loss"]]
    assert workspace.settings.max_runs == 24

    model = workspace._to_model()  # what save() would send
    (runset,) = model.spec.section.run_sets
    group, job_type = runset.filters["filters"]
    assert (group["key"]["name"], group["op"], group["value"]) == (
        "group",
        "IN",
        spec["runs"]["groups"],
    )
    assert (job_type["key"]["name"], job_type["value"]) == ("jobType", "train")
    assert [k.name for k in runset.grouping] == ["ran.value.precision", "optimizer.value.lr"]


def test_diagnostics_appear_only_when_logged():
    names = [s["name"] for s in sections(["val/acc"], {"perf/epoch_time_s", "mem/peak_rss_mib"})]
    assert names == ["Result", "Loss", "Loss scale", "Speed", "Memory"]


class LogsItsOwn(SimpleCNN):
    """A user's model that logs values of its own: a number and a nested dict, with a string
    (which cannot be plotted)."""

    def forward(self, x):
        if self.training:
            mpexp.log({"my/absmax": x.abs().max(), "my": {"layer": {"mean": 0.5}}, "my/note": "ok"})
        return super().forward(x)


def test_the_view_shows_loss_curves_learning_rate_data_wait_and_the_users_values(tmp_path):
    """From a run's own metrics: train/loss by step, val/loss by epoch, the learning rate, the
    data wait (when logged) and each number the user logged with mpexp.log, by step; read back
    from the Workspace a spec becomes, as W&B would be sent it."""
    model = "model._target_=tests.test_wandb_view.LogsItsOwn"
    train(make_cfg(*TINY, model, "trainer.epochs=1"), RunContext(tmp_path))
    logged = logged_keys([load_run(tmp_path)])
    spec = {"name": "sweep-a", "entity": None, "project": "mpexp",
            "runs": {"groups": ["sweep-a"], "job_type": "train"}, "group_by": ["ran.precision"],
            "seeds": {"line": "mean", "band": "minmax"}, "max_runs": 10,
            "sections": sections(["val/acc"], logged)}  # fmt: skip
    assert [(p["title"], p["x"], p["y"]) for p in panels(spec, "Loss")] == [
        ("train/loss by step", "step", ["train/loss"]),
        ("val/loss by epoch", "epoch", ["val/loss"]),
        ("learning rate", "step", ["lr"]),
    ]
    own = panels(spec, "Your values (mpexp.log)")
    assert [(p["x"], p["y"]) for p in own] == [("step", ["my/absmax"]), ("step", ["my/layer/mean"])]
    speed = [p["y"][0] for p in panels(spec, "Speed")]
    if "perf/data_wait_s" in logged:  # once the loop logs it (issue 38)
        assert "perf/data_wait_s" in speed and "perf/data_wait_share" in speed

    pytest.importorskip("wandb_workspaces")
    workspace = to_workspace(spec, "someone")
    by_name = {s.name: s for s in workspace.sections}
    assert [(p.x, p.y) for p in by_name["Loss"].panels] == [
        ("step", ["train/loss"]),
        ("epoch", ["val/loss"]),
        ("step", ["lr"]),
    ]
    assert [p.y for p in by_name["Your values (mpexp.log)"].panels] == [
        ["my/absmax"], ["my/layer/mean"]
    ]  # fmt: skip


def test_many_values_of_the_users_own_start_closed():
    many = {f"my/v{i:02d}" for i in range(13)}
    (own,) = [s for s in sections(["val/acc"], many) if s["name"] == "Your values (mpexp.log)"]
    assert own["open"] is False and len(own["panels"]) == 13


def test_the_result_is_the_tasks_metric_or_val_acc():
    task = {"name": "language_model", **LanguageModelling.result.record(), "block_size": 64}
    assert result_metric(Run(Path("lm"), "finished", summary={"ran": {"task": task}})) == "val/loss"
    assert result_metric(Run(Path("cnn"), "finished", summary={"ran": {}})) == "val/acc"


def test_pure_bf16s_lost_updates_get_a_section_and_its_roundings_a_group_each():
    logged = {"perf/epoch_time_s", "opt/updates_lost"}
    found = {s["name"]: s["panels"] for s in sections(["val/acc"], logged)}
    assert [p["y"] for p in found["Updates lost"]] == [["opt/updates_lost"]]

    def run(name: str, rounding: str | None) -> Run:
        ran = {"precision": "bf16_pure" if rounding else "fp32", "update_rounding": rounding}
        return Run(Path(name), "finished", summary={"ran": ran}, overrides=[f"precision={name}"])

    runs = [run("fp32", None), run("bf16_pure", "nearest"), run("bf16_pure_kahan", "kahan")]
    assert group_by(runs)[:2] == ["ran.precision", "ran.update_rounding"]


def test_a_sweep_over_a_numeric_key_gets_its_result_against_that_key():
    """report.md's sweep_<key>.png as a panel of the view: each run's final result (its W&B
    summary's last value) against the key in its config, on a log axis; a step-budget sweep's
    validation values by step."""
    swept = Swept(wandb_key="optimizer.lr", key="optimizer.lr", log=True)
    found = {s["name"]: s["panels"] for s in sections(["val/loss"], set(), swept, "step")}
    assert [(p["kind"], p["x"], p["y"]) for p in found["Result"]] == [
        ("line", "step", ["val/loss"]),
        ("line", WALL_TIME, ["val/loss"]),
        ("scatter", "optimizer.lr", ["val/loss.last"]),
    ]
    assert [p["x"] for p in found["Loss"]] == ["step", "step"]

    pytest.importorskip("wandb_workspaces")
    spec = {"name": "sweep-a", "entity": None, "project": "mpexp",
            "runs": {"groups": ["sweep-a"], "job_type": "train"},
            "group_by": ["ran.precision", "optimizer.lr"], "seeds": SEEDS, "max_runs": 10,
            "sections": sections(["val/loss"], set(), swept)}  # fmt: skip
    scatter = to_workspace(spec, "someone").sections[0].panels[2]._to_model().config
    # the W&B run's config holds optimizer.lr nested, as the grouping reads it
    assert scatter.x_axis == "config:optimizer.value.lr"
    assert scatter.y_axis == "summary:val/loss.last"
    assert scatter.x_axis_log_scale is True
