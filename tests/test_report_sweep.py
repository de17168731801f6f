"""A sweep over precision and one more key (mpexp/report/axes.py, sensitivity.py): the result
against that key, a curve per precision and a panel per value of a further key, the LR
sensitivity of Wortsman et al. (2023), step-budget runs drawn by step, legends that scale.
A real tiny-GPT sweep made once for the module; hand-made runs where the numbers are the point."""

from __future__ import annotations

import copy
import inspect
import json
import math
import statistics
from pathlib import Path

import pytest
import yaml
from matplotlib.image import imread

from mpexp.report import cli as report
from mpexp.report import plots
from mpexp.report.axes import sweep_axis
from mpexp.report.sensitivity import curve_sensitivity, lr_sensitivity
from mpexp.report.table import build_report
from mpexp.report.wandb_view import SPEC_FILE
from mpexp.run.runner import train
from mpexp.tasks.language_model import LanguageModelling
from mpexp.tracking.run_context import RunContext
from tests.conftest import CONF, make_cfg
from tests.test_report import PNG_SIGNATURE, read_table
from tests.test_report_numbers import make_run

LRS = ["1e-3", "1e-2", "1e-1"]
# a two-epoch step budget: validation at steps 8 and 12, the second mid-epoch
STEPS = 12


@pytest.fixture(scope="module")
def lr_sweep(tmp_path_factory) -> Path:
    """precision x learning rate, two seeds, a tiny GPT for a dozen steps on a small text, each
    job trained in this process with the overrides a sweep's job records (Hydra's multirun
    composes each job twice: seconds a job on two shared cores); then its report, with plots."""
    sweep = tmp_path_factory.mktemp("lr_sweep")
    text = sweep / "corpus.txt"
    text.write_text(inspect.getsource(json) * 2)  # a small corpus: no scan of the stdlib
    job = 0
    for precision in ("fp32", "bf16"):
        base = make_cfg(
            "model=gpt", "dataset=text", f"dataset.path={text}", "model.n_layer=1",
            "model.n_embd=16", "model.n_head=2", "model.block_size=16", "dataset.train_size=64",
            "dataset.val_size=16", "dataset.batch_size=8", "trainer.epochs=null",
            f"trainer.max_steps={STEPS}", "trainer.log_every=4", "optimizer=adamw",
            "trainer.progress=false", "wandb.mode=disabled", "wandb.group=lr-sweep",
            f"precision={precision}",
        )  # fmt: skip
        for lr in LRS:
            for seed in (0, 1):
                cfg = copy.deepcopy(base)
                cfg.optimizer.lr, cfg.trainer.seed = float(lr), seed
                given = [f"precision={precision}", f"optimizer.lr={lr}", f"trainer.seed={seed}"]
                train(cfg, RunContext(sweep / str(job), overrides=given))
                job += 1
    assert report.main([str(sweep), "--wandb", "disabled"]) == 0
    return sweep


def finals(sweep: Path) -> dict[tuple[str, float, int], tuple[float, float]]:
    """(precision, lr, seed) -> (final val loss, first train loss), from each run's files."""
    found = {}
    for job in sweep.iterdir():
        if job.name.isdigit():
            summary = json.loads((job / "summary.json").read_text())
            rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
            first = next(r["train/loss"] for r in rows if "train/loss" in r)
            key = (summary["ran"]["precision"], summary["config"]["optimizer"]["lr"],
                   summary["config"]["trainer"]["seed"])  # fmt: skip
            found[key] = (summary["val/loss"], first)
    return found


def test_a_precision_by_lr_sweep_gets_its_table_figure_and_sensitivities(lr_sweep):
    text = (lr_sweep / "report.md").read_text()
    table = read_table(lr_sweep / "report.md", "Validation loss against optimizer.lr")
    assert [row["precision"] for row in table] == ["fp32", "bf16"]
    runs = finals(lr_sweep)
    rates = [float(r) for r in LRS]
    for row in table:
        precision = row["precision"]
        # the mean over the two seeds at each rate, ± t(1) * sd / sqrt(2)
        for shown, lr in zip(LRS, rates, strict=True):  # a column per rate, as the sweep gave it
            losses = [runs[(precision, lr, seed)][0] for seed in (0, 1)]
            half = 12.706 * statistics.stdev(losses) / math.sqrt(2)
            cell = f"{statistics.fmean(losses):.4f} ± {half:.4f}"
            assert row[f"optimizer.lr={shown}"].strip("*") == cell
        # per seed: the mean over the rates of min(loss, first train loss) minus the best
        per_seed = []
        for seed in (0, 1):
            losses = [runs[(precision, lr, seed)][0] for lr in rates]
            initial = statistics.fmean(runs[(precision, lr, seed)][1] for lr in rates)
            capped = [min(loss, initial) for loss in losses]
            per_seed.append(statistics.fmean(capped) - min(capped))
        half = 12.706 * statistics.stdev(per_seed) / math.sqrt(2)
        assert row["LR sensitivity"] == f"{statistics.fmean(per_seed):.4f} ± {half:.4f}"
        means = {lr: statistics.fmean(runs[(precision, lr, s)][0] for s in (0, 1)) for lr in rates}
        assert float(row["best rate"]) == min(means, key=means.get)
    # bf16 against fp32 along the rates, in one sentence, which says so where the verdicts
    # (two seeds each) do not decide it
    (kept,) = [line for line in text.splitlines() if "bf16 keeps" in line or "bf16 falls" in line]
    assert "fp32's val loss (within 0.02 nats)" in kept or "falls behind fp32" in kept
    verdicts = {c.parity for c in build_report([lr_sweep]).configs if c.first.precision == "bf16"}
    undecided = bool(verdicts & {"too wide", "single seed"})
    assert kept.startswith("- Undecided at 2 seeds: indicative only. By the mean, ") == undecided

    figure = lr_sweep / "sweep_optimizer.lr.png"
    assert figure.read_bytes()[:8] == PNG_SIGNATURE and min(imread(figure).shape[:2]) > 100
    assert "](sweep_optimizer.lr.png)" in text

    # the W&B view holds the same panel: each run's final loss against its rate, on a log axis
    spec = json.loads((lr_sweep / SPEC_FILE).read_text())
    (result,) = [s["panels"] for s in spec["sections"] if s["name"] == "Result"]
    (scatter,) = [p for p in result if p["kind"] == "scatter"]
    assert (scatter["x"], scatter["y"], scatter["log_x"]) == (
        "optimizer.lr",
        ["val/loss.last"],
        True,
    )


def test_a_step_budget_sweep_is_drawn_against_steps(lr_sweep):
    built = build_report([lr_sweep])
    drawn = plots.figures(built)
    (per_step, _) = drawn["result"][0].axes
    (_, val) = drawn["loss_curves"][0].axes
    for ax in (per_step, val):
        assert ax.get_xlabel() == "step"
        runs = [line for line in ax.get_lines() if list(line.get_xdata()) != [0, 1]]
        assert {tuple(line.get_xdata()) for line in runs} == {(8, STEPS)}
    # a line per run, and a target line per fp32 reference (x from 0 to 1: the axis' width)
    lines = per_step.get_lines()
    assert len(lines) == len(built.rows) + len([c for c in built.configs if c.is_reference])
    # and in W&B, the validation values by step
    spec = json.loads((lr_sweep / SPEC_FILE).read_text())
    lines = [p for s in spec["sections"] for p in s["panels"] if p.get("y") == ["val/loss"]]
    assert {p["x"] for p in lines} >= {"step"} and "epoch" not in {p["x"] for p in lines}


def test_every_png_of_the_sweep_was_looked_at(lr_sweep):
    """The PNGs a sweep writes, each an image of a readable size (they were also opened and
    looked at by hand when this test was written: tests can't see them)."""
    pngs = sorted(p.name for p in lr_sweep.glob("*.png"))
    assert pngs == ["epoch_time.png", "loss_curves.png", "peak_memory.png", "result.png",
                    "sweep_optimizer.lr.png"]  # fmt: skip


# --- hand-made runs --------------------------------------------------------------------------


def lm_run(root: Path, job: int, precision: str, lr: str, seed: int, final: float,
           initial: float = 5.5, qk_norm: str | None = None) -> None:  # fmt: skip
    """A finished language-model run of a sweep's job: its final val loss and its first
    training loss (the loss at initialisation), the learning rate (and qk_norm) overridden."""
    path = make_run(root, str(job), precision, seed, [0.0], [1.0])
    summary = json.loads((path / "summary.json").read_text())
    extra = [f"optimizer.lr={lr}", *([f"model.qk_norm={qk_norm}"] if qk_norm else [])]
    summary["overrides"] = [*extra, *summary["overrides"]]
    summary["ran"]["task"] = {"name": "language_model", **LanguageModelling.result.record()}
    (path / "summary.json").write_text(json.dumps(summary))
    step, epoch = (json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines())
    step["train/loss"] = initial
    del epoch["val/acc"]
    epoch["val/loss"] = final
    (path / "metrics.jsonl").write_text(json.dumps(step) + "\n" + json.dumps(epoch) + "\n")


def test_lr_sensitivity_is_the_formulas_value():
    # capped at the initial 3.0: 2.0, 1.5, 3.0 (diverged), 3.0 (above it); best 1.5
    assert lr_sensitivity([2.0, 1.5, math.nan, 4.0], 3.0) == pytest.approx(2.375 - 1.5)
    assert lr_sensitivity([1.0, 1.0], 3.0) == 0.0


def test_a_curves_sensitivity_best_rate_and_range_over_seeds(tmp_path):
    rates = ["1e-3", "3e-3", "1e-2", "3e-2"]
    # both seeds diverge at 3e-2: counted as the initial loss, 5.0
    seeds = {0: [2.00, 1.50, 1.51, math.nan], 1: [2.10, 1.52, 1.53, math.inf]}
    job = 0
    for seed, losses in seeds.items():
        for lr, loss in zip(rates, losses, strict=True):
            lm_run(tmp_path, job, "fp32", lr, seed, loss, initial=5.0)
            job += 1
    axis = sweep_axis(build_report([tmp_path]).configs)
    (panel,) = axis.panels
    (curve,) = panel.curves
    found = curve_sensitivity(curve)
    per_seed = [lr_sensitivity(seeds[0], 5.0), lr_sensitivity(seeds[1], 5.0)]
    assert per_seed == pytest.approx([(2.0 + 1.5 + 1.51 + 5.0) / 4 - 1.5,
                                      (2.1 + 1.52 + 1.53 + 5.0) / 4 - 1.52])  # fmt: skip
    assert found.value.value == pytest.approx(statistics.fmean(per_seed))
    assert found.value.half_width == pytest.approx(12.706 * statistics.stdev(per_seed) / 2**0.5)
    assert found.best.shown == "3e-3" and found.best_loss == pytest.approx(1.51)
    # 1e-2's mean (1.52) is within 0.02 nats of the best; 1e-3's (2.05) is not
    assert (found.within[0].shown, found.within[1].shown) == ("3e-3", "1e-2")
    # the figure marks the rate where every seed diverged with an x, and draws the others
    (ax,) = plots.sweep(axis).axes
    line, diverged = ax.get_lines()
    assert list(line.get_xdata()) == [1e-3, 3e-3, 1e-2]
    assert diverged.get_marker() == "x" and list(diverged.get_xdata()) == [3e-2]
    assert diverged.get_label() == "fp32: every seed diverged"


def test_a_second_key_makes_panels_and_each_precision_is_judged_at_its_rate(tmp_path):
    """bf16 keeps fp32's loss up to 3e-3 without qk_norm, then falls behind; with qk_norm it
    keeps it everywhere: the sentence the report says, and a panel each in the figure."""
    rates = ["1e-3", "3e-3", "1e-2", "3e-2"]
    fp32 = {"false": [1.60, 1.50, 1.70, 2.00], "true": [1.55, 1.50, 1.55, 1.60]}
    bf16 = {"false": [1.60, 1.505, 1.80, 2.20], "true": [1.55, 1.50, 1.56, 1.61]}
    job = 0
    for precision, losses in (("fp32", fp32), ("bf16", bf16)):
        for qk, values in losses.items():
            for lr, loss in zip(rates, values, strict=True):
                for seed in (0, 1):  # the same loss for both seeds: a zero-width interval
                    lm_run(tmp_path, job, precision, lr, seed, loss, qk_norm=qk)
                    job += 1
    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    text = (tmp_path / "report.md").read_text()
    table = read_table(tmp_path / "report.md", "Validation loss against optimizer.lr")
    assert [(r["panel"], r["precision"]) for r in table] == [
        ("model.qk_norm=false", "fp32"), ("model.qk_norm=false", "bf16"),
        ("model.qk_norm=true", "fp32"), ("model.qk_norm=true", "bf16"),
    ]  # fmt: skip
    assert table[1]["optimizer.lr=1e-2"] == "**1.8000 ± 0.0000**"  # worse than fp32 at 1e-2
    assert (
        "- **model.qk_norm=false**: bf16 keeps fp32's val loss (within 0.02 nats) up to "
        "optimizer.lr=3e-3; above it, Δ +0.1500 nats on average (at most +0.2000)." in text
    )
    assert (
        "- **model.qk_norm=true**: bf16 keeps fp32's val loss (within 0.02 nats) at every "
        "optimizer.lr swept, up to 3e-2." in text
    )

    axis = sweep_axis(build_report([tmp_path]).configs)
    figure = plots.sweep(axis)
    assert [ax.get_title() for ax in figure.axes] == ["model.qk_norm=false", "model.qk_norm=true"]
    assert {ax.get_xscale() for ax in figure.axes} == {"log"}  # 1e-3 to 3e-2 spans a decade
    no_qk = figure.axes[0]
    lines = {line.get_label(): line for line in no_qk.get_lines()}
    bf16_line = next(line for label, line in lines.items() if label.startswith("bf16"))
    assert list(bf16_line.get_ydata()) == pytest.approx(bf16["false"])


def test_many_configurations_are_labelled_by_the_keys_that_differ(tmp_path):
    job = 0
    for precision in ("fp32", "bf16"):
        for qk in ("false", "true"):
            for lr in ("1e-3", "1e-2", "1e-1"):
                lm_run(tmp_path, job, precision, lr, 0, 2.0, qk_norm=qk)
                job += 1
    built = build_report([tmp_path])
    labels = plots._legend_labels(built.configs)
    assert len(labels) == 12 and labels[0] == "fp32, lr=1e-3, qk_norm=false (n=1)"
    assert "optimizer.lr" not in " ".join(labels)


def test_the_target_line_is_drawn_wherever_there_is_a_target(tmp_path):
    for job, precision in enumerate(("fp32", "bf16")):
        make_run(tmp_path, str(job), precision, 0, [0.5, 0.9], [1.0, 1.0])
    default = build_report([tmp_path])
    asked = build_report([tmp_path], target=80)
    # the default target, fp32's final result less the tolerance: a line in fp32's colour
    (per_epoch, _) = plots.figures(default)["result"][0].axes
    *runs, target = per_epoch.get_lines()
    assert len(runs) == 2 and target.get_ydata()[0] == 90 - 0.5 and target.get_color() == "C0"
    (per_epoch, _) = plots.figures(asked)["result"][0].axes
    assert len(per_epoch.get_lines()) == 3 and per_epoch.get_lines()[-1].get_ydata()[0] == 80


def test_runs_that_validated_once_get_no_result_plot(tmp_path, capsys):
    for job, precision in enumerate(("fp32", "bf16")):
        make_run(tmp_path, str(job), precision, 0, [0.9], [1.0])
    assert report.main([str(tmp_path), "--wandb", "disabled"]) == 0
    assert not (tmp_path / "result.png").exists()
    text = (tmp_path / "report.md").read_text()
    assert "Each run validated once, at its end" in text
    # the loss curves keep the training loss alone
    (fig, _) = plots.figures(build_report([tmp_path]))["loss_curves"]
    assert [ax.get_xlabel() for ax in fig.axes] == ["step"]


def test_the_lr_sensitivity_preset_sweeps_a_log_grid_of_rates_by_precision_and_qk_norm():
    preset = yaml.safe_load((CONF / "experiment" / "lr_sensitivity.yaml").read_text())
    params = preset["hydra"]["sweeper"]["params"]
    rates = [float(r) for r in params["optimizer.lr"].split(",")]
    assert rates[-1] / rates[0] >= 100 and rates == sorted(rates)  # decades: a log grid
    assert params["precision"] == "fp32,bf16" and params["model.qk_norm"] == "false,true"
    assert len(params["trainer.seed"].split(",")) == 3
    cfg = make_cfg("experiment=lr_sensitivity")
    assert (cfg.model.n_layer, cfg.trainer.max_steps, cfg.trainer.epochs) == (2, 300, None)
