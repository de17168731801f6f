"""What the sweep report advises for each pure bf16 configuration: which update rounding to use,
from the share of updates it lost and where its result ended against fp32.

The result is the task's own (a language model's validation loss in nats, a classifier's
accuracy in points), compared as the parity verdict compares it: a configuration is behind when
its difference is worse than the task's tolerance (the interval's far end where there are seeds
enough for one, the value itself for a single seed).
"""

from __future__ import annotations

from mpexp.report.configuration import PURE, Config


def advice(config: Config) -> str | None:
    """One sentence for a pure bf16 configuration with an fp32 reference; None otherwise."""
    ran = config.first.run.ran
    rounding = ran.get("update_rounding")
    if config.first.precision != PURE or rounding is None:
        return None
    gain = config.gain(config.d_result)
    if gain is None:
        return None
    spec = config.spec
    # the difference as the result reads: a loss higher, an accuracy lower when behind
    ended = f"ended {config.d_result.value:+.{spec.decimals}f} {spec.unit} against fp32"
    behind = _behind(config, gain)
    lost = config.updates_lost
    share = f"lost {lost.value:.0%} of its updates and " if lost is not None else ""
    if rounding == "nearest":
        if behind:
            return f"nearest {share}{ended}: use kahan or stochastic"
        return f"nearest {share}{ended}, within the tolerance: nearest is enough here"
    if behind:
        return f"{rounding} {ended}: keep fp32 master weights (precision=bf16) for this one"
    return None  # kahan or stochastic within the tolerance: nothing to change


def _behind(config: Config, gain) -> bool:
    """Worse than fp32 by more than the tolerance: surely (the parity verdict), or on a single
    seed's value, which has no interval to be sure with."""
    if config.parity == "worse":
        return True
    single = gain.low is None
    return single and gain.value < -config.tolerance
