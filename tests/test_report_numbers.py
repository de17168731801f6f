"""The report's statistics on constructed runs with known values, checked against hand counts
(two-sided 95 % t quantiles from a printed table: 4.303 for 2 degrees of freedom, 2.776 for 4)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from mpexp.report import cli as report
from mpexp.report.row import run_values
from mpexp.report.table import build_report
from mpexp.report.wandb_view import sections
from mpexp.tasks.language_model import LanguageModelling
from tests.test_report import read_table

T1, T2, T4 = 12.706, 4.303, 2.776


def make_run(
    root: Path,
    name: str,
    precision: str,
    seed: int,
    accs: list[float],
    times: list[float],
    loss_scaling: str = "none",
    val_loss: float = 0.5,
    span: tuple[str, str] | None = None,
    host: str = "box",
    gpu_mib: list[float] | None = None,
    step_path: str | None = None,
    data_wait: list[float] | None = None,
    reserved_mib: list[float] | None = None,
) -> Path:
    """A finished run directory as `python -m mpexp.train precision=<p> trainer.seed=<s>` leaves
    it, with the given val accuracy and time of each epoch (and, with `gpu_mib`, each epoch's
    CUDA memory peak, as a GPU run logs it, with `reserved_mib` the allocator's reserved peak
    beside it; a CPU run's resident set otherwise; with `data_wait`, each epoch's share of time
    waiting on batches, as the loop logs it)."""
    path = root / name
    (path / ".hydra").mkdir(parents=True)
    overrides = [f"precision={precision}", f"trainer.seed={seed}"]
    choices = {"precision": precision, "loss_scaling": loss_scaling, "model": "m", "dataset": "d"}
    cfg = {"trainer": {"seed": seed, "epochs": len(accs)}}
    files = {
        "config.yaml": cfg,
        "overrides.yaml": overrides,
        "hydra.yaml": {"hydra": {"runtime": {"choices": choices}}},
    }
    for file, content in files.items():
        (path / ".hydra" / file).write_text(yaml.safe_dump(content))
    summary = {
        "status": "finished",
        "config": cfg,
        "overrides": overrides,
        "ran": {
            "choices": choices,
            "precision": precision,
            "effective_precision": precision,
            "loss_scaling": loss_scaling,
            "device": "cpu",
            "device_name": "test CPU",
            "torch_version": "test",
            "host": host,
        },
    }
    if step_path:
        summary["ran"]["step_path"] = step_path
    if span:
        summary["started_at"], summary["ended_at"] = span
    (path / "summary.json").write_text(json.dumps(summary))
    rows = []
    memory = [{"mem/peak_allocated_mib": m} for m in gpu_mib] if gpu_mib else None
    for epoch, (acc, time) in enumerate(zip(accs, times, strict=True), start=1):
        rows.append({"step": epoch, "train/loss": 1.0, "amp/scale": 1.0, "amp/skipped_steps": 0})
        rows.append(
            {
                "epoch": epoch,
                "step": epoch,
                "val/acc": acc,
                "val/loss": val_loss,
                "perf/epoch_time_s": time,
                "perf/samples_per_s": 1000 / time,
                "perf/tflops": 2.0 / time,
                **(memory[epoch - 1] if memory else {"mem/peak_rss_mib": 100.0}),
            }
        )
        if reserved_mib:
            rows[-1]["mem/peak_reserved_mib"] = reserved_mib[epoch - 1]
        if data_wait:
            share = data_wait[epoch - 1]
            rows[-1].update({"perf/data_wait_share": share, "perf/data_wait_s": share * time})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def final_only(root: Path, precision: str, finals: list[float], seeds=(0, 1, 2), first=0):
    """Runs of one configuration whose last epoch reaches `finals` (one per seed)."""
    for k, (seed, acc) in enumerate(zip(seeds, finals, strict=True)):
        make_run(root, str(first + k), precision, seed, [0.1, acc], [2.0, 1.0])


def config(report, precision: str):
    (found,) = [c for c in report.configs if c.first.precision == precision]
    return found


def test_mean_and_interval_over_seeds(tmp_path):
    final_only(tmp_path, "fp32", [0.90, 0.92, 0.94])
    fp32 = config(build_report([tmp_path], 0.5), "fp32")
    # mean 92, sample sd 2 points, n = 3: 92 ± t(2) * 2 / sqrt(3)
    half = T2 * 2 / math.sqrt(3)
    assert fp32.n == 3
    assert fp32.result.value == pytest.approx(92.0)
    assert fp32.result.half_width == pytest.approx(half, abs=1e-9)
    assert fp32.parity == "reference"

    report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"])
    (row,) = read_table(tmp_path / "report.md", "Accuracy against fp32")
    assert (row["n"], row["runs"]) == ("3", "0, 1, 2")
    assert row["val acc (%)"] == f"92.00 ± {half:.2f}" == "92.00 ± 4.97"
    assert row["parity"] == "fp32 reference"
    # --no-plots: the tables alone (the plots are test_report's)
    assert "This report drew none (`--no-plots`)" in (tmp_path / "report.md").read_text()
    assert not list(tmp_path.glob("*.png"))


# Paired by seed: the interval is that of the three per-seed differences (t with 2 df).
@pytest.mark.parametrize(
    ("finals", "verdict", "shown"),
    [
        # differences -5, -5.5, -5: mean -5.167, sd 0.2887
        ([0.85, 0.865, 0.89], "worse", "**worse by 5.17 ± 0.72 points**"),
        # +0.1, -0.1, +0.1: mean +0.033, sd 0.1155: the interval stays above -0.5
        ([0.901, 0.919, 0.941], "within noise", "within noise"),
        # -1, +1, -1: mean -0.333, sd 1.155: from -3.2 to +2.5, across the tolerance
        ([0.89, 0.93, 0.93], "too wide", "inconclusive: interval too wide"),
        # +2, +2.2, +2.1: mean +2.1, sd 0.1
        ([0.92, 0.942, 0.961], "better", "better by 2.10 ± 0.25 points"),
    ],
)
def test_parity_verdict_from_the_interval_of_the_difference(tmp_path, finals, verdict, shown):
    final_only(tmp_path, "fp32", [0.90, 0.92, 0.94])
    final_only(tmp_path, "fp16", finals, first=3)
    fp16 = config(build_report([tmp_path], 0.5), "fp16")

    diffs = [100 * (a - b) for a, b in zip(finals, [0.90, 0.92, 0.94], strict=True)]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    assert fp16.d_result.value == pytest.approx(mean)
    assert fp16.d_result.half_width == pytest.approx(T2 * sd / math.sqrt(3))
    assert fp16.parity == verdict

    report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"])
    _, row = read_table(tmp_path / "report.md", "Accuracy against fp32")
    assert row["parity"] == shown
    assert row["Δ val acc (points)"] == f"{mean:+.2f} ± {T2 * sd / math.sqrt(3):.2f}"


def test_other_seeds_are_compared_unpaired_with_welchs_interval(tmp_path):
    final_only(tmp_path, "fp32", [0.90, 0.92, 0.94])
    final_only(tmp_path, "fp16", [0.85, 0.86, 0.87], seeds=(3, 4, 5), first=3)
    fp16 = config(build_report([tmp_path], 0.5), "fp16")
    # variances of the means 4/3 and 1/3; Welch's df = (5/3)^2 / ((4/3)^2/2 + (1/3)^2/2) = 2.94,
    # taken at 2 (never a narrower interval): -6 ± 4.303 * sqrt(5/3) = -6 ± 5.56, which reaches
    # above -0.5: inconclusive, where 3 df (3.182) would have said worse
    assert fp16.d_result.value == pytest.approx(-6.0)
    assert fp16.d_result.half_width == pytest.approx(T2 * math.sqrt(5 / 3))
    assert fp16.parity == "too wide"


def test_each_run_is_reported_with_its_own_config_whatever_hydra_wrote_there(tmp_path):
    # two sweeps started together into one hydra.sweep.dir: Hydra of the sweep whose job was
    # refused the folder (another run held it) had rewritten the folder's .hydra/ before that
    final_only(tmp_path, "fp32", [0.90, 0.92], seeds=(5, 6))
    hydra = tmp_path / "0" / ".hydra"
    (hydra / "overrides.yaml").write_text(yaml.safe_dump(["precision=fp16", "trainer.seed=0"]))
    (hydra / "config.yaml").write_text(yaml.safe_dump({"trainer": {"seed": 0, "epochs": 9}}))
    (hydra / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": {}}}}))

    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    runs = read_table(tmp_path / "report.md", "Runs")
    assert [(r["run"], r["seed"], r["val acc (%)"]) for r in runs] == [
        ("0 trainer.seed=5", "5", "90.00"),
        ("1 trainer.seed=6", "6", "92.00"),
    ]
    (fp32,) = read_table(tmp_path / "report.md", "Accuracy against fp32")
    assert (fp32["precision"], fp32["n"]) == ("fp32", "2")


def test_a_diverged_run_is_marked_and_the_others_compared_as_usual(tmp_path, capsys):
    final_only(tmp_path, "fp32", [0.90, 0.92, 0.94])
    final_only(tmp_path, "fp16", [0.91, 0.93], seeds=(0, 1), first=3)
    make_run(tmp_path, "5", "fp16", 2, [0.1, 0.1], [2.0, 1.0], val_loss=math.nan)
    for seed, folder in enumerate("678"):  # every seed of bf16 diverged
        make_run(tmp_path, folder, "bf16", seed, [0.1, math.nan], [2.0, 1.0], val_loss=math.inf)

    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert (
        "diverged (final val loss or result not finite): 5 precision=fp16,trainer.seed=2, 6" in out
    )
    fp32, fp16, bf16 = read_table(tmp_path / "report.md", "Accuracy against fp32")
    # fp16 from its two finite seeds, unpaired with fp32's three: Welch's interval as usual
    d = config(build_report([tmp_path], 0.5), "fp16").d_result
    assert d.value == pytest.approx(0.0) and d.half_width > 0
    assert (fp16["n"], fp16["runs"]) == ("2 (+1 **diverged**)", "3, 4, 5")
    assert fp16["val acc (%)"] == f"92.00 ± {T1:.2f}"  # sd sqrt(2) over sqrt(2) runs
    assert fp16["parity"] == "inconclusive: interval too wide"
    assert (bf16["n"], bf16["val acc (%)"], bf16["parity"]) == (
        "0 (+3 **diverged**)",
        "n/a",
        "**diverged**",
    )
    assert fp32["parity"] == "fp32 reference"
    runs = {r["run"]: r for r in read_table(tmp_path / "report.md", "Runs")}
    assert runs["5 precision=fp16,trainer.seed=2 **(diverged)**"]["val loss"] == "nan"
    text = (tmp_path / "report.md").read_text()
    assert (
        "**Diverged.** `5 precision=fp16,trainer.seed=2`, `6 precision=bf16,trainer.seed=0`" in text
    )


def test_single_seed_runs_say_so(tmp_path, capsys):
    final_only(tmp_path, "fp32", [0.92], seeds=(0,))
    final_only(tmp_path, "bf16", [0.80], seeds=(0,), first=1)
    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    text = (tmp_path / "report.md").read_text()
    fp32, bf16 = read_table(tmp_path / "report.md", "Accuracy against fp32")
    assert fp32["val acc (%)"] == "92.00" and fp32["n"] == "1"  # no interval from one value
    assert bf16["Δ val acc (points)"] == "-12.00"
    assert bf16["parity"] == "inconclusive: single seed"
    assert "**Single seed.** `precision=fp32`, `precision=bf16`: one run each" in text
    assert "below fp32" not in capsys.readouterr().out  # nothing is called worse on one seed


def test_worse_configuration_is_named_on_the_console(tmp_path, capsys):
    final_only(tmp_path, "fp32", [0.90, 0.92, 0.94])
    final_only(tmp_path, "fp16", [0.85, 0.865, 0.89], first=3)
    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert (
        "worse than fp32 by more than 0.5 points of val/acc: precision=fp16 (-5.17 ± 0.72 points)"
        in out
    )


def test_speedup_with_its_interval(tmp_path):
    # each run: a warm-up epoch, then three timed epochs at its median
    for k, (precision, median) in enumerate(
        [("fp32", 2.0), ("fp32", 2.2), ("fp32", 1.8), ("bf16", 1.0), ("bf16", 1.1), ("bf16", 0.9)]
    ):
        make_run(tmp_path, str(k), precision, k % 3, [0.9] * 4, [5.0, median, median, median])
    bf16 = config(build_report([tmp_path], 0.5), "bf16")
    # ratio of means 2.0 / 1.0; relative variances of the means 0.04/3/4 and 0.01/3/1, equal, so
    # Welch's df is 4; the interval is the ratio times/divided by exp(t(4) * se)
    se = math.sqrt(0.04 / 3 / 4 + 0.01 / 3 / 1)
    factor = math.exp(T4 * se)
    assert bf16.epoch_time_s.value == pytest.approx(1.0)
    assert bf16.epoch_time_s.half_width == pytest.approx(T2 * 0.1 / math.sqrt(3))
    assert bf16.speedup.value == pytest.approx(2.0)
    assert (bf16.speedup.low, bf16.speedup.high) == pytest.approx((2.0 / factor, 2.0 * factor))

    report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"])
    fp32_row, bf16_row = read_table(tmp_path / "report.md", "Speed")
    assert fp32_row["speedup"] == "1.00x"
    assert bf16_row["speedup"] == f"2.00x ({2 / factor:.2f} to {2 * factor:.2f})"
    assert bf16_row["epoch time (s)"] == f"1.000 ± {T2 * 0.1 / math.sqrt(3):.3f}"
    runs = read_table(tmp_path / "report.md", "Runs")
    assert runs[3]["epoch time (s): median [min to max]"] == "1.000 [1.000 to 1.000]"
    assert runs[3]["timed epochs"] == "3"
    assert runs[3]["TFLOP/s"] == "2"  # the median epoch's 2.0 / 1.0


def test_emulated_precisions_are_marked_in_the_speed_table(tmp_path):
    make_run(tmp_path, "0", "fp32", 0, [0.9] * 4, [5.0, 1.0, 1.0, 1.0])
    bf16 = make_run(tmp_path, "1", "bf16", 0, [0.9] * 4, [5.0, 2.0, 2.0, 2.0])
    summary = json.loads((bf16 / "summary.json").read_text())
    summary["ran"]["emulated"] = True  # as precision/modes.py records bf16 on a CPU without it
    (bf16 / "summary.json").write_text(json.dumps(summary))

    report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"])
    fp32_row, bf16_row = read_table(tmp_path / "report.md", "Speed")
    assert fp32_row["configuration"] == "precision=fp32"  # ran natively: no mark
    assert bf16_row["configuration"] == "precision=bf16 †" and bf16_row["speedup"] == "0.50x"
    speed = (tmp_path / "report.md").read_text().split("## Speed", 1)[1]
    assert "† Emulated: the device could not run this precision at its native speed" in speed


def test_gpu_memory_is_compared_after_the_first_epoch(tmp_path):
    """The first epoch's CUDA peak holds cuDNN's autotuning workspaces (on an H100, DeepCNN in
    fp32: 4628 MiB in epoch 1, 1120 MiB after), which would make fp16's saving look 6x, not 1.5x."""
    make_run(tmp_path, "0", "fp32", 0, [0.9] * 3, [5.0, 2.0, 2.0], gpu_mib=[4628, 1120, 1120])
    make_run(tmp_path, "1", "fp16", 0, [0.9] * 3, [5.0, 1.0, 1.0], gpu_mib=[740, 740, 739])
    fp16 = config(build_report([tmp_path], 0.5), "fp16")
    assert fp16.rows[0].peak_mem_mib == 740
    report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"])
    fp32_row, fp16_row = read_table(tmp_path / "report.md", "Speed")
    assert fp32_row["peak memory (MiB)"] == "1120.0"
    assert fp16_row["memory vs fp32"] == f"{740 / 1120:.2f}x"


def test_the_data_wait_share_is_shown_beside_the_speed_and_a_data_bound_run_named(tmp_path):
    """Timed epochs' median share, as a percentage; over a tenth, a warning names the run; runs
    from before the metric existed show n/a."""
    for seed, waits in enumerate([[0.5, 0.02, 0.04, 0.03], [0.5, 0.05, 0.05, 0.05]]):
        make_run(tmp_path, str(seed), "fp32", seed, [0.9] * 4, [5.0, 1.0, 1.0, 1.0],
                 data_wait=waits)  # fmt: skip
    make_run(
        tmp_path, "2", "bf16", 0, [0.9] * 4, [5.0, 1.0, 1.0, 1.0], data_wait=[0.6, 0.4, 0.3, 0.5]
    )
    make_run(tmp_path, "3", "fp16", 0, [0.9] * 4, [5.0, 1.0, 1.0, 1.0])  # logged no data wait
    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    md = tmp_path / "report.md"
    speed = {row["configuration"]: row["data wait (%)"] for row in read_table(md, "Speed")}
    # 3 and 5 per cent: sd sqrt(2), standard error 1
    assert speed["precision=fp32"] == f"4.0 ± {T1:.1f}"
    assert speed["precision=bf16"] == "40.0" and speed["precision=fp16"] == "n/a"
    runs = [row["data wait (%)"] for row in read_table(md, "Runs")]
    assert runs == ["3.0", "5.0", "40.0", "n/a"]
    warnings = md.read_text().split("## Warnings", 1)[1].split("\n## ", 1)[0]
    (bound,) = [line for line in warnings.splitlines() if "Waiting on data" in line]
    assert "`2 precision=bf16,trainer.seed=0`" in bound and "fp32" not in bound


FP32_CURVE = ([0.5, 0.8, 0.9, 0.92], [3.0, 2.0, 2.0, 2.0])


def time_to_target_sweep(root: Path) -> None:
    for seed in range(3):
        make_run(root, f"{seed}", "fp32", seed, *FP32_CURVE)
        make_run(root, f"{3 + seed}", "fp16", seed, [0.6, 0.88, 0.92, 0.93], [2.0, 1.0, 1.0, 1.0])
        bf16 = [0.5, 0.6, 0.7, 0.8] if seed else [0.5, 0.6, 0.95, 0.95]  # one seed of 3 gets there
        make_run(root, f"{6 + seed}", "bf16", seed, bf16, [1.0, 1.0, 1.0, 1.0])


def test_time_to_target_defaults_to_fp32_accuracy_minus_the_tolerance(tmp_path):
    time_to_target_sweep(tmp_path)
    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    fp32, fp16, bf16 = read_table(tmp_path / "report.md", "Speed")
    # target 92 - 0.5 = 91.5 %: fp32 gets there in its 4th epoch (3+2+2+2 s), fp16 in its 3rd
    # (2+1+1 s); every seed alike, so no spread
    assert fp32["time to target (s)"] == "9.0 ± 0.0"
    assert fp16["time to target (s)"] == "4.0 ± 0.0"
    assert fp16["speedup at target"] == "2.25x (2.25 to 2.25)"
    assert bf16["time to target (s)"] == "reached by 1 of 3"
    assert bf16["speedup at target"] == "n/a"
    text = (tmp_path / "report.md").read_text()
    assert "91.50 % of val/acc for `precision=fp32`" in text
    runs = read_table(tmp_path / "report.md", "Runs")
    assert [r["time to target (s)"] for r in runs[6:]] == ["3.0", "not reached", "not reached"]


@pytest.mark.parametrize("option", ["--target", "--target-acc"])  # the older name too
def test_target_accuracy_from_the_command_line(tmp_path, option):
    time_to_target_sweep(tmp_path)
    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots", option, "85"]) == 0
    fp32, fp16, _ = read_table(tmp_path / "report.md", "Speed")
    assert fp32["time to target (s)"] == "7.0 ± 0.0"  # 0.9 in the 3rd epoch: 3+2+2
    assert fp16["time to target (s)"] == "3.0 ± 0.0"  # 0.88 in the 2nd: 2+1
    assert "Target: 85 % of val/acc (`--target`)" in (tmp_path / "report.md").read_text()


def test_a_target_that_is_no_number_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        report.main([str(tmp_path), "--target", "high"])
    assert "--target" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["0", "101"])
def test_a_target_accuracy_must_be_a_percentage(tmp_path, target, capsys):
    time_to_target_sweep(tmp_path)
    assert (
        report.main([str(tmp_path), "--wandb", "disabled", "--no-plots", "--target", target]) == 2
    )
    assert f"--target {target} is not a val/acc in percent" in capsys.readouterr().err


def test_timing_warnings_few_epochs_and_overlapping_jobs(tmp_path):
    spans = [
        ("2026-01-01T10:00:00+00:00", "2026-01-01T10:05:00+00:00"),
        ("2026-01-01T10:04:00+00:00", "2026-01-01T10:09:00+00:00"),  # overlaps the first
        ("2026-01-01T10:09:00+00:00", "2026-01-01T10:12:00+00:00"),  # starts as the 2nd ends
    ]
    for k, span in enumerate(spans):
        make_run(tmp_path, str(k), "fp32", k, [0.9] * 4, [2.0, 1.0, 1.0, 1.0], span=span)
    # one more epoch than timed: two timed epochs, fewer than 3
    make_run(tmp_path, "3", "fp16", 0, [0.9] * 3, [2.0, 1.0, 1.0], span=spans[0], host="other")
    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    text = (tmp_path / "report.md").read_text()
    warnings = text.split("## Warnings", 1)[1].split("\n## ", 1)[0]
    assert "**Few timed epochs.** `3 precision=fp16,trainer.seed=0` timed fewer than 3" in warnings
    overlap = next(line for line in warnings.splitlines() if "overlapped" in line)
    # job 3 ran on another machine: overlapping in time there costs nothing
    assert "`0 precision=fp32,trainer.seed=0`, `1 precision=fp32,trainer.seed=1` trained" in overlap
    assert "trainer.seed=2" not in overlap and "`3 " not in overlap


def test_sequential_jobs_with_enough_epochs_get_no_timing_warning(tmp_path):
    for k in range(3):
        span = (f"2026-01-01T10:0{2 * k}:00+00:00", f"2026-01-01T10:0{2 * k + 1}:00+00:00")
        make_run(tmp_path, str(k), "fp32", k, [0.9] * 4, [2.0, 1.0, 1.0, 1.0], span=span)
    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    assert "## Warnings" not in (tmp_path / "report.md").read_text()


def test_a_leg_whose_step_ran_another_way_than_fp32s_is_flagged(tmp_path):
    fast = "fused, compiled, captured, schedule on the device"
    paths = {
        "fp32": fast,
        "bf16": fast,
        "fp16": "unfused, compiled, not captured, schedule on the host",
    }
    for k, (precision, path) in enumerate(paths.items()):
        for seed in (0, 1):
            make_run(tmp_path, f"{k}{seed}", precision, seed, [0.9] * 4, [2.0, 1.0, 1.0, 1.0],
                     step_path=path)  # fmt: skip
    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    warnings = (tmp_path / "report.md").read_text().split("## Warnings", 1)[1].split("\n## ")[0]
    flagged = [line for line in warnings.splitlines() if "Another step path" in line]
    assert len(flagged) == 1 and "`precision=fp16`" in flagged[0], flagged
    assert f"its fp32 reference ran {fast}" in flagged[0]


def test_fp8_is_judged_against_fp32_and_against_bf16(tmp_path, capsys):
    # three seeds each; fp8 trains every epoch in half bf16's time
    for k, seed in enumerate((0, 1, 2)):
        make_run(tmp_path, str(k), "fp32", seed, [0.1, [0.90, 0.92, 0.94][k]], [4.0, 2.0])
        make_run(tmp_path, str(3 + k), "bf16", seed, [0.1, [0.91, 0.93, 0.95][k]], [2.0, 1.0])
        make_run(tmp_path, str(6 + k), "fp8", seed, [0.1, [0.85, 0.875, 0.90][k]], [1.0, 0.5])
    built = build_report([tmp_path], 0.5)
    fp8, bf16 = config(built, "fp8"), config(built, "bf16")
    # paired by seed against bf16: -6, -5.5, -5 points: mean -5.5, sd 0.5
    half = T2 * 0.5 / math.sqrt(3)
    assert fp8.bf16_reference is bf16
    assert fp8.d_result_vs_bf16.value == pytest.approx(-5.5)
    assert fp8.d_result_vs_bf16.half_width == pytest.approx(half)
    assert fp8.parity_vs_bf16 == "worse"
    assert fp8.speedup_vs_bf16.value == pytest.approx(2.0)
    # against fp32 as every configuration: -5, -4.5, -4 points
    assert fp8.d_result.value == pytest.approx(-4.5) and fp8.parity == "worse"
    assert bf16.parity_vs_bf16 is None and bf16.bf16_reference is None  # only fp8 gets a second

    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert (
        f"worse than bf16 by more than 0.5 points of val/acc: precision=fp8 (-5.50 ± {half:.2f} "
        "points)" in out
    )
    (row,) = read_table(tmp_path / "report.md", "fp8 against bf16")
    assert (row["configuration"], row["bf16 reference"], row["n"]) == (
        "precision=fp8",
        "precision=bf16",
        "3",
    )
    assert row["Δ val acc vs bf16 (points)"] == f"-5.50 ± {half:.2f}"
    assert row["parity vs bf16"] == f"**worse by 5.50 ± {half:.2f} points**"
    assert row["speedup vs bf16"] == "2.00x (2.00 to 2.00)"
    values = fp8.values()  # the W&B table's row
    assert values["bf16_reference"] == "precision=bf16" and values["parity_vs_bf16"] == "worse"
    assert values["d_result_vs_bf16"] == pytest.approx(-5.5)


def test_fp8_without_a_bf16_configuration_says_so(tmp_path):
    final_only(tmp_path, "fp32", [0.90, 0.92, 0.94])
    final_only(tmp_path, "fp8", [0.90, 0.92, 0.94], first=3)
    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    (row,) = read_table(tmp_path / "report.md", "fp8 against bf16")
    assert (row["bf16 reference"], row["parity vs bf16"]) == ("none", "no bf16 reference")
    _, fp8 = read_table(tmp_path / "report.md", "Accuracy against fp32")
    assert fp8["parity"] == "within noise"


def test_an_fp8_rowwise_sweep_beside_a_bf16_one_is_judged_against_that_bf16(tmp_path):
    """The parity measurement without fp32: bf16 against fp8 over three seeds (one sweep), and
    fp8's rowwise recipe from a sweep of its own (`precision.fp8.recipe` exists only under
    precision=fp8), reported together: each fp8 configuration gets the bf16 one as its
    reference, with its verdict, interval and speedup."""
    for k, seed in enumerate((0, 1, 2)):
        make_run(tmp_path / "sweep", str(k), "bf16", seed, [0.1, [0.91, 0.93, 0.95][k]], [2, 1])
        make_run(
            tmp_path / "sweep", str(3 + k), "fp8", seed, [0.1, [0.85, 0.875, 0.90][k]], [1, 0.5]
        )
        rowwise = make_run(
            tmp_path / "rowwise", str(k), "fp8", seed, [0.1, [0.912, 0.931, 0.951][k]], [1, 0.8]
        )
        # the run's own record of its command line, which the report reads
        record = rowwise / "summary.json"
        summary = json.loads(record.read_text())
        summary["overrides"] = [*summary["overrides"], "precision.fp8.recipe=rowwise"]
        record.write_text(json.dumps(summary))
    assert (
        report.main(
            [
                str(tmp_path / "sweep"),
                str(tmp_path / "rowwise"),
                "--out",
                str(tmp_path),
                "--wandb",
                "disabled",
                "--no-plots",
            ]
        )
        == 0
    )
    rows = {r["configuration"]: r for r in read_table(tmp_path / "report.md", "fp8 against bf16")}
    assert set(rows) == {"precision=fp8", "precision=fp8,precision.fp8.recipe=rowwise"}
    assert {r["bf16 reference"] for r in rows.values()} == {"precision=bf16"}
    tensorwise = rows["precision=fp8"]
    half = T2 * 0.5 / math.sqrt(3)  # -6, -5.5, -5 points against bf16
    assert tensorwise["parity vs bf16"] == f"**worse by 5.50 ± {half:.2f} points**"
    assert tensorwise["speedup vs bf16"] == "2.00x (2.00 to 2.00)"
    rowwise = rows["precision=fp8,precision.fp8.recipe=rowwise"]
    half = T2 * (0.1 / math.sqrt(3)) / math.sqrt(3)  # +0.2, +0.1, +0.1 points: sd 0.0577
    assert rowwise["Δ val acc vs bf16 (points)"] == f"+0.13 ± {half:.2f}"
    assert rowwise["parity vs bf16"].startswith("within noise")
    assert rowwise["speedup vs bf16"] == "1.25x (1.25 to 1.25)"


def test_compile_time_is_shown_and_counted_in_time_to_target_not_in_epoch_time(tmp_path):
    time_to_target_sweep(tmp_path)
    for seed in range(3):  # the fp16 runs compiled: 1.5 s before their first epoch's steps
        metrics = tmp_path / f"{3 + seed}" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        rows[1]["perf/compile_s"] = 1.5  # the first epoch's row
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    fp32, fp16, _ = read_table(tmp_path / "report.md", "Speed")
    assert (fp32["compile (s)"], fp16["compile (s)"]) == ("0.0 ± 0.0", "1.5 ± 0.0")
    assert fp16["time to target (s)"] == "5.5 ± 0.0"  # 2+1+1 s of epochs and 1.5 s compiling
    assert fp16["epoch time (s)"].startswith("1.000")  # the timed epochs alone


# --- a language model's result: val/loss in nats, lower is better -------------------------------


def lm_runs(root: Path, precision: str, losses: list[list[float]], first: int = 0) -> None:
    """Runs of one configuration of a language model: `losses[k]` is seed k's val loss at each
    epoch (its result), as a run of model=gpt dataset=text records it."""
    task = {"name": "language_model", **LanguageModelling.result.record(), "block_size": 64}
    for seed, per_epoch in enumerate(losses):
        path = make_run(root, str(first + seed), precision, seed, [0.0] * len(per_epoch),
                        [2.0] + [1.0] * (len(per_epoch) - 1))  # fmt: skip
        summary = json.loads((path / "summary.json").read_text())
        summary["ran"]["task"] = task
        (path / "summary.json").write_text(json.dumps(summary))
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        epochs = iter(per_epoch)
        for row in rows:
            if "epoch" in row:
                del row["val/acc"]
                row["val/loss"] = next(epochs)
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_language_model_is_judged_by_its_val_loss_lower_being_better(tmp_path, capsys):
    lm_runs(tmp_path, "fp32", [[3.0, 2.00], [3.0, 2.01], [3.0, 2.02]])
    lm_runs(tmp_path, "fp16", [[3.0, 2.10], [3.0, 2.11], [3.0, 2.12]], first=3)  # worse: higher
    lm_runs(tmp_path, "bf16", [[3.0, 1.90], [3.0, 1.91], [3.0, 1.92]], first=6)  # better: lower
    lm_runs(tmp_path, "tf32", [[3.0, 2.005], [3.0, 2.015], [3.0, 2.025]], first=9)  # within
    built = build_report([tmp_path])
    fp16, bf16, tf32 = (config(built, p) for p in ("fp16", "bf16", "tf32"))
    assert fp16.tolerance == 0.02 and fp16.spec.metric == "val/loss"
    assert fp16.d_result.value == pytest.approx(0.10) and fp16.parity == "worse"
    assert bf16.d_result.value == pytest.approx(-0.10) and bf16.parity == "better"
    assert tf32.parity == "within noise"
    # the default target is fp32's loss plus the tolerance, reached when the loss gets below it
    assert fp16.target == pytest.approx(2.01 + 0.02)
    assert bf16.time_to_target.value == pytest.approx(3.0)  # 2 + 1 s: below 2.03 at epoch 2
    assert fp16.reached == 0

    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "worse than fp32 by more than 0.02 nats of val/loss: precision=fp16 (+0.1000 ± " in out
    rows = {
        r["configuration"]: r
        for r in read_table(tmp_path / "report.md", "Validation loss against fp32")
    }
    assert rows["precision=fp16"]["parity"].startswith("**worse by 0.1000 ± ")
    assert rows["precision=bf16"]["parity"].startswith("better by 0.1000 ± ")
    assert rows["precision=fp32"]["val loss (nats)"] == "2.0100 ± 0.0248"


def test_a_planned_runs_need_is_shown_beside_the_measured_peak(tmp_path):
    """A GPU run plans itself (trainer.plan): the report puts the plan's need (what it judged
    against the device) beside the peak the allocator measured, so that a sweep shows the plan's
    error; a captured step's need is more than either peak. An unplanned run shows n/a, and a
    run recorded before plans had a need shows its larger peak."""
    make_run(tmp_path, "0", "fp32", 0, [0.9] * 3, [5.0, 2.0, 2.0], gpu_mib=[1200, 1120, 1120])
    bf16 = make_run(tmp_path, "1", "bf16", 0, [0.9] * 3, [5.0, 1.0, 1.0], gpu_mib=[800, 740, 740])
    fp16 = make_run(tmp_path, "2", "fp16", 0, [0.9] * 3, [5.0, 1.0, 1.0], gpu_mib=[800, 740, 740])
    peaks = {"train_step": 700 * 2**20, "validation": 300 * 2**20}
    plans = {  # a captured step: its pool stays reserved while validation allocates beside it
        bf16: {"peak_bytes": peaks, "need_bytes": 950 * 2**20, "captured": True, "bytes": {}},
        fp16: {"peak_bytes": peaks, "bytes": {}},  # recorded before the need was
    }
    for run, plan in plans.items():
        summary = json.loads((run / "summary.json").read_text())
        summary["ran"]["plan"] = plan
        (run / "summary.json").write_text(json.dumps(summary))
    report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"])
    rows = {r["configuration"]: r for r in read_table(tmp_path / "report.md", "Speed")}
    assert rows["precision=bf16"]["planned peak (MiB)"] == "950.0"
    assert rows["precision=bf16"]["peak memory (MiB)"] == "740.0"
    assert rows["precision=fp16"]["planned peak (MiB)"] == "700.0"
    assert rows["precision=fp32"]["planned peak (MiB)"] == "n/a"
    assert "Planned peak: the need of the run's own plan" in (tmp_path / "report.md").read_text()


def test_a_gpu_runs_reserved_peak_reaches_the_report_and_its_wandb_tables(tmp_path):
    """A GPU run logs the allocator's reserved peak beside its allocated one: what must fit the
    device, and what a captured step's plan is read against. The report shows it per
    configuration and per run (the W&B tables' columns), and the W&B view draws it."""
    make_run(tmp_path, "0", "fp32", 0, [0.9] * 3, [5.0, 2.0, 2.0], gpu_mib=[1200, 1120, 1120],
             reserved_mib=[2048, 1300, 1310])  # fmt: skip
    make_run(tmp_path, "1", "bf16", 0, [0.9] * 3, [5.0, 1.0, 1.0], gpu_mib=[800, 740, 740],
             reserved_mib=[1024, 900, 880])  # fmt: skip
    built = build_report([tmp_path], 0.5)
    bf16 = config(built, "bf16")
    assert bf16.values()["peak_reserved_mib"] == 900  # as the allocated peak: after epoch 1
    assert run_values(bf16.rows[0], None)["peak_reserved_mib"] == 900
    report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"])
    fp32_row, bf16_row = read_table(tmp_path / "report.md", "Speed")
    assert (fp32_row["reserved peak (MiB)"], bf16_row["reserved peak (MiB)"]) == ("1310.0", "900.0")
    assert "Reserved peak: the caching allocator's" in (tmp_path / "report.md").read_text()
    memory = sections(["val/acc"], {"mem/peak_allocated_mib", "mem/peak_reserved_mib"})[-1]
    assert memory["name"] == "Memory"
    assert [p["y"] for p in memory["panels"]] == [
        ["mem/peak_allocated_mib"],
        ["mem/peak_reserved_mib"],
    ]


def test_a_cpu_report_has_no_reserved_column(tmp_path):
    final_only(tmp_path, "fp32", [0.9], seeds=(0,))
    report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"])
    (row,) = read_table(tmp_path / "report.md", "Speed")
    assert "reserved peak (MiB)" not in row and row["peak memory (MiB)"] == "100.0"
