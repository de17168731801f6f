"""Runs grouped into configurations (all but the seed alike), and each configuration's
references and target."""

from __future__ import annotations

from mpexp.report.configuration import BASELINE, BF16, FP8, Config
from mpexp.report.overrides import NOT_CONFIG, in_groups
from mpexp.report.row import Row


def group_configs(rows: list[Row], tolerance: float | None) -> list[Config]:
    """Runs whose overrides differ only in the seed, as configurations, in job order; each
    judged at `tolerance`, or its task's own when None (0.5 points of accuracy, 0.02 nats).

    What ran (precision, loss scaling, model, dataset) is part of a configuration too, so that runs
    without a Hydra record of their overrides (trained from Python) are not mixed up.
    """
    groups: dict[tuple[str, ...], list[Row]] = {}
    for row in rows:
        ran = {
            f"precision={row.precision}",
            f"loss_scaling={row.loss_scaling}",
            f"model={row.run.chosen('model')}",
            f"dataset={row.run.chosen('dataset')}",
        }
        given = {o for o in row.run.overrides if not in_groups(o, NOT_CONFIG)}
        key = tuple(sorted(given | ran))
        groups.setdefault(key, []).append(row)
    common = set.intersection(*(set(k) for k in groups)) if groups else set()
    configs = []
    for key, members in groups.items():
        ordered = [o for o in members[0].run.overrides if o in key and o not in common]
        folders = ", ".join(r.folder for r in members)
        allowed = members[0].spec.tolerance if tolerance is None else tolerance
        configs.append(Config(",".join(ordered) or folders, members, key, allowed))
    return configs


def attach_references(configs: list[Config], target: float | None) -> None:
    """Give each configuration its fp32 reference (an fp8 one also its bf16 reference) and its
    target for the time to target.

    The target is `target` (in the result's unit: percent of accuracy, nats) when given, else
    the reference's mean final result less good by the tolerance: the value at which a 16-bit
    run counts as having matched it.
    """
    for config in configs:
        config.reference = _reference(configs, config, BASELINE)
        if config.first.precision == FP8:
            config.bf16_reference = _reference(configs, config, BF16)
    for config in configs:
        spec = config.spec
        if target is not None:
            config.target = target / spec.scale
        elif config.reference is not None and config.reference.rows:
            slack = config.tolerance if spec.higher_is_better else -config.tolerance
            config.target = (config.reference.result.value - slack) / spec.scale


def _reference(configs: list[Config], config: Config, precision: str) -> Config | None:
    """The `precision` configuration with `config`'s other overrides; in a precision x
    loss-scaling grid, the one without loss scaling."""
    candidates = [c for c in configs if c.first.precision == precision and c.task == config.task]
    candidates.sort(key=lambda c: c.first.loss_scaling != "none")  # stable: first listed wins
    return candidates[0] if candidates else None
