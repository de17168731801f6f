"""Warnings for optimizer states that bfloat16 rounded to nearest stops moving.

Adam's moments and SGD's momentum buffer are running averages: each step moves the state x by
(1 - beta) of its distance to its input, x <- x + (1 - beta) (input - x). Round-to-nearest keeps
x where that move is below half of bfloat16's spacing at x's size (2^(e-8) for x in
[2^e, 2^(e+1)): 2^-9 to 2^-8 of x), so a state whose 1 - beta is small stops short of its input
and stays there. Where it stops is found here from bfloat16's actual spacing, binade by binade,
under a constant input (the worst case: a noisy input keeps kicking the state past its
resolution), and a run whose states would stop more than a tenth short is warned once.
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger(__name__)

WARN_BELOW = 0.9  # of the input: a state that stops further short than this is warned about


def stall_point(beta: float, target: float = 1.0) -> float:
    """Where x <- beta x + (1 - beta) target, started at 0 and stored in bfloat16 rounded to
    nearest, stops: in the first binade [2^e, 2^(e+1)) where the move (1 - beta)(target - x)
    falls below half of bfloat16's spacing, 2^(e-8), before x leaves it."""
    if beta <= 0:
        return target
    e = math.floor(math.log2((1 - beta) * target))  # the first step's binade
    while True:
        low = 2.0**e
        stop = target - 2.0 ** (e - 8) / (1 - beta)
        if stop < 2 * low:
            return min(target, max(low, stop))
        e += 1


def steps_lost(reached: float) -> float:
    """Of the steps in which float32's state comes within 1% of a constant input, the share
    that leave a state stopped at `reached` (a fraction of the input) unchanged."""
    if reached >= 0.99:
        return 0.0
    return 1 - math.log(1 - reached) / math.log(0.01)


def warn_stalled_states(rounding: str, states: str, averages: list[tuple[str, str, float, float]]):
    """One warning for each of `averages` ((what it is, the setting of its beta, beta, its input
    under a constant gradient of 1)) that bfloat16 rounded to nearest stops short of its input;
    none under stochastic rounding or with float32 states."""
    if states != "bfloat16" or rounding == "stochastic":
        return
    for what, setting, beta, target in averages:
        reached = stall_point(beta, target) / target
        if reached >= WARN_BELOW:
            continue
        needed = math.log(0.01) / math.log(beta)
        log.warning(
            "precision=bf16_pure keeps %s (%s=%g) in bfloat16 rounded to nearest: each step "
            "moves it by 1 - beta = %.2g of its distance to its input, and a move below half of "
            "bfloat16's spacing at its size (2^-9 to 2^-8 of it) is rounded away, so %s stops "
            "moving at about %.2f of float32's value under a constant gradient; of the %d steps "
            "in which float32's comes within 1%% of it, %.0f%% leave bfloat16's unchanged. Use "
            "precision.update_rounding=stochastic (states rounded stochastically too) or "
            "precision.optimizer_states=float32.",
            what,
            setting,
            beta,
            1 - beta,
            what,
            reached,
            round(needed),
            100 * steps_lost(reached),
        )
