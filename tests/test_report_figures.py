"""Every figure of the report draws what its title and legend say (mpexp/report/plots.py): read
from the matplotlib Figures the report builds, against the runs' own numbers. Hand-made runs:
fp32 and bf16 whose curves coincide, two seeds each."""

from __future__ import annotations

import statistics

import pytest
from matplotlib.collections import LineCollection, PathCollection, PolyCollection

from mpexp.report import plots
from mpexp.report.axes import sweep_axis
from mpexp.report.table import build_report
from tests.test_report_numbers import make_run
from tests.test_report_sweep import lm_run

ACCS = [0.5, 0.7, 0.8, 0.9]


@pytest.fixture(scope="module")
def coinciding(tmp_path_factory):
    """fp32 and bf16 with the same results, two seeds each, four epochs: three timed, of
    different lengths."""
    root = tmp_path_factory.mktemp("coinciding")
    for job, (precision, seed) in enumerate([("fp32", 0), ("fp32", 1), ("bf16", 0), ("bf16", 1)]):
        make_run(root, str(job), precision, seed, ACCS, [3.0, 1.0 + seed, 1.2, 0.9])
    return build_report([root])


def labelled(ax) -> list:
    return [line for line in ax.get_lines() if not line.get_label().startswith("_")]


def test_every_axis_says_what_it_holds(coinciding, tmp_path):
    make_run(tmp_path, "0", "fp32", 0, ACCS, [3.0, 1.0, 1.0, 1.0])
    make_run(tmp_path, "1", "fp16", 0, ACCS, [3.0, 1.0, 1.0, 1.0], loss_scaling="dynamic")
    scaled = plots.figures(build_report([tmp_path]))
    assert "loss_scale" in scaled
    for name, (figure, _) in [*plots.figures(coinciding).items(), *scaled.items()]:
        for ax in figure.axes:
            if ax.get_label() == "<colorbar>":
                continue
            assert ax.get_xlabel() and ax.get_ylabel(), f"{name}: {ax.get_title()}"


def test_coinciding_curves_stay_visible_the_reference_on_top(coinciding):
    fp32, bf16 = coinciding.configs
    for name in ("result", "loss_curves"):
        figure, _ = plots.figures(coinciding)[name]
        ax = figure.axes[0]
        lines = [line for line in ax.get_lines() if list(line.get_xdata()) != [0, 1]]  # no target
        # a line per run; bf16's drawn first, wide, fp32's last (higher zorder), thin, on top
        by_color = {}
        for line in lines:
            by_color.setdefault(line.get_color(), []).append(line)
        reference, other = by_color["C0"], by_color["C1"]
        assert len(reference) == len(other) == 2
        assert min(r.get_zorder() for r in reference) > max(o.get_zorder() for o in other)
        assert max(r.get_linewidth() for r in reference) < min(o.get_linewidth() for o in other)
        # the legend names each configuration once, drawn as its lines are
        legend = figure.legends[0]
        texts = [t.get_text() for t in legend.get_texts()]
        assert texts[:2] == [f"{fp32.label} (n=2)", f"{bf16.label} (n=2)"]
        reference_handle, other_handle = legend.legend_handles[:2]
        assert reference_handle.get_linewidth() < other_handle.get_linewidth()


@pytest.mark.parametrize("configs", [2, 3, 6, 9])
def test_coinciding_lines_put_their_markers_on_different_points(configs):
    """An lr sweep of fp32 and bf16 at three rates is six configurations whose curves may lie on
    one another: each marks points of its own (before: pairs of them marked the same points)."""
    for count in (24, 60, 500):
        marked = []
        for index in range(configs):
            start, every = plots._marks(count, index, configs)
            marked.append(set(range(start, count, every)))
            assert len(marked[-1]) >= 2  # still marked along the line
        assert all(a.isdisjoint(b) for i, a in enumerate(marked) for b in marked[i + 1 :])


def test_the_result_draws_each_runs_values_and_the_target_there_is(coinciding):
    figure, _ = plots.figures(coinciding)["result"]
    per_epoch, _ = figure.axes
    runs = [r for c in coinciding.configs for r in c.rows]
    drawn = [line for line in per_epoch.get_lines() if list(line.get_xdata()) != [0, 1]]
    assert [tuple(line.get_ydata()) for line in drawn] == [tuple(100 * a for a in ACCS)] * 4
    assert len(runs) == 4
    # the default target: fp32's mean final result less the tolerance, in fp32's colour
    (target,) = [line for line in per_epoch.get_lines() if len(set(line.get_ydata())) == 1
                 and list(line.get_xdata()) == [0, 1]]  # fmt: skip
    assert target.get_ydata()[0] == pytest.approx(90.0 - 0.5)
    texts = [t.get_text() for t in figure.legends[0].get_texts()]
    assert texts[-1] == f"target: 89.5 % ({coinciding.configs[0].label})"
    # a target asked for is one grey line for all
    asked = build_report([coinciding.out_dir], target=80)
    figure, _ = plots.figures(asked)["result"]
    texts = [t.get_text() for t in figure.legends[0].get_texts()]
    assert texts[-1] == "target: 80 %"


def test_the_epoch_time_draws_epochs_medians_and_ranges_or_says_it_has_one_each(
    coinciding, tmp_path
):
    figure, _ = plots.figures(coinciding)["epoch_time"]
    (ax,) = figure.axes
    assert "each timed epoch (dots), each run's median (marker) and min-max (bar)" in ax.get_title()
    runs = [r for c in coinciding.configs for r in c.rows]
    dots = [c for c in ax.collections if isinstance(c, PathCollection)]
    bars = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert [sorted(d.get_offsets()[:, 1]) for d in dots] == [sorted(r.timed) for r in runs]
    for bar, run in zip(bars, runs, strict=True):
        ((_, low), (_, high)) = bar.get_segments()[0]
        assert (low, high) == (min(run.timed), max(run.timed))
    medians = [line.get_ydata()[0] for line in ax.get_lines()]
    assert medians == [statistics.median(r.timed) for r in runs]

    # one timed epoch a run: the three are one point, and the title says so
    for job, precision in enumerate(("fp32", "bf16")):
        make_run(tmp_path, str(job), precision, 0, [0.5, 0.9], [3.0, 1.0])
    figure, _ = plots.figures(build_report([tmp_path]))["epoch_time"]
    assert "one timed epoch per run" in figure.axes[0].get_title()
    assert "median" not in figure.axes[0].get_title()


@pytest.mark.parametrize(("seeds", "band"), [((0,), False), ((0, 1), True)])
def test_the_sweep_figure_draws_a_band_only_from_two_seeds_and_says_which(tmp_path, seeds, band):
    job = 0
    for precision in ("fp32", "bf16"):
        for lr, loss in (("1e-3", 2.0), ("1e-2", 2.2)):
            for seed in seeds:
                lm_run(tmp_path, job, precision, lr, seed, loss + 0.05 * seed)
                job += 1
    figure = plots.sweep(sweep_axis(build_report([tmp_path]).configs))
    (ax,) = figure.axes
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    title = figure.get_suptitle()
    if band:
        assert len(bands) == 2 and "band from the lowest seed to the highest" in title
    else:
        assert bands == [] and title == "Final val/loss: one seed"
    fp32, bf16 = labelled(ax)
    assert fp32.get_zorder() > bf16.get_zorder()  # the reference on top
    means = [2.0 + 0.05 * statistics.fmean(seeds), 2.2 + 0.05 * statistics.fmean(seeds)]
    assert list(fp32.get_ydata()) == pytest.approx(means)
