"""The report's answer, a line per configuration against its fp32 reference: use it, don't, or
undecided with the seeds that would decide it (power.py) and the command that adds them
(more_seeds.py). report.md opens with it; the console, the W&B report run's summary and the
sweep's W&B view repeat it.

- **use it**: its parity verdict is within noise (or better) and its timings do not say it is
  slower; with its speedup and memory against fp32.
- **don't**: worse than fp32 by more than the tolerance, or slower (the whole interval of its
  speedup below 1), or every run diverged.
- **undecided**: the interval of its difference straddles the tolerance, or a side has one seed.

Speed counts only where its timings can be compared: runs that timed fewer than 3 epochs or
overlapped with other jobs (report.md's Warnings) leave it out of the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpexp.report.configuration import Config
from mpexp.report.more_seeds import more_seeds_command, new_seeds
from mpexp.report.power import MOST_SEEDS, POWER, SeedsNeeded, seeds_needed
from mpexp.report.stats import Estimate
from mpexp.report.table import Report

FIRST_SEEDS = 3  # where no spread was measured: the seeds that give a first interval worth having
USE, DONT, UNDECIDED, NO_VERDICT = "use it", "don't", "undecided", "no verdict"


@dataclass(frozen=True)
class Decision:
    """One configuration's line of the bottom line."""

    config: Config
    action: str  # USE, DONT, UNDECIDED or NO_VERDICT
    text: str  # after the configuration's name, in Markdown
    seeds: int | None = None  # undecided: the seeds each that would decide it (None: none known)

    @property
    def line(self) -> str:
        return f"**{self.config.label}**: {self.action}: {self.text}"


def decisions(report: Report) -> list[Decision]:
    """A decision per configuration that has a reference other than itself, in report order."""
    untimed = {id(r) for r in (*report.few_timed_epochs, *report.overlapping)}
    return [_decide(c, untimed) for c in report.configs if not c.is_reference]


def _decide(config: Config, untimed: set[int]) -> Decision:
    reference = config.reference
    if not config.rows:
        return Decision(config, DONT, "every run diverged.")
    if reference is None:
        return Decision(config, NO_VERDICT, "no fp32 configuration with its other settings.")
    if not reference.rows:
        return Decision(config, NO_VERDICT, "every run of its fp32 reference diverged.")
    spec, parity = config.spec, config.parity
    timed = not any(id(r) in untimed for r in (*config.rows, *reference.rows))
    speedup = config.speedup if timed else None
    if parity == "worse":
        gain = config.gain(config.d_result)
        return Decision(config, DONT, f"worse than fp32 by {_plus_minus(gain, spec, sign=-1)} "
                        f"{spec.unit} (tolerance {config.tolerance:g}).")  # fmt: skip
    if speedup is not None and speedup.high is not None and speedup.high < 1:
        accuracy = "within the tolerance" if parity in ("within noise", "better") else "undecided"
        return Decision(config, DONT, f"slower than fp32, {_speed(config, speedup)}; its "
                        f"{spec.name} {accuracy}.")  # fmt: skip
    costs = _costs(config, speedup, timed)
    if parity in ("within noise", "better"):
        kept = f"within {config.tolerance:g} {spec.unit} of"
        if parity == "better":
            kept = "better than"
        return Decision(config, USE, f"{kept} fp32 ({_difference(config)}); {costs}.")
    return _undecided(config, costs)


def _undecided(config: Config, costs: str) -> Decision:
    spec, reference = config.spec, config.reference
    seeds = min(config.n, reference.n)
    measured = f"{_difference(config)} from {_seeds(seeds)}"
    needed = seeds_needed(config)
    if needed is None:
        text = (f"{measured}, no spread measured; {FIRST_SEEDS} seeds each give a first "
                f"interval; {costs}.")  # fmt: skip
        return Decision(config, UNDECIDED, text, FIRST_SEEDS)
    if seeds == 1:
        whose = "its spread taken to be fp32's" if config.n == 1 else "fp32's taken to be its"
        measured += f" ({whose})"
    else:
        measured += f" straddles the tolerance of {config.tolerance:g} {spec.unit}"
    return Decision(config, UNDECIDED, f"{measured}; {_needed(needed)}; {costs}.", needed.seeds)


def _needed(needed: SeedsNeeded) -> str:
    if needed.seeds is None:
        return (f"more than {MOST_SEEDS} seeds each would be needed at the spread measured: the "
                "difference sits at the tolerance")  # fmt: skip
    return (f"{needed.seeds} seeds each would decide it at the spread measured (power "
            f"calculation, {POWER * 100:.0f} %)")  # fmt: skip


def _seeds(n: int) -> str:
    return "one seed" if n == 1 else f"{n} seeds"


def _difference(config: Config) -> str:
    return f"Δ {_plus_minus(config.d_result, config.spec)} {config.spec.unit}"


def _plus_minus(e: Estimate, spec, sign: int = 1) -> str:
    fmt = f".{spec.decimals}f"
    value = format(sign * e.value, ("+" if sign > 0 else "") + fmt)
    return value if e.low is None else f"{value} ± {e.half_width:{fmt}}"


def _speed(config: Config, speedup: Estimate) -> str:
    shown = f"{speedup.value:.2f}x"
    if speedup.low is not None:
        shown += f" ({speedup.low:.2f} to {speedup.high:.2f})"
    emulated = any(r.run.ran.get("emulated") for r in config.rows)
    return f"{shown} its speed" + (" (emulated on this device)" if emulated else "")


def _costs(config: Config, speedup: Estimate | None, timed: bool) -> str:
    speed = _speed(config, speedup) if speedup is not None else None
    if not timed:
        speed = "speed not judged (too few timed epochs, or jobs that overlapped: Warnings)"
    memory = None if config.mem_ratio is None else f"{config.mem_ratio:.2f}x its memory"
    return ", ".join(p for p in (speed, memory) if p) or "no speed or memory measured"


def add_seeds(report: Report, found: list[Decision]) -> str | None:
    """The sentence and command that add the seeds the undecided lines ask for."""
    more = [
        d.seeds - min(d.config.n, d.config.reference.n)
        for d in found
        if d.action == UNDECIDED and d.seeds is not None
    ]
    if not more or max(more) <= 0:
        return None
    seeds = new_seeds(report, max(more))
    shown = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]} to {seeds[-1]}"
    return (f"To add {shown} (the most any line asks for) and report on all runs again:\n\n"
            f"```bash\n{more_seeds_command(report, seeds)}\n```")  # fmt: skip


def markdown(report: Report) -> str:
    """The bottom line's lines and its command in Markdown, as the W&B report run's summary and
    the sweep's view hold it ("" without a configuration to decide)."""
    found = decisions(report)
    command = add_seeds(report, found) if found else None
    return "\n".join([*(f"- {d.line}" for d in found), *(["", command] if command else [])])


def plain(report: Report) -> list[str]:
    """The bottom line for a console: a line per configuration, without Markdown."""
    return [d.line.replace("**", "") for d in decisions(report)]
