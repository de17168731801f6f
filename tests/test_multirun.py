"""`python -m mpexp.train -m precision=...` as a user runs it, read back from the offline W&B runs:
one run per job named by what the sweep varies, job types, tags, and the report run's table."""

from __future__ import annotations

import json

from tests.conftest import run_cli
from tests.test_wandb import final_run, leet_records

PRECISIONS = ["fp32", "tf32", "fp16", "bf16"]


def run_record(wandb_dir) -> dict:
    return final_run(leet_records(wandb_dir))


def test_precision_sweep_as_wandb_runs_named_tagged_and_reported(tmp_path):
    result = run_cli(
        "mpexp.train",
        "-m",
        "experiment=quickstart",
        f"precision={','.join(PRECISIONS)}",
        "trainer.epochs=1",
        "dataset.train_size=256",
        "dataset.val_size=64",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr

    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    group = f"sweep-{sweep.parent.name}_{sweep.name}"
    runs = []
    for job in range(4):
        (wandb_dir,) = (sweep / str(job) / "wandb").glob("offline-run-*")
        runs.append(run_record(wandb_dir))
        summary = json.loads((sweep / str(job) / "summary.json").read_text())
        assert summary["status"] == "finished"
        assert summary["ran"]["choices"]["experiment"] == "quickstart"

    # each job is named by the one override that varies, not by the whole command line
    assert [r["display_name"] for r in runs] == [f"precision={p}" for p in PRECISIONS]
    assert {r["run_group"] for r in runs} == {group}
    assert {r["job_type"] for r in runs} == {"train"}
    assert len({r["run_id"] for r in runs}) == 4
    fp16 = runs[2]["tags"]
    assert {"precision=fp16", "loss_scaling=dynamic", "model=simplecnn_small"} <= set(fp16)
    assert {"dataset=synthetic", "experiment=quickstart"} <= set(fp16)

    # the report is a W&B run of its own in the same group, holding the table
    (report_dir,) = (sweep / "wandb-report" / "wandb").glob("offline-run-*")
    report = run_record(report_dir)
    assert (report["display_name"], report["job_type"], report["run_group"]) == (
        "report",
        "report",
        group,
    )
    (table_file,) = report_dir.glob("files/media/table/report/table_*.table.json")
    table = json.loads(table_file.read_text())
    column = table["columns"].index("precision")
    assert [row[column] for row in table["data"]] == PRECISIONS

    # W&B's own console lines are quiet; mpexp prints the one sync command for the whole sweep
    output = result.stdout + result.stderr
    assert "wandb:" not in output
    (sync,) = [line for line in output.splitlines() if "wandb sync" in line]
    assert sync.count("offline-run-") == 5


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
