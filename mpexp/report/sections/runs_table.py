"""report.md's Runs: one row per run, diverged ones marked."""

from __future__ import annotations

from mpexp.report.configuration import Config
from mpexp.report.row import Row, run_values
from mpexp.report.sections.cells import by_result, number, table, value_format, value_header
from mpexp.report.table import Report


def section(report: Report) -> list[str]:
    # a column per result metric besides the val loss every run has (one, but for mixed tasks)
    specs = [spec for spec in by_result(report.configs) if spec.metric != "val/loss"]

    def cells(item: tuple[Config, Row]) -> list[str]:
        config, row = item
        v = run_values(row, config.target)
        reached = v["time_to_target_s"]
        if config.target is None:
            to_target = "n/a"
        elif reached is None:
            to_target = "not reached"
        else:
            to_target = f"{reached:.1f}"
        spread = f"{v['epoch_time_min_s']:.3f} to {v['epoch_time_max_s']:.3f}"
        results = [
            f"{v['result']:{value_format(spec)}}" if spec == row.spec else "n/a" for spec in specs
        ]
        return [
            f"{v['run']} **(diverged)**" if v["diverged"] else v["run"],
            str(v["seed"]),
            *results,
            f"{v['val_loss']:.4f}",
            f"{v['epoch_time_s']:.3f} [{spread}]",
            str(v["timed_epochs"]),
            f"{v['samples_per_s']:.0f}",
            number(v["data_wait_pct"], ".1f"),
            number(v["tflops"], ".3g"),
            number(v["mfu_pct"], ".1f"),
            to_target,
            f"{v['peak_mem_mib']:.1f}",
            str(v["skipped_steps"]),
        ]

    headers = ["run", "seed", *(value_header(spec) for spec in specs), "val loss",
               "epoch time (s): median [min to max]", "timed epochs", "samples/s",
               "data wait (%)", "TFLOP/s", "MFU (%)", "time to target (s)", "peak memory (MiB)",
               "skipped steps"]  # fmt: skip
    items = [(c, r) for c in report.configs for r in c.members]
    return ["## Runs", "", *table(headers, items, cells), ""]
