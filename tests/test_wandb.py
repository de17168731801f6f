"""A training run's offline W&B run holds its history, read back from the run's own files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mpexp.runner import train
from mpexp.tracking import RunContext
from tests.conftest import TINY, make_cfg


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


def test_offline_run_holds_loss_scale_and_epoch_time(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = RunContext(tmp_path, name="wandb-test", group="g")
    train(make_cfg(*TINY, "precision=fp16", "wandb.mode=offline"), run)

    (wandb_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    records = leet_records(wandb_dir)
    rows = history(records)
    steps = [r for r in rows if "train/loss" in r]
    epochs = [r for r in rows if "perf/epoch_time_s" in r]
    assert len(steps) == 2 * 16 and len(epochs) == 2
    assert all(r["amp/scale"] == 65536.0 for r in steps[:5])

    local = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    local_steps = [r for r in local if "train/loss" in r]
    assert [r["train/loss"] for r in steps] == [r["train/loss"] for r in local_steps]
    assert [r["perf/epoch_time_s"] for r in epochs] == [
        r["perf/epoch_time_s"] for r in local if "perf/epoch_time_s" in r
    ]

    (run_record,) = [r["run"] for r in records if r["type"] == "run"]
    assert run_record["display_name"] == "wandb-test" and run_record["run_group"] == "g"
    ran = run_record["config"]["update"]["ran"]
    assert ran["precision"] == "fp16" and ran["loss_scaling"] == "dynamic"


def test_checkpoints_go_to_wandb_as_artifacts_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    for asked in (False, True):
        run_dir = tmp_path / str(asked)
        overrides = [*TINY, "wandb.mode=offline", f"wandb.log_checkpoints={str(asked).lower()}"]
        train(make_cfg(*overrides), RunContext(run_dir))
        (wandb_dir,) = (run_dir / "wandb").glob("offline-run-*")
        artifacts = [r["artifact"] for r in leet_records(wandb_dir) if r["type"] == "artifact"]
        models = [a for a in artifacts if a.get("type") == "model"]
        assert len(models) == (2 if asked else 0)  # one checkpoint per epoch
        if asked:
            assert "step-32" in models[-1]["aliases"] and "latest" in models[-1]["aliases"]
