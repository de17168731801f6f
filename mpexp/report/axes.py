"""The keys a sweep varied beside the precision, as the axes of its result.

People sweep a precision against something else (the learning rate, the batch size), to learn
where the precision stops keeping up. The configurations of such a sweep are points of a grid:
`sweep_axis` finds the numeric key that varied (the x-axis: the learning rate where it varied,
else the first numeric key in the overrides' order) and the other keys that varied (each
combination of their values is a panel, e.g. `model.qk_norm=false` and `=true`). In every panel
each precision is a curve of configurations along the key. The seed never is an axis: seeds are a
configuration's repeats, drawn as a band.

Each configuration is still judged against its fp32 reference at the same values of every other
key (configuration.py): a curve's points hold those verdicts, so that the report can say up to which
value a precision keeps fp32's result (`kept_up_to`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpexp.report.configuration import Config
from mpexp.report.overrides import PRECISION_KEYS, in_groups, override_key

# the key of the learning rate: a sweep over it also gets its LR sensitivity (sensitivity.py)
LR_KEY = "optimizer.lr"
DECADE = 10.0


@dataclass(eq=False)
class Point:
    """One configuration at its value of the swept key."""

    x: float
    shown: str  # the value as the override gave it, e.g. `3e-3`
    config: Config


@dataclass(eq=False)
class Curve:
    """A precision's configurations along the key, in one panel, by increasing value."""

    precision: str  # what the line is called: the precision (and loss scaling, where it varied)
    points: list[Point]

    @property
    def is_reference(self) -> bool:
        return all(p.config.is_reference for p in self.points)


@dataclass(eq=False)
class Panel:
    """The configurations that share the values of the other varied keys."""

    label: str  # e.g. `model.qk_norm=true`; "" when no other key varied
    curves: list[Curve]


@dataclass(eq=False)
class SweepAxis:
    key: str  # the swept key, e.g. `optimizer.lr`
    panel_keys: list[str]
    panels: list[Panel]

    @property
    def values(self) -> list[float]:
        return sorted({p.x for panel in self.panels for c in panel.curves for p in c.points})

    def shown(self, x: float) -> str:
        """A swept value as the override gave it (`3e-3`), not as a float prints (`0.003`)."""
        return next(p.shown for panel in self.panels for c in panel.curves for p in c.points
                    if p.x == x)  # fmt: skip

    @property
    def log(self) -> bool:
        """Whether the key's values span a decade or more (all positive): a log axis then."""
        values = self.values
        return values[0] > 0 and values[-1] / values[0] >= DECADE

    @property
    def is_lr(self) -> bool:
        return self.key == LR_KEY

    @property
    def file_name(self) -> str:
        return f"sweep_{self.key}.png"


def _settings(config: Config) -> dict[str, str]:
    """A configuration's overrides as {key: value}, without precision and loss scaling."""
    pairs = (
        o.split("=", 1) for o in config.overrides if "=" in o and not in_groups(o, PRECISION_KEYS)
    )
    return {override_key(k): v for k, v in pairs}


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def varied_keys(configs: list[Config]) -> list[str]:
    """The keys whose value differs between configurations, beside precision, loss scaling and
    the seed (never part of a configuration), in the order the first configuration lists them."""
    settings = [_settings(c) for c in configs]
    ordered = [k for c in configs for k in _override_order(c)]
    keys = dict.fromkeys(k for k in ordered if any(k in s for s in settings))
    return [k for k in keys if len({s.get(k) for s in settings}) > 1]


def _override_order(config: Config) -> list[str]:
    """The keys in the order the command line gave them (the label keeps that order), then the
    rest of its settings."""
    given = [override_key(o) for o in config.first.run.overrides]
    return [*given, *sorted(_settings(config))]


def sweep_axis(configs: list[Config]) -> SweepAxis | None:
    """The sweep's grid, or None when no numeric key beside the precision varied."""
    keys = varied_keys(configs)
    settings = {c: _settings(c) for c in configs}
    numeric = [
        k
        for k in keys
        if all(k in s and _number(s[k]) is not None for s in settings.values())
        and len({_number(s[k]) for s in settings.values()}) > 1
    ]
    if not numeric:
        return None
    key = LR_KEY if LR_KEY in numeric else numeric[0]
    panel_keys = [k for k in keys if k != key]
    split_scaling = len({c.first.loss_scaling for c in configs}) > 1
    panels: dict[str, dict[str, list[Point]]] = {}
    for config in configs:
        own = settings[config]
        label = ", ".join(f"{k}={own.get(k, '')}" for k in panel_keys)
        line = config.first.precision
        if split_scaling:
            line += f", {config.first.loss_scaling}"
        point = Point(_number(own[key]), own[key], config)
        panels.setdefault(label, {}).setdefault(line, []).append(point)
    return SweepAxis(
        key,
        panel_keys,
        [
            Panel(label, [Curve(line, sorted(points, key=_by_x)) for line, points in lines.items()])
            for label, lines in panels.items()
        ],
    )


def _by_x(point: Point) -> float:
    return point.x


@dataclass(frozen=True)
class Kept:
    """Up to which value of the key a precision keeps its fp32 reference's result (within the
    tolerance, by the mean difference), and its differences above that value."""

    up_to: Point | None  # None: it fell behind at the smallest value already
    # the points after it, each with how far its mean result is behind fp32's, in the result's
    # unit (positive: worse; inf: every run diverged)
    above: list[tuple[Point, float]]


def kept_up_to(curve: Curve) -> Kept | None:
    """From the smallest value up, the values where the curve's mean result is no worse than its
    fp32 reference's by more than the tolerance; None for fp32 itself or a curve with a point
    that has no reference to compare with. A point whose every run diverged, while fp32's did not,
    falls behind; one where fp32 diverged too is no evidence either way and is passed over."""
    if curve.is_reference:
        return None
    up_to, above = None, []
    for point in curve.points:
        config = point.config
        reference = config.reference
        if reference is None:
            return None
        gain = config.gain(config.d_result)
        if gain is None and not reference.rows:
            continue  # both diverged, or only fp32 did
        behind = gain is None or gain.value < -config.tolerance
        if behind or above:
            above.append((point, math.inf if gain is None else -gain.value))
        else:
            up_to = point
    return Kept(up_to, above)


def short_labels(configs: list[Config]) -> list[str]:
    """Each configuration named by the keys whose values differ between them, each by its last
    dotted part (`bf16, lr=0.003, qk_norm=true`); precision and loss scaling by their value.
    For a legend of many lines, where whole override strings would fill the figure."""
    settings = [
        {override_key(o): o.split("=", 1)[1] for o in c.overrides if "=" in o} for c in configs
    ]
    keys = dict.fromkeys(PRECISION_KEYS)
    keys.update(dict.fromkeys(k for c in configs for k in _override_order(c)))
    differing = [k for k in keys if len({s.get(k) for s in settings}) > 1]
    labels = []
    for own in settings:
        parts = [
            own.get(k, "") if k in PRECISION_KEYS else f"{k.rsplit('.', 1)[-1]}={own.get(k, '')}"
            for k in differing
        ]
        labels.append(", ".join(parts))
    return labels
