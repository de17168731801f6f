"""The report concludes (mpexp/report/bottom_line.py, power.py, more_seeds.py): a line per
configuration that says use it, don't, or undecided with the seeds that would decide it and the
command that adds them; and no sentence of the report says more than its verdicts do. Hand-made
runs with known values, checked against hand counts and printed t tables."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import yaml

from mpexp.report import cli as report
from mpexp.report.bottom_line import decisions, markdown
from mpexp.report.table import build_report
from mpexp.report.wandb_view import view_spec
from tests.test_report_numbers import make_run
from tests.test_report_sweep import lm_run

# two-sided 95 % (0.975) and one-sided 80 % quantiles of Student's t, from a printed table
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179}  # fmt: skip
T80 = {1: 1.376, 2: 1.061, 3: 0.978, 4: 0.941, 5: 0.920, 6: 0.906, 7: 0.896, 8: 0.889,
       9: 0.883, 10: 0.879, 11: 0.876, 12: 0.873}  # fmt: skip
FP32 = [0.90, 0.92, 0.94]


def runs(root: Path, precision: str, finals: list[float], times: list[float], first: int,
         seeds=(0, 1, 2), folder: str = "") -> None:  # fmt: skip
    """A configuration's runs: a warm-up epoch, then three timed epochs at `times[k]` each, the
    last reaching `finals[k]`."""
    for k, (seed, final) in enumerate(zip(seeds, finals, strict=True)):
        accs = [0.5, 0.6, 0.7, final]
        make_run(root / folder, str(first + k), precision, seed, accs, [5.0, *[times[k]] * 3])


def line_of(found, precision: str) -> str:
    (line,) = [d.line for d in found if d.config.first.precision == precision]
    return line


def test_use_it_dont_when_worse_and_dont_when_slower(tmp_path):
    runs(tmp_path, "fp32", FP32, [2.0, 2.2, 1.8], first=0)
    runs(tmp_path, "bf16", [0.901, 0.921, 0.941], [1.0, 1.1, 0.9], first=3)  # +0.1 each: kept
    runs(tmp_path, "fp16", [0.85, 0.865, 0.89], [1.0, 1.1, 0.9], first=6)  # -5.17 ± 0.72
    runs(tmp_path, "tf32", [0.901, 0.921, 0.941], [4.0, 4.4, 3.6], first=9)  # half the speed
    built = build_report([tmp_path])
    found = decisions(built)
    speedup = next(c for c in built.configs if c.first.precision == "bf16").speedup
    assert line_of(found, "bf16") == (
        "**precision=bf16**: use it: within 0.5 points of fp32 (Δ +0.10 ± 0.00 points); "
        f"2.00x ({speedup.low:.2f} to {speedup.high:.2f}) its speed, 1.00x its memory."
    )
    assert line_of(found, "fp16") == (
        "**precision=fp16**: don't: worse than fp32 by 5.17 ± 0.72 points (tolerance 0.5)."
    )
    slower = line_of(found, "tf32")
    assert slower.startswith("**precision=tf32**: don't: slower than fp32, 0.50x (")
    assert slower.endswith("its speed; its val acc within the tolerance.")
    assert markdown(built).count("\n- ") == 2  # three lines, and no seeds to add

    # the bottom line opens report.md, before any table, and ends the console's output with it
    assert report.main([str(tmp_path), "--wandb", "disabled", "--no-plots"]) == 0
    text = (tmp_path / "report.md").read_text()
    assert text.index("## Bottom line") < text.index("|")
    assert f"- {line_of(found, 'fp16')}" in text


def test_undecided_says_how_many_seeds_would_decide_and_the_command_that_adds_them(tmp_path):
    sweep = tmp_path / "sweep"
    # per-seed differences +0.4, -0.6, +0.2 points: mean 0.0, ± 1.31 at 2 df: across -0.5
    runs(sweep, "fp32", FP32, [2.0, 2.0, 2.0], first=0)
    runs(sweep, "bf16", [0.904, 0.914, 0.942], [1.0, 1.0, 1.0], first=3)
    hydra = {"hydra": {"overrides": {
        "task": ["experiment=quickstart", "precision=fp32,bf16", "trainer.seed=0,1,2"],
        "hydra": [f"hydra.sweep.dir={sweep}", "hydra.mode=MULTIRUN", "hydra/launcher=basic"],
    }}}  # fmt: skip
    (sweep / "multirun.yaml").write_text(yaml.safe_dump(hydra))
    for job in sweep.glob("[0-9]*"):  # the runs went to W&B, in the sweep's group
        summary = json.loads((job / "summary.json").read_text())
        summary["wandb"] = {"mode": "offline", "project": "mpexp", "group": "sweep-x"}
        (job / "summary.json").write_text(json.dumps(summary))

    sweep = sweep.resolve()  # as the report names it
    built = build_report([sweep])
    (found,) = decisions(built)
    diffs = [0.4, -0.6, 0.2]
    s, margin = statistics.stdev(diffs), statistics.fmean(diffs) + 0.5  # to -0.5
    assert margin == pytest.approx(0.5)
    # the smallest n whose interval, at this spread, would clear the tolerance at 80 % power
    n = next(k for k in range(2, 13) if (T975[k - 1] + T80[k - 1]) * s / math.sqrt(k) <= margin)
    assert (T975[n - 2] + T80[n - 2]) * s / math.sqrt(n - 1) > margin
    half = T975[2] * s / math.sqrt(3)
    assert found.line == (
        f"**precision=bf16**: undecided: Δ +0.00 ± {half:.2f} points from 3 seeds straddles the "
        f"tolerance of 0.5 points; {n} seeds each would decide it at the spread measured (power "
        "calculation, 80 %); 2.00x (2.00 to 2.00) its speed, 1.00x its memory."
    )
    added = list(range(3, n))
    command = (
        "python -m mpexp.train -m experiment=quickstart precision=fp32,bf16 wandb.group=sweep-x "
        f"trainer.seed={','.join(map(str, added))} hydra/launcher=basic "
        f"hydra.sweep.dir={sweep}/seeds-3-{n - 1} && python -m mpexp.report {sweep}"
    )
    assert f"To add seeds 3 to {n - 1}" in markdown(built) and command in markdown(built)

    # what that command leaves: new runs in a folder of the sweep's, in its W&B group; the
    # report on the sweep finds them and counts them as more seeds of the same configurations
    for k, seed in enumerate(added):
        for precision, final in (("fp32", 0.92), ("bf16", 0.92)):
            job = make_run(sweep / f"seeds-3-{n - 1}", f"{2 * k}_{precision}_{seed}", precision,
                           seed, [0.5, 0.6, 0.7, final], [5.0, 1.0, 1.0, 1.0])  # fmt: skip
            summary = json.loads((job / "summary.json").read_text())
            summary["overrides"].append("wandb.group=sweep-x")
            (job / "summary.json").write_text(json.dumps(summary))
    again = build_report([sweep])
    assert [(c.first.precision, c.n) for c in again.configs] == [("fp32", n), ("bf16", n)]


def test_a_single_seed_asks_for_three_and_says_no_spread_was_measured(tmp_path):
    runs(tmp_path, "fp32", [0.90], [1.0], first=0, seeds=(0,))
    runs(tmp_path, "bf16", [0.92], [1.0], first=1, seeds=(0,))
    built = build_report([tmp_path])
    (found,) = decisions(built)
    assert found.line.startswith(
        "**precision=bf16**: undecided: Δ +2.00 points from one seed, no spread measured; 3 seeds "
        "each give a first interval;"
    )
    assert "To add seeds 1 to 2" in markdown(built)
    assert "python -m mpexp.train -m precision=fp32,bf16 trainer.seed=1,2 " in markdown(built)


def test_the_wandb_view_opens_with_the_bottom_line(tmp_path):
    runs(tmp_path, "fp32", FP32, [2.0, 2.0, 2.0], first=0)
    runs(tmp_path, "bf16", [0.85, 0.865, 0.89], [1.0, 1.0, 1.0], first=3)
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {}}}))
    built = build_report([tmp_path])
    spec = view_spec(built)
    first = spec["sections"][0]
    assert (first["name"], first["open"]) == ("Bottom line", True)
    (panel,) = first["panels"]
    assert panel == {"kind": "markdown", "title": "Bottom line", "text": markdown(built)}
    assert "don't: worse than fp32 by 5.17" in panel["text"]


# --- the report's sentences against its verdicts ---------------------------------------------


def lr_grid(root: Path, seeds: tuple[int, ...], bf16_offset: float) -> None:
    """fp32 and bf16 over three rates, bf16 `bf16_offset` nats from fp32 at each; the best rate
    the lowest; with several seeds a spread of 0.01 nats."""
    job = 0
    for precision, offset in (("fp32", 0.0), ("bf16", bf16_offset)):
        for lr, loss in zip(("1e-3", "1e-2", "1e-1"), (2.0, 2.3, 2.6), strict=True):
            for seed in seeds:
                lm_run(root, job, precision, lr, seed, loss + offset + 0.01 * seed)
                job += 1


def sentences(root: Path) -> list[str]:
    assert report.main([str(root), "--wandb", "disabled", "--no-plots"]) == 0
    text = (root / "report.md").read_text().split("## Validation loss against optimizer.lr")[1]
    return [line for line in text.split("\n## ")[0].splitlines() if line.startswith("- ")]


def test_one_seed_keeps_up_only_indicatively_and_a_best_rate_at_the_edge_says_so(tmp_path):
    lr_grid(tmp_path, (0,), 0.005)
    said = sentences(tmp_path)
    assert said == [
        "- fp32's best optimizer.lr, 1e-3, is the lowest swept: its optimum may lie below the "
        "grid; try optimizer.lr=0.0001 next.",
        "- bf16's best optimizer.lr, 1e-3, is the lowest swept: its optimum may lie below the "
        "grid; try optimizer.lr=0.0001 next.",
        "- One seed: indicative only. By the mean, bf16 keeps fp32's val loss (within 0.02 "
        "nats) at every optimizer.lr swept, up to 1e-1.",
    ]
    text = (tmp_path / "report.md").read_text()
    assert "One seed: the sensitivities and best rates are indicative only." in text


def test_decided_verdicts_keep_up_plainly_and_two_seeds_are_warned_about(tmp_path):
    lr_grid(tmp_path, (0, 1), 0.005)  # the same spread on both sides: paired, zero-width
    kept = sentences(tmp_path)[-1]
    assert kept == (
        "- bf16 keeps fp32's val loss (within 0.02 nats) at every optimizer.lr swept, up to 1e-1."
    )
    text = (tmp_path / "report.md").read_text()
    assert "**Two seeds.**" in text and "3.6 times as wide as from three" in text
    assert "indicative only" not in text
