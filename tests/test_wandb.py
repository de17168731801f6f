"""A training run's offline W&B run holds its history, read back from the run's own files; W&B
runs in a process of its own (mpexp/tracking/wandb_process.py) that outlives neither a finished nor
a killed training run, and whose loss does not stop training."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import mpexp
from mpexp.errors import LogError
from mpexp.models.simplecnn import SimpleCNN
from mpexp.report.runs import load_run
from mpexp.run.runner import train
from mpexp.tasks.classification import Classification
from mpexp.tracking.run_context import RunContext
from mpexp.tracking.tracker import Tracker
from mpexp.tracking.wandb_process import WandbProcess
from tests.conftest import ROOT, TINY, make_cfg, run_cli
from tests.test_resume import ARGS, start_cli, status, wait_for


def leet_records(wandb_run_dir: Path) -> list[dict]:
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(wandb_run_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def history(records: list[dict]) -> list[dict]:
    return [r["history"]["item"] for r in records if r["type"] == "history"]


def final_run(records: list[dict]) -> dict:
    """The W&B run as its page shows it at the end: the last run record (its name, group and
    tags, which a run may set after it started), with every config update merged in."""
    runs = [r["run"] for r in records if r["type"] == "run"]
    config = {}
    for r in records:
        if r["type"] in ("run", "config"):
            config.update((r.get("run") or r)["config"]["update"])
    return {**runs[-1], "config": config}


# the smallest run that shows what these tests read: 4 steps an epoch, two validation batches
SMALL = [*TINY, "dataset.train_size=256"]


@pytest.fixture(scope="session")
def offline_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """An fp16 run of 3 epochs with its W&B run offline, and that W&B run's records: made once,
    read by several tests (none writes to it)."""
    run_dir = tmp_path_factory.mktemp("offline_run")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_SILENT", "true")
        run = RunContext(run_dir, name="wandb-test", group="g")
        train(make_cfg(*SMALL, "precision=fp16", "trainer.epochs=3", "wandb.mode=offline"), run)
    (wandb_dir,) = (run_dir / "wandb").glob("offline-run-*")
    return run_dir, leet_records(wandb_dir)


def test_offline_run_holds_loss_scale_and_epoch_time(offline_run):
    run_dir, records = offline_run
    rows = history(records)
    steps = [r for r in rows if "train/loss" in r]
    epochs = [r for r in rows if "perf/epoch_time_s" in r]
    assert len(steps) == 3 * 4 and len(epochs) == 3
    assert all(r["amp/scale"] == 65536.0 for r in steps[:5])

    local = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    local_steps = [r for r in local if "train/loss" in r]
    assert [r["train/loss"] for r in steps] == [r["train/loss"] for r in local_steps]
    assert [r["perf/epoch_time_s"] for r in epochs] == [
        r["perf/epoch_time_s"] for r in local if "perf/epoch_time_s" in r
    ]

    run_record = final_run(records)
    assert run_record["display_name"] == "wandb-test" and run_record["run_group"] == "g"
    ran = run_record["config"]["ran"]
    assert ran["precision"] == "fp16" and ran["loss_scaling"] == "dynamic"
    assert {"precision=fp16", "loss_scaling=dynamic"} <= set(run_record["tags"])


def final_summary(records: list[dict]) -> dict:
    """The W&B run's summary at the end: every summary update merged, W&B's own keys left out."""
    summary = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"]["update"])
    return {k: v for k, v in summary.items() if not k.startswith("_")}


def epoch_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "epoch" in r]


def test_summary_holds_best_and_last_and_what_ran_only_in_the_config(offline_run):
    run_dir, records = offline_run
    epochs = epoch_rows(run_dir)
    summary = final_summary(records)
    accs, losses = [e["val/acc"] for e in epochs], [e["val/loss"] for e in epochs]
    # the last epoch's value, which the report and Optuna's sweeper use, beside the best
    assert summary["val/acc"] == {"max": max(accs), "last": accs[-1]}
    assert summary["val/loss"] == {"min": min(losses), "last": losses[-1]}
    # what ran is in the config, complete (the final scale, counted FLOPs), not in the summary
    assert not [k for k in summary if k.startswith("ran")]
    local = json.loads((run_dir / "summary.json").read_text())
    assert final_run(records)["config"]["ran"] == local["ran"]


def test_checkpoints_go_to_wandb_as_artifacts_only_when_asked(offline_run, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    _, records = offline_run  # wandb.log_checkpoints left at its default, false
    assert not [r for r in records if r["type"] == "artifact"]

    train(
        make_cfg(*SMALL, "wandb.mode=offline", "wandb.log_checkpoints=true"), RunContext(tmp_path)
    )
    (wandb_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    artifacts = [r["artifact"] for r in leet_records(wandb_dir) if r["type"] == "artifact"]
    models = [a for a in artifacts if a.get("type") == "model"]
    assert len(models) == 2  # one checkpoint per epoch
    assert "step-8" in models[-1]["aliases"] and "latest" in models[-1]["aliases"]


def offline_tracker(run_dir: Path, wandb_id: str | None = None) -> Tracker:
    """A Tracker whose W&B run is offline in run_dir (continuing `wandb_id`'s when given)."""
    wandb_cfg = OmegaConf.create(
        {"mode": "offline", "project": "mpexp-test", "entity": None, "tags": [], "init_timeout": 90}
    )
    return Tracker(RunContext(run_dir, wandb_id=wandb_id), {}, wandb_cfg, Classification)


def test_checkpoint_artifacts_say_what_they_hold_and_which_is_best(tmp_path):
    """Each epoch's checkpoint carries its epoch, step, val metrics and precision; `best` goes to
    the best val/acc epoch's so far, also across a resume; a mid-epoch one has no val metrics."""
    checkpoint = tmp_path / "step.pt"
    checkpoint.write_bytes(b"weights")

    def epochs(tracker: Tracker, accs: dict[int, float]) -> None:
        tracker.record_ran({"precision": "bf16", "loss_scaling": "none"})
        for epoch, acc in accs.items():
            tracker.log({"step": 10 * epoch - 5, "train/loss": 1.0})
            tracker.log_checkpoint(checkpoint, 10 * epoch - 5)  # trainer.checkpoint_every_steps
            tracker.log({"epoch": epoch, "step": 10 * epoch, "val/acc": acc, "val/loss": 1 - acc})
            tracker.log_checkpoint(checkpoint, 10 * epoch)
        tracker.close()

    first = offline_tracker(tmp_path)
    epochs(first, {1: 0.5, 2: 0.9, 3: 0.7})
    epochs(offline_tracker(tmp_path, wandb_id=first.wandb_id), {4: 0.8, 5: 0.95})  # resumed

    logged = []
    for wandb_dir in sorted((tmp_path / "wandb").glob("offline-run-*")):
        logged += [r["artifact"] for r in leet_records(wandb_dir) if r["type"] == "artifact"]
    at_epoch_end = [a for a in logged if json.loads(a["metadata"]).get("epoch")]
    assert [json.loads(a["metadata"]) for a in at_epoch_end][:2] == [
        {"step": 10, "precision": "bf16", "epoch": 1, "val/acc": 0.5, "val/loss": 0.5},
        {"step": 20, "precision": "bf16", "epoch": 2, "val/acc": 0.9, "val/loss": 1 - 0.9},
    ]
    best = [json.loads(a["metadata"])["epoch"] for a in at_epoch_end if "best" in a["aliases"]]
    assert best == [1, 2, 5]  # not 3 (0.7), nor 4 (0.8 after a resume, below epoch 2's 0.9)
    assert all({"latest", f"step-{json.loads(a['metadata'])['step']}"} <= set(a["aliases"])
               for a in logged)  # fmt: skip
    mid_epoch = [json.loads(a["metadata"]) for a in logged if a not in at_epoch_end]
    assert mid_epoch[0] == {"step": 5, "precision": "bf16"} and len(mid_epoch) == 5


class SelfLoggingCNN(SimpleCNN):
    """A user's model that logs a value of its own at every training step, through mpexp.log."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwards = 0

    def forward(self, x):
        if self.training:  # the FLOP count's pass, also in training mode, logs nothing
            self.forwards += 1
            mpexp.log({"user/forwards": self.forwards, "user/note": "ok"})
        return super().forward(x)


def test_users_own_values_reach_metrics_and_the_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    model = "model._target_=tests.test_wandb.SelfLoggingCNN"
    train(make_cfg(*SMALL, model, "wandb.mode=offline"), RunContext(tmp_path))

    local = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    own = [r for r in local if "user/forwards" in r]
    # one row per training step, at that step (one forward pass each), in metrics.jsonl ...
    assert [(r["step"], r["user/forwards"]) for r in own] == [(s, s) for s in range(1, 9)]
    (wandb_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    records = leet_records(wandb_dir)
    # ... and in the same W&B run, plotted against `step`
    logged = [r for r in history(records) if "user/forwards" in r]
    assert [(r["step"], r["user/forwards"], r["user/note"]) for r in logged] == [
        (s, s, "ok") for s in range(1, 9)
    ]
    axes = {r["metric"].get("name"): r["metric"].get("step_metric")
            for r in records if r["type"] == "metric"}  # fmt: skip
    assert axes["user/forwards"] == axes["user/note"] == "step"

    mpexp.log({"user/after": 1.0})  # no run any more: nothing happens
    assert "user/after" not in (tmp_path / "metrics.jsonl").read_text()


class TensorLoggingCNN(SimpleCNN):
    """A user's model that logs values of its forward pass as tensors, as they are (no .item()):
    each step a float32 absmax, a bfloat16 mean and a counter buffer that changes in place after
    the call, then a second row with a NaN and infinities; in validation an absmax of its own.
    What the values were when logged is kept on the class, read eagerly, for the test."""

    logged: ClassVar[list[tuple[float, float]]] = []  # (absmax, mean) of each training step

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x):
        if self.training:
            absmax, mean = x.abs().max(), x.mean().to(torch.bfloat16)
            self.calls += 1
            mpexp.log({"my/absmax": absmax, "my/mean": mean, "my/calls": self.calls})
            self.calls += 100  # after the call: the row keeps the value it was logged with
            mpexp.log({"my/nan": torch.full((), math.nan), "my/inf": -math.inf, "my/note": "ok"})
            if x.device.type != "meta":  # the FLOP count's pass has no values to read
                TensorLoggingCNN.logged.append((absmax.item(), mean.item()))
        else:
            mpexp.log({"my/val_absmax": x.abs().max()})
        return super().forward(x)


def test_tensor_values_are_logged_as_computed_without_a_read_per_step(tmp_path, monkeypatch):
    """Each step's tensors, read back once per trainer.log_every steps (tests/test_host_reads.py
    counts the reads), land in metrics.jsonl and the W&B run with the values they had when
    logged; NaN and infinities as they are, readable by the report; values logged in validation
    by the checkpoint that follows it."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    # the class the run builds: pytest imports this file under another module name
    made = importlib.import_module("tests.test_wandb").TensorLoggingCNN
    monkeypatch.setattr(made, "logged", [])
    model = "model._target_=tests.test_wandb.TensorLoggingCNN"
    train(make_cfg(*SMALL, model, "wandb.mode=offline"), RunContext(tmp_path))

    local = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    own = [r for r in local if "my/absmax" in r]
    steps = range(1, 9)
    assert [r["step"] for r in own] == list(steps)
    assert [(r["my/absmax"], r["my/mean"]) for r in own] == made.logged
    assert [r["my/calls"] for r in own] == [1 + 101 * (s - 1) for s in steps]
    special = [r for r in local if "my/nan" in r]
    assert [r["step"] for r in special] == list(steps)
    assert all(math.isnan(r["my/nan"]) and r["my/inf"] == -math.inf for r in special)
    assert all(r["my/note"] == "ok" for r in special)
    # two validation batches an epoch, at the epoch's last step, written by its checkpoint
    assert [r["step"] for r in local if "my/val_absmax" in r] == [4, 4, 8, 8]
    assert "NaN" in (tmp_path / "metrics.jsonl").read_text()  # as Python's json writes it
    assert load_run(tmp_path).problem is None  # the report reads the file, NaN and all

    (wandb_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    logged = history(leet_records(wandb_dir))
    assert [(r["step"], r["my/absmax"], r["my/calls"]) for r in logged if "my/absmax" in r] == [
        (r["step"], r["my/absmax"], r["my/calls"]) for r in own
    ]
    # in the W&B run as numbers that are not finite, which its JSON dump spells as strings
    special = [(r["my/nan"], r["my/inf"]) for r in logged if "my/nan" in r]
    assert special == [("NaN", "-Infinity")] * 8


class FailsAtStep7(SimpleCNN):
    """A user's model that logs a tensor every step and fails in the 7th step's forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = 0

    def forward(self, x):
        if self.training:
            self.steps += 1
            if self.steps == 7:
                raise RuntimeError("the user's model failed")
            mpexp.log({"my/absmax": x.abs().max()})
        return super().forward(x)


def test_a_failing_run_writes_the_values_logged_before_it_failed(tmp_path):
    """Steps 1-4 are on their way to the host (read at the next flush, which never comes), steps
    5-6 wait in the tracker: all are written, in order, as the run fails."""
    model = "model._target_=tests.test_wandb.FailsAtStep7"
    with pytest.raises(RuntimeError, match="the user's model failed"):
        train(make_cfg(*TINY, model), RunContext(tmp_path))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "my/absmax" in r] == [1, 2, 3, 4, 5, 6]


def disabled_tracker(run_dir: Path) -> Tracker:
    return Tracker(RunContext(run_dir), {}, OmegaConf.create({"mode": "disabled"}), Classification)


@pytest.mark.parametrize(
    ("values", "said"),
    [
        ({3: 1.0}, "3 cannot be a key; name values with strings"),
        ({"my": {4: 1.0}}, "4 cannot be a key; name values with strings"),
        ({"step": 3}, "'step' is one of mpexp's own metric names"),
        ({"train/loss": "oops"}, "'train/loss' is one of mpexp's own metric names"),
        ({"val/my_acc": 0.5}, "choose another prefix for your values, e.g. 'my/val/my_acc'"),
        ({"val": {"acc": 0.5}}, "'val/acc' is one of mpexp's own metric names"),
        ({"lr": torch.ones(())}, "'lr' is one of mpexp's own metric names"),
        ([0.5], "it takes a dict of values, not list"),
    ],
    ids=["key", "nested-key", "step", "train", "val", "nested-val", "lr", "not-a-dict"],
)
def test_own_names_that_cannot_be_logged_are_named_with_the_call(tmp_path, values, said):
    tracker = disabled_tracker(tmp_path)
    try:
        with pytest.raises(LogError) as refused:
            mpexp.log(values)  # the call the message names
    finally:
        tracker.close()
    assert said in str(refused.value)
    call = refused.traceback[0]  # this test's line that called mpexp.log
    assert str(refused.value).endswith(f"(mpexp.log called at {call.path}:{call.lineno + 1})")
    assert not (tmp_path / "metrics.jsonl").read_text()  # nothing of the call was written


def test_real_numbers_of_any_kind_and_nested_dicts_are_logged(tmp_path):
    """NumPy scalars and 0-d arrays, one-element tensors and arrays, Python's bools and ints, as
    numbers in metrics.jsonl; a nested dict's keys joined by '/'."""
    tracker = disabled_tracker(tmp_path)
    try:
        mpexp.log({"my/f32": np.float32(0.5), "my/i64": np.int64(3), "my/flag": np.bool_(True)})
        mpexp.log({"my/zero_d": np.array(0.25), "my/one": np.array([1.5], dtype=np.float16)})
        mpexp.log({"my/tensor": torch.tensor([0.125]), "my/ok": True, "my/n": 7})
        mpexp.log({"my": {"layer": {"absmax": 2.0}, "norm": np.float64(4.0)}})
    finally:
        tracker.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 0, "my/f32": 0.5, "my/i64": 3, "my/flag": True},
        {"step": 0, "my/zero_d": 0.25, "my/one": 1.5},
        {"step": 0, "my/tensor": 0.125, "my/ok": True, "my/n": 7},
        {"step": 0, "my/layer/absmax": 2.0, "my/norm": 4.0},
    ]


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (torch.ones(3), "'my/x' is a tensor of shape (3,); pass one value"),
        (torch.ones((), dtype=torch.complex64), "'my/x' is a torch.complex64 tensor"),
        (np.ones((2, 2)), "'my/x' is an array of shape (2, 2); pass one value"),
        (np.complex64(1j), "the value of 'my/x' is a complex64; pass a real number"),
        ([1.0], "the value of 'my/x' is a list; pass a real number"),
        (None, "the value of 'my/x' is a NoneType; pass a real number"),
    ],
    ids=["tensor-shape", "complex-tensor", "array-shape", "numpy-complex", "list", "none"],
)
def test_a_value_that_cannot_be_logged_is_dropped_with_one_warning_naming_the_call(
    tmp_path, caplog, value, said
):
    """The call's other values are logged; the run goes on; a call made every step warns once."""
    tracker = disabled_tracker(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="mpexp"):
            for _ in range(3):
                line = sys._getframe().f_lineno + 1
                mpexp.log({"my/x": value, "my/kept": 1.0})
    finally:
        tracker.close()
    (warning,) = [r.getMessage() for r in caplog.records if "mpexp.log" in r.getMessage()]
    assert said in warning and f"(called at {__file__}:{line};" in warning
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "my/kept": 1.0}] * 3


def test_own_values_wait_in_call_order_and_are_written_at_the_end(tmp_path):
    """Outside the loop (no flush to read them), rows held behind a tensor are written by the
    end of the run, in the order they were logged; a `step=` of the call's own is kept."""
    tracker = disabled_tracker(tmp_path)
    try:
        mpexp.log({"my/x": 0.5}, step=7)
        mpexp.log({"my/x": torch.tensor(0.25, dtype=torch.float16)}, step=8)
        mpexp.log({"my/x": 0.125}, step=9)
        mpexp.log({"my/x": torch.ones((), device="meta")}, step=10)  # a shapes-only pass: left out
    finally:
        tracker.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 7, "my/x": 0.5}, {"step": 8, "my/x": 0.25}, {"step": 9, "my/x": 0.125}]


class LogsItsInput(torch.nn.Module):
    def forward(self, x):
        mpexp.log({"my/absmax": x.abs().max()})
        return x * 2


def test_a_call_from_a_compiled_forward_runs_as_python_and_quietly(tmp_path, recwarn):
    """torch.compile does not trace into mpexp.log (it warned about os.getpid): the call is a
    graph break that runs it as plain Python, with the value the eager forward logs."""
    compiled = torch.compile(LogsItsInput(), backend="eager")
    x = torch.randn(4, 3)
    tracker = disabled_tracker(tmp_path)
    try:
        compiled(x)
    finally:
        tracker.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "my/absmax": x.abs().max().item()}]
    assert not [str(w.message) for w in recwarn if "trace" in str(w.message)]


def test_the_training_process_never_imports_wandb(tmp_path):
    """wandb's import and start (over a second of work) run in the W&B process, on another core,
    not in the training process, where they held up its start and first epoch."""
    code = (
        "import sys; from mpexp.run.runner import train; "
        "from mpexp.tracking.run_context import RunContext; "
        "from tests.conftest import TINY, make_cfg; "
        "small = [*TINY, 'dataset.train_size=256', 'wandb.mode=offline']; "
        f"train(make_cfg(*small), RunContext({str(tmp_path)!r})); "
        "print('wandb imported:', 'wandb' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "wandb imported: False" in out.stdout
    (wandb_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert len([r for r in history(leet_records(wandb_dir)) if "train/loss" in r]) == 2 * 4


def wandb_exit(where: Path, timeout: float = 120) -> dict:
    """The exit record of the W&B run in `where` (its directory, or the run's wandb/ folder
    holding it), once W&B's process has written it; the run's records with it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = (
            [where]
            if where.name.startswith("offline-run-")
            else sorted(where.glob("offline-run-*"))
        )
        try:
            records = leet_records(runs[0]) if runs else []
        except subprocess.CalledProcessError:  # its file has not been started yet
            records = []
        exits = [r["exit"] for r in records if r["type"] == "exit"]
        if exits:
            return {"exit": exits[0], "records": records}
        time.sleep(0.5)
    raise AssertionError(f"no W&B exit record in {where}")


def training_with_wandb(tmp_path: Path, epochs: int, rows: int) -> tuple[subprocess.Popen, Path]:
    """A training run with W&B offline, from the command line, once it has logged `rows` rows."""
    run_dir = tmp_path / "run"
    args = [a for a in ARGS if a != "wandb.mode=disabled"]
    overrides = [
        *args,
        f"trainer.epochs={epochs}",
        "wandb.mode=offline",
        f"hydra.run.dir={run_dir}",
    ]
    proc = start_cli(*overrides, cwd=tmp_path, env={"WANDB_MODE": "offline"})
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= rows, proc)
    return proc, run_dir


def wandb_rows_so_far(run_dir: Path) -> int:
    """How many history rows the W&B run of a run that is still training has written so far."""
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    try:
        return len(history(leet_records(runs[0]))) if runs else 0
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, ValueError):
        return 0  # its file is not started yet, or is being written: the next look reads it


def test_a_killed_training_run_leaves_a_finished_wandb_run_with_its_rows(tmp_path):
    proc, run_dir = training_with_wandb(tmp_path, epochs=200, rows=6)
    metrics = run_dir / "metrics.jsonl"
    # Rows the training process logged in the instant before a SIGKILL may still be queued in it,
    # never sent (on a loaded machine all of a first burst of rows was). What is asserted is that
    # the rows that reached W&B's process survive the kill: so kill once W&B has written some.
    wait_for(lambda: wandb_rows_so_far(run_dir) >= 3, proc)
    proc.kill()  # SIGKILL: no handler, no checkpoint, no goodbye to W&B
    proc.communicate(timeout=60)

    # W&B's process goes on: it may still be starting the W&B run, then finishes it
    ended = wandb_exit(run_dir / "wandb")
    assert ended["exit"]["exit_code"] == 1  # W&B shows it failed, not running forever
    logged = [r["train/loss"] for r in history(ended["records"]) if "train/loss" in r]
    local = [json.loads(x) for x in metrics.read_text().splitlines()]
    local = [r["train/loss"] for r in local if "train/loss" in r]
    assert len(logged) >= 3 and logged == local[: len(logged)]


def wandb_process_of(proc: subprocess.Popen) -> int:
    """The pid of the training process's W&B process (its child running wandb_process.py)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == proc.pid and b"wandb_process.py" in cmdline:
            return int(pid)
    raise AssertionError("no W&B process")


def test_training_goes_on_when_the_wandb_process_dies(tmp_path):
    proc, run_dir = training_with_wandb(tmp_path, epochs=6, rows=1)
    metrics = run_dir / "metrics.jsonl"
    os.kill(wandb_process_of(proc), signal.SIGKILL)
    output, _ = proc.communicate(timeout=300)

    assert proc.returncode == 0, output
    assert "Traceback" not in output
    assert output.count("W&B's process ended early (exit code -9)") == 1
    assert str(run_dir / "wandb" / "process.log") in output
    assert status(run_dir) == "finished"
    epochs = [json.loads(x) for x in metrics.read_text().splitlines() if '"epoch"' in x]
    assert [r["epoch"] for r in epochs] == [1, 2, 3, 4, 5, 6]


def wandb_process(tmp_path: Path, problems: list, **settings) -> WandbProcess:
    """The W&B process of an offline run in tmp_path, its problems appended to `problems`."""
    start = {
        "init": {"project": "mpexp-test", "dir": str(tmp_path), "mode": "offline"},
        "settings": {"silent": True, **settings},
        "argv": ["test"],
        "metrics": [],
    }
    return WandbProcess(start, tmp_path / "process.log", lambda *p: problems.append(p))


def test_rows_for_a_wandb_that_did_not_start_are_not_kept(tmp_path):
    problems = []
    process = wandb_process(tmp_path, problems, no_such_setting=1)  # wandb.Settings refuses it
    deadline = time.monotonic() + 120
    while not problems and time.monotonic() < deadline:
        time.sleep(0.1)
    assert problems and problems[0][0] == "failed"
    assert process._ended.wait(10)  # set just after the problem is told
    for step in range(10_000):  # a long run's rows: none may pile up for a W&B that is gone
        process.send("log", ({"step": step}, {}))
    assert process._outbox.qsize() == 0
    assert process.finish(1) is None


def test_wandbs_failure_is_told_before_the_run_stops_waiting_on_it(tmp_path):
    # the warning that W&B did not start comes before the run's last lines, not lost at its exit
    told = []

    def slowly(kind, text):
        time.sleep(0.5)  # a log handler that takes its time
        told.append(kind)

    start = {"init": {"dir": str(tmp_path), "mode": "offline"}, "settings": {"bogus": 1},
             "argv": ["test"], "metrics": []}  # fmt: skip
    process = WandbProcess(start, tmp_path / "process.log", slowly)
    assert process.finish(1) is None
    assert told == ["failed"]


def test_a_row_wandb_cannot_take_costs_a_warning_not_the_run(tmp_path):
    problems = []
    process = wandb_process(tmp_path, problems)
    process.send("log", ({"step": 1, "train/loss": 1.0}, {}))
    process.send("log", ({"step": 2, ("not", "a", "name"): 1.0}, {}))  # JSON keys are strings
    process.send("log", ({"step": 3, "train/loss": 0.5}, {}))
    wandb_dir = process.finish(0)
    assert [kind for kind, _ in problems] == ["warning"]
    assert "W&B did not take a log message" in problems[0][1]
    rows = history(wandb_exit(wandb_dir)["records"])
    assert [r["train/loss"] for r in rows] == [1.0, 0.5]


def test_a_failing_warning_does_not_leave_the_run_waiting_on_wandb(tmp_path):
    def refuse(kind, text):
        raise RuntimeError("no place to say it")

    start = {"init": {"dir": str(tmp_path), "mode": "offline"}, "settings": {"bogus": 1},
             "argv": ["test"], "metrics": []}  # fmt: skip
    process = WandbProcess(start, tmp_path / "process.log", refuse)
    ended = threading.Thread(target=process.finish, args=(1,), daemon=True)
    ended.start()
    ended.join(timeout=120)
    assert not ended.is_alive()  # finish() returned although the warning could not be given


def test_a_run_that_ends_before_its_first_row_does_not_wait_for_wandb(tmp_path, monkeypatch):
    """A stop signal or an error while the run is built: W&B's process finishes the W&B run on
    its own, and the training process does not wait out a start against a server that does not
    answer (wandb.init_timeout)."""
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    wandb_cfg = OmegaConf.create(
        {"mode": "online", "project": "p", "entity": None, "tags": [], "init_timeout": 90}
    )
    tracker = Tracker(RunContext(tmp_path), {}, wandb_cfg, Classification)
    process = tracker._wandb
    started = time.monotonic()
    tracker.close("interrupted")
    assert time.monotonic() - started < 30  # not the 90 s W&B may take to give up
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "interrupted"
    # W&B's process would go on trying for up to 90 s, and say so after the test suite's end
    process._process.kill()
    assert process._ended.wait(30)


@pytest.mark.slow  # a command-line run and a report on it
def test_a_single_run_is_named_after_its_experiment(tmp_path):
    result = run_cli(
        "mpexp.train",
        "experiment=quickstart",
        "trainer.epochs=1",
        "dataset.train_size=128",
        "dataset.val_size=32",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    (wandb_dir,) = (tmp_path / "outputs").glob("*/*/wandb/offline-run-*")
    records = leet_records(wandb_dir)
    run = final_run(records)
    assert (run["display_name"], run["job_type"]) == ("quickstart", "train")
    # the W&B run's Logs tab holds the run's log lines, as its console showed them
    logs = [r["output_raw"]["line"] for r in records if r["type"] == "output_raw"]
    assert any("Epoch: 1, Loss:" in line for line in logs)
    # it records the training command, and the training process's memory (torch's hundreds of
    # MiB), not those of the W&B process that sends them (about 70 MiB)
    (environment,) = [r["environment"] for r in records if "args" in r.get("environment", {})]
    assert "experiment=quickstart" in environment["args"]
    stats = [r["stats"]["item"] for r in records if r["type"] == "stats"]
    assert stats and min(s["proc.memory.rssMB"] for s in stats) > 250
    summaries = [r["summary"]["update"] for r in records if r["type"] == "summary"]
    # val/acc is summarised as its best epoch, val/loss as its lowest
    assert any(isinstance(s.get("val/acc"), dict) and "max" in s["val/acc"] for s in summaries)
    assert any(isinstance(s.get("val/loss"), dict) and "min" in s["val/loss"] for s in summaries)

    # a report on this one run keeps its W&B run apart from the training run's
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    report = run_cli("mpexp.report", str(run_dir), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    (sync,) = [line for line in report.stdout.splitlines() if "wandb sync" in line]
    (report_run,) = (run_dir / "wandb-report" / "wandb").glob("offline-run-*")
    assert sync.count("offline-run-") == 2
    assert str(wandb_dir) in sync and str(report_run) in sync
    # `wandb leet <run dir>/wandb` still opens the training run
    assert (run_dir / "wandb" / "latest-run").resolve() == wandb_dir.resolve()
