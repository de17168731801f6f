"""The sweep report, from real sweeps on synthetic data: files, numbers, parity, failures, W&B."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import statistics
from pathlib import Path

import pytest
from matplotlib.image import imread
from omegaconf import OmegaConf

from mpexp.report import cli as report
from mpexp.report.table import build_report
from mpexp.run.runner import train
from mpexp.tasks.base import ACCURACY
from mpexp.tracking.run_context import RunContext
from tests.conftest import TINY, job_dir, make_cfg, run_cli
from tests.test_first_minutes import documented_run, shape
from tests.test_training import read_metrics
from tests.test_wandb import final_run, final_summary, leet_records

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PRECISIONS = ["fp32", "tf32", "fp16", "bf16"]


def read_table(report_md: Path, section: str) -> list[dict[str, str]]:
    """The table under report.md's `## <section>` heading, as one {header: cell} dict per row."""
    text = report_md.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [
        dict(zip(header, [c.strip() for c in line.strip("|").split("|")], strict=True))
        for line in lines[2:]
    ]


def sweep_dir(cwd: Path) -> Path:
    (sweep,) = (cwd / "outputs" / "multirun").glob("*/*")
    return sweep


@pytest.fixture(scope="module")
def precision_sweep(tmp_path_factory):
    """A four-precision multirun, W&B offline, as a user runs it; the report comes at its end.
    The sweep's folder and its console output (stdout and stderr)."""
    cwd = tmp_path_factory.mktemp("precision_sweep")
    result = run_cli(
        "mpexp.train",
        "-m",
        "experiment=quickstart",
        f"precision={','.join(PRECISIONS)}",
        "trainer.epochs=2",
        "dataset.train_size=256",
        "dataset.val_size=64",
        "trainer.progress=false",
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr
    return sweep_dir(cwd), result.stdout + result.stderr


@pytest.fixture(scope="module")
def sweep_with_a_failure(tmp_path_factory):
    """fp32 at a working lr, at an invalid lr, and at an lr too small to learn anything: the
    failing job in the middle, so that the sweep must go on after it."""
    cwd = tmp_path_factory.mktemp("failed_sweep")
    result = run_cli(
        "mpexp.train",
        "-m",
        "experiment=quickstart",
        "optimizer.lr=3e-3,-1,1e-9",
        "dataset.train_size=512",
        "dataset.val_size=128",
        "dataset.batch_size=64",
        "dataset.noise=0.3",  # clear classes: the working lr learns them in two epochs
        "trainer.epochs=2",
        "trainer.progress=false",
        "wandb.mode=disabled",
        cwd=cwd,
    )
    assert result.returncode != 0  # Hydra reports the failed job when the sweep ends
    return sweep_dir(cwd), result


def assert_pngs(sweep: Path, names: list[str]) -> None:
    text = (sweep / "report.md").read_text()
    for name in names:
        png = sweep / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_SIGNATURE
        height, width, channels = imread(png).shape
        assert height > 100 and width > 100 and channels in (3, 4)
        assert f"]({name}.png)" in text  # embedded in report.md


def test_multirun_ends_with_the_report_and_its_plots(precision_sweep):
    sweep, stdout = precision_sweep
    # the last line names the report, after the bottom line
    assert stdout.strip().splitlines()[-1].startswith(f"Sweep report: {sweep / 'report.md'}")
    assert "Bottom line:\n  precision=tf32: " in stdout
    # each job's folder is named by its number and the override the sweep varies
    jobs = sorted(p.name for p in sweep.iterdir() if p.name[0].isdigit())
    assert jobs == [f"{k}_precision={p}" for k, p in enumerate(PRECISIONS)]
    assert_pngs(sweep, ["result", "loss_curves", "epoch_time", "peak_memory", "loss_scale"])
    text = (sweep / "report.md").read_text()
    assert not (sweep / "underflow.png").exists()
    assert "No run recorded gradient statistics, so there is no underflow plot" in text


def test_a_job_prints_the_first_and_last_lines_getting_started_shows(precision_sweep):
    """The quickstart's lines, from the sweep's first job (experiment=quickstart in fp32): the
    line that starts training and the last one, what it reached and where it is."""
    sweep, output = precision_sweep
    first, last = documented_run()
    printed = [line for line in output.splitlines() if "][mpexp" in line]
    job = printed[: next(k for k, line in enumerate(printed) if "Done: " in line) + 1]
    assert shape(job[0]) == shape(first)
    assert shape(job[-1]) == shape(last)
    folder = job_dir(sweep, 0).relative_to(sweep.parents[3])  # from where the sweep ran
    assert job[-1].endswith(f"| {folder}")
    assert re.search(r"Done: val/acc [\d.]+ % \(best [\d.]+ % at epoch \d\)", job[-1])


def test_a_sweeps_jobs_are_wandb_runs_named_tagged_and_reported(precision_sweep):
    sweep, output = precision_sweep
    group = f"sweep-{sweep.parent.name}_{sweep.name}"
    runs = []
    for job in range(4):
        (wandb_dir,) = (job_dir(sweep, job) / "wandb").glob("offline-run-*")
        runs.append(final_run(leet_records(wandb_dir)))
        summary = json.loads((job_dir(sweep, job) / "summary.json").read_text())
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
    records = leet_records(report_dir)
    report = final_run(records)
    # its summary holds report.md's bottom line
    bottom = (sweep / "report.md").read_text().split("## Bottom line\n\n", 1)[1]
    assert final_summary(records)["report/bottom_line"] in bottom
    assert final_summary(records)["report/bottom_line"].startswith("- **precision=tf32**: ")
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
    assert "wandb:" not in output
    (sync,) = [line for line in output.splitlines() if "wandb sync" in line]
    assert sync.count("offline-run-") == 5


def test_the_sweep_writes_its_wandb_view_grouped_by_precision(precision_sweep):
    """wandb-view.json, whatever the W&B mode (tests/test_wandb_view.py has the rest): the
    sweep's group, its training runs grouped by precision, the loss scale on a log axis."""
    sweep, output = precision_sweep
    spec = json.loads((sweep / "wandb-view.json").read_text())
    group = f"sweep-{sweep.parent.name}_{sweep.name}"
    assert spec["name"] == group and spec["runs"] == {"groups": [group], "job_type": "train"}
    assert spec["group_by"] == ["ran.precision"]
    (scale,) = [
        p for s in spec["sections"] for p in s["panels"] if s["name"] == "Loss scale"
        if p["y"] == ["amp/scale"]
    ]  # fmt: skip
    assert scale["log_y"] is True
    assert f"`mpexp-report {sweep} --wandb-view`" in output  # offline: how to create it later


def test_tables_hold_the_numbers_in_the_runs_metrics(precision_sweep):
    sweep, _ = precision_sweep
    accuracy = read_table(sweep / "report.md", "Accuracy against fp32")
    speed = read_table(sweep / "report.md", "Speed")
    runs = read_table(sweep / "report.md", "Runs")
    jobs = [job_dir(sweep, k) for k in range(len(PRECISIONS))]
    assert [row["configuration"] for row in accuracy] == [f"precision={p}" for p in PRECISIONS]
    emulated = [json.loads((job / "summary.json").read_text())["ran"]["emulated"] for job in jobs]
    assert [row["configuration"] for row in speed] == [  # † marks an emulated 16-bit precision
        f"precision={p}{' †' if e else ''}" for p, e in zip(PRECISIONS, emulated, strict=True)
    ]
    assert [row["run"] for row in runs] == [f"{i}_precision={p}" for i, p in enumerate(PRECISIONS)]

    def numbers(job: Path) -> dict:
        steps, epochs = read_metrics(job)
        timed = [e["perf/epoch_time_s"] for e in epochs[1:]]
        return {
            "time": statistics.median(timed),
            "min": min(timed),
            "max": max(timed),
            "rate": statistics.median(e["perf/samples_per_s"] for e in epochs[1:]),
            "tflops": statistics.median(e["perf/tflops"] for e in epochs[1:]),
            "mem": max(e["mem/peak_rss_mib"] for e in epochs[1:]),  # as timing: after warm-up
            "loss": epochs[-1]["val/loss"],
            "acc": 100 * epochs[-1]["val/acc"],
            "skipped": steps[-1]["amp/skipped_steps"],
        }

    fp32 = numbers(jobs[0])
    rows = zip(jobs, accuracy, speed, runs, PRECISIONS, strict=True)
    for job, acc_row, speed_row, run_row, precision in rows:
        ran = json.loads((job / "summary.json").read_text())["ran"]
        shown = precision if ran["effective_precision"] == precision else "tf32 (ran as fp32)"
        assert acc_row["precision"] == shown
        assert acc_row["loss scaling"] == ("dynamic" if precision == "fp16" else "none")
        assert (acc_row["model"], acc_row["dataset"]) == ("simplecnn_small", "synthetic")
        assert acc_row["n"] == speed_row["n"] == "1"  # one seed: values without intervals

        n = numbers(job)
        assert acc_row["val loss"] == f"{n['loss']:.4f}"
        assert acc_row["Δ val loss"] == f"{n['loss'] - fp32['loss']:+.4f}"
        assert acc_row["val acc (%)"] == f"{n['acc']:.2f}"
        assert acc_row["Δ val acc (points)"] == f"{n['acc'] - fp32['acc']:+.2f}"
        assert speed_row["epoch time (s)"] == f"{n['time']:.3f}"
        assert speed_row["speedup"] == f"{fp32['time'] / n['time']:.2f}x"
        assert speed_row["samples/s"] == f"{n['rate']:.0f}"
        assert speed_row["TFLOP/s"] == f"{n['tflops']:.3g}"
        assert speed_row["MFU (%)"] == "n/a"  # no known peak on a CPU
        assert speed_row["peak memory (MiB)"] == f"{n['mem']:.1f}"
        assert speed_row["memory vs fp32"] == f"{n['mem'] / fp32['mem']:.2f}x"
        spread = f"{n['time']:.3f} [{n['min']:.3f} to {n['max']:.3f}]"
        assert run_row["epoch time (s): median [min to max]"] == spread
        assert run_row["timed epochs"] == "1"
        assert run_row["skipped steps"] == str(n["skipped"])

    assert accuracy[0]["parity"] == "fp32 reference"
    assert {row["parity"] for row in accuracy[1:]} == {"inconclusive: single seed"}
    assert speed[0]["speedup"] == "1.00x" and speed[0]["memory vs fp32"] == "1.00x"
    # two epochs, one timed, one seed: the report says what that is worth
    text = (sweep / "report.md").read_text()
    assert "**Few timed epochs.**" in text and "**Single seed.**" in text


def test_wandb_runs_hold_what_ran_and_plot_against_epoch_and_step(precision_sweep):
    sweep, _ = precision_sweep
    fp16_job = job_dir(sweep, 2)
    (wandb_dir,) = (fp16_job / "wandb").glob("offline-run-*")
    records = leet_records(wandb_dir)

    axes = {r["metric"].get("name") or r["metric"]["glob_name"]: r["metric"].get("step_metric")
            for r in records if r["type"] == "metric"}  # fmt: skip
    assert axes["train/loss"] == axes["amp/*"] == "step"
    assert axes["val/*"] == axes["perf/*"] == axes["mem/*"] == "epoch"

    ran = final_run(records)["config"]["ran"]
    local = json.loads((fp16_job / "summary.json").read_text())
    for key in ("device", "device_name", "torch_version", "autocast_dtype", "tf32_matmul",
                "tf32_cudnn", "loss_scaling", "final_scale"):  # fmt: skip
        assert ran[key] == local["ran"][key], key
    assert ran["autocast_dtype"] == "float16" and ran["loss_scaling"] == "dynamic"
    accs = [e["val/acc"] for e in read_metrics(fp16_job)[1]]
    assert final_summary(records)["val/acc"] == {"max": max(accs), "last": accs[-1]}


@pytest.fixture(scope="module")
def reported_twice(precision_sweep, tmp_path_factory):
    """The sweep's report written into a folder of its own (--out), W&B `auto`: twice, as after
    a sweep and once more by hand. The folder, and the line with the sync command the second
    report printed."""
    sweep, _ = precision_sweep
    out = tmp_path_factory.mktemp("reported_twice")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as env, contextlib.redirect_stdout(printed):
        env.setenv("WANDB_SILENT", "true")
        for _ in range(2):
            assert report.main([str(sweep), "--out", str(out)]) == 0
    (sync,) = [line for line in printed.getvalue().splitlines()[-12:] if "wandb sync" in line]
    return out, sync


def test_report_table_is_logged_to_the_sweeps_wandb_group(precision_sweep, reported_twice):
    sweep, _ = precision_sweep
    out, _ = reported_twice
    # `auto` logs the way the sweep's runs were logged; here offline, into --out
    (wandb_dir,) = (out / "wandb-report" / "wandb").glob("offline-run-*")
    (run,) = [r["run"] for r in leet_records(wandb_dir) if r["type"] == "run"]
    assert run["run_group"] == f"sweep-{sweep.parent.name}_{sweep.name}"
    assert run["job_type"] == "report" and run["project"] == "mpexp"

    def logged(name: str) -> list[dict]:
        (table_file,) = (wandb_dir / "files" / "media" / "table" / "report").glob(
            f"{name}_*.table.json"
        )
        table = json.loads(table_file.read_text())
        return [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]

    configs, runs = logged("table"), logged("runs")
    assert [r["precision"] for r in configs] == PRECISIONS
    assert configs[0]["speedup"] == 1.0 and configs[0]["parity"] == "reference"
    assert {r["parity"] for r in configs[1:]} == {"single seed"}
    assert configs[1]["n"] == 1 and configs[1]["result_low"] is None
    _, epochs = read_metrics(job_dir(sweep, 3))
    assert configs[3]["val_loss"] == epochs[-1]["val/loss"]
    assert configs[3]["tflops"] == runs[3]["tflops"]
    assert runs[3]["tflops"] == statistics.median(e["perf/tflops"] for e in epochs[1:])
    # labelled by the folder as seen from --out
    assert [r["run"].rsplit("/", 1)[1] for r in runs] == [
        f"{i}_precision={p}" for i, p in enumerate(PRECISIONS)
    ]


def test_the_report_is_one_wandb_run_per_folder_and_holds_report_md(reported_twice):
    out, sync = reported_twice
    # one report run, updated: its id comes from the folder; the older offline copy is replaced
    (wandb_dir,) = (out / "wandb-report" / "wandb").glob("offline-run-*")
    assert sync.count("wandb-report") == 1 and sync.endswith(f"{wandb_dir}`")
    records = leet_records(wandb_dir)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert wandb_dir.name.endswith(run["run_id"]) and run["job_type"] == "report"

    artifacts = [r["artifact"] for r in records if r["type"] == "artifact"]
    (files,) = [a for a in artifacts if a["type"] == "report"]
    names = {c["path"] for c in files["manifest"]["contents"]}
    assert names == {"report.md", *(p.name for p in out.glob("*.png"))} and len(names) > 4


def test_failed_run_is_named_and_the_rest_reported(sweep_with_a_failure):
    sweep, result = sweep_with_a_failure
    assert "optimizer.lr=-1.0 must be positive" in result.stderr
    assert f"Sweep report: {sweep / 'report.md'}" in result.stdout
    # the failed job did not stop the sweep, and its summary says why it failed
    summaries = [json.loads((job_dir(sweep, i) / "summary.json").read_text()) for i in range(3)]
    assert [s["status"] for s in summaries] == ["finished", "failed", "finished"]
    assert "optimizer.lr=-1" in summaries[1]["error"]
    assert all("val/acc" in summaries[i] for i in (0, 2))

    text = (sweep / "report.md").read_text()
    assert [row["run"] for row in read_table(sweep / "report.md", "Runs")] == [
        "0_optimizer.lr=0.003",
        "2_optimizer.lr=1e-09",
    ]
    not_reported = text.split("## Not reported", 1)[1]
    assert "`1_optimizer.lr=-1`: it never started training" in not_reported
    assert "optimizer.lr=-1.0 must be positive" in not_reported


def test_each_setting_is_compared_with_fp32_at_the_same_setting(sweep_with_a_failure):
    sweep, _ = sweep_with_a_failure
    accs = [read_metrics(job_dir(sweep, job))[1][-1]["val/acc"] for job in (0, 2)]
    assert 100 * (accs[0] - accs[1]) > ACCURACY.tolerance  # the lr=1e-9 run never learns
    # ... but it is fp32 at another learning rate, not a precision that lost accuracy
    configs = build_report([sweep], ACCURACY.tolerance).configs
    assert [(c.label, c.parity) for c in configs] == [
        ("optimizer.lr=0.003", "reference"),
        ("optimizer.lr=1e-09", "reference"),
    ]


def test_incomplete_and_unreadable_runs_are_named(sweep_with_a_failure, tmp_path, capsys):
    sweep, _ = sweep_with_a_failure
    for name in ("complete", "killed", "broken"):
        shutil.copytree(job_dir(sweep, 0), tmp_path / name)
    killed = tmp_path / "killed" / "summary.json"
    killed.write_text(json.dumps({**json.loads(killed.read_text()), "status": "running"}))
    (tmp_path / "broken" / "summary.json").write_text('{"status": "fini')

    assert report.main([str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "not reported: killed: it is still running or was killed" in out
    assert "not reported: broken: summary.json cannot be read" in out
    assert [row["run"] for row in read_table(tmp_path / "report.md", "Runs")] == ["complete"]


def test_runs_whose_files_hold_other_json_are_named_and_the_rest_reported(
    sweep_with_a_failure, tmp_path, capsys
):
    sweep, _ = sweep_with_a_failure
    for name in ("complete", "listed", "numbered"):
        shutil.copytree(job_dir(sweep, 0), tmp_path / name)
    (tmp_path / "listed" / "summary.json").write_text("[1, 2]\n")  # valid JSON, not a summary
    metrics = tmp_path / "numbered" / "metrics.jsonl"
    line = len(metrics.read_text().splitlines()) + 1
    metrics.write_text(metrics.read_text() + "42\n")  # valid JSON, not a row

    assert report.main([str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "not reported: listed: summary.json holds a list, not an object" in out
    assert f"numbered: metrics.jsonl cannot be read (line {line} holds a number, not an" in out
    assert [row["run"] for row in read_table(tmp_path / "report.md", "Runs")] == ["complete"]


def test_a_run_killed_mid_write_is_reported_without_its_half_line(sweep_with_a_failure, tmp_path):
    sweep, _ = sweep_with_a_failure
    for name in ("complete", "crashed"):
        shutil.copytree(job_dir(sweep, 0), tmp_path / name)
    crashed = tmp_path / "crashed"
    summary = crashed / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "status": "running"}))
    metrics = crashed / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + whole.splitlines()[0][:25])  # a row cut off by the kill

    built = build_report([tmp_path], ACCURACY.tolerance)
    assert [r.label for r in built.rows] == ["complete"]
    ((label, run),) = built.not_reported
    assert label == "crashed" and "after 2 of 2 epochs" in run.problem  # its rows were read
    assert "the last line of metrics.jsonl was cut off mid-write" in run.problem


def test_without_an_fp32_run_nothing_is_compared(precision_sweep, tmp_path):
    sweep, _ = precision_sweep
    run = shutil.copytree(job_dir(sweep, 2), tmp_path / "fp16_only")
    # a single run directory: the report goes into it
    assert report.main([str(run), "--no-plots"]) == 0

    (accuracy,) = read_table(run / "report.md", "Accuracy against fp32")
    (speed,) = read_table(run / "report.md", "Speed")
    assert accuracy["precision"] == "fp16" and accuracy["configuration"] == "fp16_only"
    assert accuracy["Δ val acc (points)"] == "n/a" and accuracy["parity"] == "no fp32 reference"
    assert speed["speedup"] == speed["memory vs fp32"] == speed["time to target (s)"] == "n/a"
    text = (run / "report.md").read_text()
    assert "No target: no fp32 reference to take it from; set one with `--target`." in text


@pytest.mark.parametrize(
    ("make_path", "message"),
    [
        (lambda tmp: tmp / "no_such_sweep", "does not exist"),
        (lambda tmp: tmp, "No runs found under"),
    ],
)
def test_bad_path_gives_one_message_and_fails(tmp_path, make_path, message):
    result = run_cli("mpexp.report", str(make_path(tmp_path)), cwd=tmp_path)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "report.md").exists()


SMALL = [
    "dataset=synthetic",
    "dataset.train_size=128",
    "dataset.val_size=32",
    "dataset.batch_size=64",
    "model=simplecnn",
    "model.width=4",
    "trainer.epochs=2",
    "trainer.progress=false",
    "wandb.mode=disabled",
]


@pytest.mark.slow
def test_precision_grid_preset_compares_the_grid_with_plain_fp32(tmp_path):
    result = run_cli(
        "mpexp.train", "-m", "experiment=precision_grid", "precision=bf16,fp32",
        "loss_scaling=static,none", *SMALL, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    sweep = sweep_dir(tmp_path)
    assert f"Sweep report: {sweep / 'report.md'}" in result.stdout

    accuracy = read_table(sweep / "report.md", "Accuracy against fp32")
    speed = read_table(sweep / "report.md", "Speed")
    grid = [(row["precision"], row["loss scaling"], row["model"]) for row in accuracy]
    assert sorted(grid) == sorted(
        (p, s, "simplecnn") for p in ("bf16", "fp32") for s in ("static", "none")
    )
    # fp32 with loss scaling is listed first, yet plain fp32 is the reference
    index = grid.index(("fp32", "none", "simplecnn"))
    assert accuracy[index]["parity"] == "fp32 reference"
    assert speed[index]["speedup"] == "1.00x" and accuracy[index]["Δ val acc (points)"] == "+0.00"
    assert grid.index(("fp32", "static", "simplecnn")) < index


@pytest.mark.slow
def test_hparams_search_preset_runs_optunas_trials_and_names_the_best_learning_rate(tmp_path):
    result = run_cli(
        "mpexp.train", "-m", "experiment=hparams_search", "precision=bf16", *SMALL,
        "hydra.sweeper.n_trials=2", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    console = result.stdout + result.stderr
    # Optuna's set-up chatter (alembic's plugin lines, its study announcement) stays off it
    assert "setup plugin" not in console and "A new study created" not in console
    assert "Study name: lr_search" in console  # Hydra's sweeper still says what it searches
    sweep = sweep_dir(tmp_path)
    trials = [json.loads((job_dir(sweep, n) / "summary.json").read_text()) for n in range(2)]
    lrs = [
        OmegaConf.load(job_dir(sweep, n) / ".hydra" / "config.yaml").optimizer.lr for n in range(2)
    ]
    assert len(set(lrs)) == 2 and all(1e-5 <= lr <= 1e-1 for lr in lrs)  # the searched range
    best = (sweep / "optimization_results.yaml").read_text()
    # the returned value is the final val accuracy, maximised
    accuracies = [t["val/acc"] for t in trials]
    assert f"best_value: {max(accuracies)}" in best
    assert f"optimizer.lr: {lrs[accuracies.index(max(accuracies))]}" in best


@pytest.mark.slow
def test_world4ai_preset_reports_fp32_against_fp16_over_three_seeds(tmp_path):
    """The tutorial's experiment in one command: a precision x seed sweep, aggregated."""
    result = run_cli(
        "mpexp.train", "-m", "experiment=world4ai", *SMALL, "diagnostics.grad_stats_every=1",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    sweep = sweep_dir(tmp_path)
    seeds = [(job_dir(sweep, job) / ".hydra" / "overrides.yaml").read_text() for job in range(6)]
    assert [f"trainer.seed={job % 3}" in s for job, s in enumerate(seeds)] == [True] * 6
    config = (job_dir(sweep, 0) / ".hydra" / "config.yaml").read_text()
    assert "epochs: 2" in config  # the caller's overrides win over the preset's

    accuracy = read_table(sweep / "report.md", "Accuracy against fp32")
    speed = read_table(sweep / "report.md", "Speed")
    runs = read_table(sweep / "report.md", "Runs")
    fp32, fp16 = accuracy
    assert [(r["precision"], r["loss scaling"], r["n"], r["runs"]) for r in accuracy] == [
        ("fp32", "none", "3", "0, 1, 2"),
        ("fp16", "dynamic", "3", "3, 4, 5"),
    ]
    assert [r["seed"] for r in runs] == ["0", "1", "2"] * 2

    finals = [100 * read_metrics(job_dir(sweep, job))[1][-1]["val/acc"] for job in range(6)]
    mean = statistics.fmean(finals[:3])
    half = 4.303 * statistics.stdev(finals[:3]) / 3**0.5  # t with 2 degrees of freedom
    assert fp32["val acc (%)"] == f"{mean:.2f} ± {half:.2f}"
    assert fp32["parity"] == "fp32 reference"
    assert fp16["parity"] in {
        "within noise",
        "inconclusive: interval too wide",
    } or fp16["parity"].startswith(("**worse by", "better by"))
    assert " ± " in fp16["Δ val acc (points)"] and " ± " in speed[1]["epoch time (s)"]
    assert " to " in speed[1]["speedup"]  # an interval: both sides have three seeds

    # time to target, per run, from metrics.jsonl: the fp32 mean minus the tolerance
    target = (mean - ACCURACY.tolerance) / 100
    for job, row in enumerate(runs):
        elapsed, reached = 0.0, None
        for epoch in read_metrics(job_dir(sweep, job))[1]:
            elapsed += epoch["perf/epoch_time_s"]
            if epoch["val/acc"] >= target:
                reached = elapsed
                break
        assert row["time to target (s)"] == ("not reached" if reached is None else f"{reached:.1f}")

    assert_pngs(
        sweep,
        ["result", "loss_curves", "epoch_time", "peak_memory", "loss_scale", "underflow"],
    )


def test_runs_that_logged_diagnostics_are_reported_and_plotted(tmp_path):
    # diagnostics rows are keyed by step too, and one comes after the last step row
    for name, precision in (("fp32", "precision=fp32"), ("fp16", "precision=fp16")):
        cfg = make_cfg(*TINY, precision, "dataset.train_size=256", "trainer.epochs=1",
                       "diagnostics.grad_stats_every=4")  # fmt: skip
        train(cfg, RunContext(tmp_path / name))
    assert report.main([str(tmp_path)]) == 0

    accuracy = read_table(tmp_path / "report.md", "Accuracy against fp32")
    assert sorted((r["precision"], r["loss scaling"]) for r in accuracy) == [
        ("fp16", "dynamic"),
        ("fp32", "none"),
    ]
    for row in read_table(tmp_path / "report.md", "Runs"):
        steps, _ = read_metrics(tmp_path / row["run"])
        step_rows = [r for r in steps if "train/loss" in r]
        assert row["skipped steps"] == str(step_rows[-1]["amp/skipped_steps"])
    for name in ("loss_curves", "loss_scale"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG_SIGNATURE
