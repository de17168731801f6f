"""report.md's Warnings: what makes its numbers less than they seem (few timed epochs, jobs that
overlapped, another step path, different optimizer kernels, runs waiting on data, cut-off
metrics, divergence, one or two seeds), each with what to do about it."""

from __future__ import annotations

import math

from mpexp.report.row import Row
from mpexp.report.sections.cells import run_names
from mpexp.report.stats import t975
from mpexp.report.table import DATA_BOUND, MIN_TIMED_EPOCHS, Report

T2 = t975(1)
# the half-width of a mean's interval from two values over that from three, at one spread:
# t(1) / sqrt(2) against t(2) / sqrt(3)
TWO_OVER_THREE = (t975(1) / math.sqrt(2)) / (t975(2) / math.sqrt(3))


def section(report: Report) -> list[str]:
    warnings = []
    few = report.few_timed_epochs
    if few:
        one_epoch = [r for r in few if len(r.run.epochs) == 1]
        warnings.append(
            f"**Few timed epochs.** {run_names(few)} timed fewer than {MIN_TIMED_EPOCHS} epochs "
            "(the first epoch is not timed: it pays warm-up): an epoch time from one or two "
            "epochs is as much noise as measurement. Train for at least "
            f"{MIN_TIMED_EPOCHS + 1} epochs to compare speed."
            + (
                f" {run_names(one_epoch)} trained one epoch: its time includes the warm-up."
                if one_epoch
                else ""
            )
        )
    overlapping = report.overlapping
    if overlapping:
        warnings.append(
            f"**Jobs overlapped in time.** {run_names(overlapping)} trained while other jobs of "
            "these runs trained on the same machine (a parallel launcher): they competed for it, "
            "so their epoch times, speedups and times to target are not comparable. Run the jobs "
            "one after another (Hydra's default launcher) to compare speed."
        )
    for config, path, reference in report.other_step_paths:
        warnings.append(
            f"**Another step path.** `{config.label}` ran its step {path}; its fp32 reference "
            f"ran {reference}. Its speed against fp32 measures that difference as much as the "
            "precision's."
        )
    kernels = _optimizer_kernels(report)
    if kernels:
        warnings.append(kernels)
    data_bound = report.data_bound
    if data_bound:
        warnings.append(
            f"**Waiting on data.** {run_names(data_bound)} waited for their batches more than "
            f"{DATA_BOUND:.0%} of their epochs' time (`perf/data_wait_share`): their epoch times "
            "and speedups time the data loading, not the precision. Feed them faster before "
            f"comparing speed (docs/speed.md): {_faster_data(data_bound)}."
        )
    cut = [r for r in report.rows if r.run.cut_off]
    if cut:
        warnings.append(
            f"**Cut-off metrics.** {run_names(cut)}: the last line of metrics.jsonl was cut off "
            "mid-write (a crash) and is left out."
        )
    diverged = report.diverged
    if diverged:
        warnings.append(
            f"**Diverged.** {run_names(diverged)}: the final val loss or result is not finite "
            "(NaN or inf). They are marked in the tables and left out of their configurations' "
            "means and comparisons, which the other runs make as usual."
        )
    single = [c for c in report.configs if c.n == 1]
    if single:
        which = ", ".join(f"`{c.label}`" for c in single)
        warnings.append(
            f"**Single seed.** {which}: one run each, so their result has no interval and "
            "their parity is inconclusive. Repeat them with seeds, e.g. `trainer.seed=0,1,2`."
        )
    two = [c for c in report.configs if c.n == 2]
    if two:
        which = ", ".join(f"`{c.label}`" for c in two)
        warnings.append(
            f"**Two seeds.** {which}: an interval from two values has one degree of freedom "
            f"(Student's t {T2:g}), so at the same spread it is {TWO_OVER_THREE:.1f} times as "
            "wide as from three: their intervals and verdicts rarely decide. Three seeds or more, "
            "e.g. `trainer.seed=0,1,2` (the Bottom line says how many would decide)."
        )
    if not warnings:
        return []
    return ["## Warnings", "", *[f"- {w}" for w in warnings], ""]


def _faster_data(rows: list[Row]) -> str:
    """What feeds each run's data faster: the keys its dataset named (`ran.faster_data`), runs
    with the same keys together; runs recorded before the keys were get the general advice."""
    by_keys: dict[tuple[str, ...] | None, list[Row]] = {}
    for row in rows:
        keys = row.run.ran.get("faster_data")
        by_keys.setdefault(None if keys is None else tuple(keys), []).append(row)
    said = []
    for keys, group in by_keys.items():
        if keys is None:
            advice = (
                "more `dataset.num_workers`, or keep in-memory data on the device "
                "(`dataset.loader=device`), or for an image folder `dataset.cache=resized` or "
                "`dataset.decode=gpu`"
            )
        elif not keys:
            advice = "their data has no loading setting that feeds it faster"
        else:
            advice = ", or ".join(f"`{key}`" if "=" in key else f"a higher `{key}`" for key in keys)
        said.append(f"{run_names(group)}: {advice}" if len(by_keys) > 1 else advice)
    return "; ".join(said)


def _optimizer_kernels(report: Report) -> str | None:
    """The warning for configurations whose optimizers ran different implementations of torch's
    (`ran.optimizer_kernel`: fused, foreach, for-loop), None where all ran one (runs recorded
    before mpexp recorded it are left out): on a CPU torch's for-loop Adam takes 4 to 8 times
    its fused kernel's time, which a comparison of their epochs would credit to the precision."""
    by_kernel: dict[str, list[str]] = {}
    for config in report.configs:
        for kernel in sorted({str(r.run.ran["optimizer_kernel"]) for r in config.rows
                              if r.run.ran.get("optimizer_kernel")}):  # fmt: skip
            by_kernel.setdefault(kernel, []).append(f"`{config.label}`")
    if len(by_kernel) < 2:
        return None
    ran = "; ".join(f"{kernel}: {', '.join(names)}" for kernel, names in sorted(by_kernel.items()))
    return (
        f"**Different optimizer kernels.** The optimizers ran different implementations ({ran}): "
        "their epoch times and step peaks compare the kernels as much as the precisions. Set "
        "`optimizer.fused` alike for every leg (null picks the fused kernel wherever torch has "
        "one) to compare precisions."
    )
