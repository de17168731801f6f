"""What report.md's tables are made of: numbers and intervals as text, verdicts in words, a
Markdown table."""

from __future__ import annotations

from collections.abc import Callable

from mpexp.report.configuration import FP8, Config
from mpexp.report.row import Row
from mpexp.report.stats import Estimate
from mpexp.tasks.base import Result


def number(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def estimate(e: Estimate | None, spec: str) -> str:
    """`mean ± half-width` of the 95 % interval, or the value alone without an interval."""
    if e is None:
        return "n/a"
    if e.low is None:
        return format(e.value, spec)
    return f"{e.value:{spec}} ± {e.half_width:{spec.lstrip('+')}}"


def ratio(e: Estimate | None) -> str:
    """`1.52x (1.40 to 1.65)`: a ratio's interval is not symmetric."""
    if e is None:
        return "n/a"
    if e.low is None:
        return f"{e.value:.2f}x"
    return f"{e.value:.2f}x ({e.low:.2f} to {e.high:.2f})"


VERDICTS = {
    "diverged": "**diverged**",
    "reference": "fp32 reference",
    "no reference": "no fp32 reference",
    "reference diverged": "fp32 reference diverged",
    "single seed": "inconclusive: single seed",
    "within noise": "within noise",
    "too wide": "inconclusive: interval too wide",
}


def parity_text(config: Config) -> str:
    """The verdict on the result; a difference beyond the tolerance comes with its size."""
    return verdict_text(config, config.parity, config.d_result, VERDICTS)


def verdict_text(config: Config, verdict: str, d: Estimate | None, names: dict[str, str]) -> str:
    gain, unit, value = config.gain(d), config.spec.unit, value_format(config.spec)
    if verdict == "worse":
        return f"**worse by {-gain.value:{value}} ± {gain.half_width:{value}} {unit}**"
    if verdict == "better":
        return f"better by {gain.value:{value}} ± {gain.half_width:{value}} {unit}"
    return names[verdict]


def by_result(configs: list[Config]) -> dict[Result, list[Config]]:
    """The configurations by the result they are judged by (one table each)."""
    groups: dict[Result, list[Config]] = {}
    for config in configs:
        groups.setdefault(config.spec, []).append(config)
    return groups


def value_header(spec: Result) -> str:
    return f"{spec.name} ({spec.shown_in})"


def value_format(spec: Result) -> str:
    return f".{spec.decimals}f"


def precision_text(row: Row) -> str:
    if row.precision.startswith(FP8):  # the recipe, and whether the fp8 matmuls were emulated
        ran = row.run.ran
        details = [ran.get("fp8_recipe"), "emulated" if ran.get("emulated") else None]
        shown = ", ".join(d for d in details if d)
        return f"{row.precision} ({shown})" if shown else row.precision
    if row.effective_precision != row.precision:
        return f"{row.precision} (ran as {row.effective_precision})"
    return row.precision


def table(headers: list[str], items: list, cells: Callable[[object], list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for item in items:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells(item)) + " |")
    return lines


def run_names(rows: list[Row]) -> str:
    return ", ".join(f"`{r.label}`" for r in rows)


def n_text(config: Config) -> str:
    """How many runs its numbers come from, and how many more diverged."""
    diverged = len(config.diverged)
    return f"{config.n} (+{diverged} **diverged**)" if diverged else str(config.n)


def byte_size(value: int | None) -> str:
    if value is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"
