"""report.md's fp8 against bf16: each fp8 configuration against the bf16 configuration it would
replace, and how many of its Linear layers computed in fp8."""

from __future__ import annotations

from collections.abc import Callable

from mpexp.report.configuration import FP8, Config
from mpexp.report.sections.cells import (
    VERDICTS,
    by_result,
    estimate,
    n_text,
    precision_text,
    ratio,
    table,
    value_format,
    value_header,
    verdict_text,
)
from mpexp.report.table import Report


def section(report: Report) -> list[str]:
    fp8 = [c for c in report.configs if c.first.precision == FP8]
    if not fp8:
        return []
    lines = [
        "## fp8 against bf16",
        "",
        "Each fp8 configuration against its bf16 reference: the bf16 configuration with the same "
        "other overrides, the mode fp8 would replace (its unconverted layers run in bf16 too). "
        "Δ and parity as against fp32 above, at the same tolerance; speedup: the bf16 "
        "reference's mean epoch time over the fp8 configuration's. Converted layers: the Linear "
        "layers that computed in fp8, of all Linear layers.",
        "",
    ]
    names = {**VERDICTS, "no reference": "no bf16 reference"}

    def cells(c: Config) -> list[str]:
        ran = c.first.run.ran
        converted = ran.get("fp8_converted_count")
        total = None if converted is None else converted + len(ran.get("fp8_unconverted", {}))
        value = value_format(c.spec)
        return [
            c.label,
            precision_text(c.first),
            c.bf16_reference.label if c.bf16_reference else "none",
            n_text(c),
            estimate(c.result, value),
            estimate(c.d_result_vs_bf16, "+" + value),
            verdict_text(c, c.parity_vs_bf16, c.d_result_vs_bf16, names),
            estimate(c.epoch_time_s, ".3f"),
            ratio(c.speedup_vs_bf16),
            "n/a" if converted is None else f"{converted} of {total}",
        ]

    lines += _fp8_table(fp8, cells)
    if any(r.run.ran.get("emulated") for c in fp8 for r in c.rows):
        lines += [
            "Emulated fp8 (on a CPU) has fp8's numerics but not its speed: its epoch times and "
            "speedups say nothing about fp8 on a GPU with fp8 tensor cores.",
            "",
        ]
    return lines


def _fp8_table(fp8: list[Config], cells: Callable[[Config], list[str]]) -> list[str]:
    """A table per result metric (one, unless the report holds several tasks)."""
    lines = []
    for spec, configs in by_result(fp8).items():
        headers = ["configuration", "precision", "bf16 reference", "n", value_header(spec),
                   f"Δ {spec.name} vs bf16 ({spec.unit})", "parity vs bf16", "epoch time (s)",
                   "speedup vs bf16", "converted layers"]  # fmt: skip
        lines += [*table(headers, configs, cells), ""]
    return lines
