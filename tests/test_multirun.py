"""`python -m mpexp.train -m precision=...` as a user runs it: one W&B run per job, one group."""

from __future__ import annotations

import json

from tests.conftest import run_cli
from tests.test_wandb import leet_records


def test_precision_sweep_makes_four_runs_in_one_group(tmp_path):
    result = run_cli(
        "mpexp.train",
        "-m",
        "experiment=quickstart",
        "precision=fp32,tf32,fp16,bf16",
        "trainer.epochs=1",
        "dataset.train_size=256",
        "dataset.val_size=64",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr

    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 4

    runs = []
    for job in jobs:
        (wandb_dir,) = (job / "wandb").glob("offline-run-*")
        (run,) = [r["run"] for r in leet_records(wandb_dir) if r["type"] == "run"]
        runs.append(run)
        summary = json.loads((job / "summary.json").read_text())
        assert summary["status"] == "finished"

    assert {r["run_group"] for r in runs} == {f"sweep-{sweep.parent.name}_{sweep.name}"}
    names = [r["display_name"] for r in runs]
    for precision, name in zip(["fp32", "tf32", "fp16", "bf16"], names, strict=True):
        assert f"precision={precision}" in name
    assert len({r["run_id"] for r in runs}) == 4
