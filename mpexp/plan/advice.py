"""The keys that would make a row that does not fit fit: estimated from the row's own numbers
(what a step holds beyond what it keeps from step to step grows with its micro-batch), then
planned again with the key set, so that the peak each states is a plan's, not the estimate's."""

from __future__ import annotations

import math
from collections.abc import Callable

from mpexp.errors import UserError
from mpexp.plan.held import gib, held, model_bytes
from mpexp.plan.rehearsal import Rehearsal

GiB = 2**30
TRIES = 4  # plans of a key's values, from the estimate's on, before the key is left out


def fitting_advice(
    rehearsal: Rehearsal,
    budget: float,
    again: Callable[[dict], Rehearsal],
    need: Callable[[Rehearsal], int | None],
) -> list[str]:
    """Keys that make the row's `need` fit `budget`, each with its planned peak; `again` plans
    the row with some keys set otherwise. Under torchrun (`processes`), each process runs its
    share: the keys keep the shares whole."""
    kept = held(rehearsal.bytes)
    if kept >= budget:
        return _too_much_held(rehearsal, budget, need(rehearsal))
    n = rehearsal.processes
    share = rehearsal.samples_per_step // n  # one process's samples a step
    runs = share // rehearsal.micro_batch  # and its micro-batches
    # the micro-batch must be this many times less
    shrink = (need(rehearsal) - kept) / (budget - kept)

    def fitting(key: str, value: int) -> int | None:
        try:
            planned = need(again({key: value}))
        except UserError:  # a value the run refuses (fp8's rows, a share that is not whole)
            return None
        return planned if planned is not None and planned <= budget else None

    out = []
    start = max(runs + 1, math.ceil(runs * shrink))
    divisors = [d for d in range(start, share + 1) if share % d == 0][:TRIES]
    for steps in divisors:
        planned = fitting("trainer.accumulate", steps * n)
        if planned is not None:
            out.append(
                f"trainer.accumulate={steps * n} (micro-batches of {share // steps}; "
                f"{gib(planned)} at the peak)"
            )
            break
    smaller = int(share / shrink) // runs * runs
    for _ in range(TRIES):
        if smaller < runs:
            break
        planned = fitting("dataset.batch_size", smaller * n)
        if planned is not None:
            out.append(
                f"dataset.batch_size={smaller * n} (a smaller optimizer batch; "
                f"{gib(planned)} at the peak)"
            )
            break
        smaller = smaller * 3 // 4 // runs * runs
    return out


def _too_much_held(rehearsal: Rehearsal, budget: float, needed: int) -> list[str]:
    """What would fit a run whose bytes held from step to step alone outgrow the budget: less
    data on the device, or a model that holds less."""
    model = model_bytes(rehearsal.bytes)
    data = held(rehearsal.bytes) - model
    out = []
    if data and needed - data <= budget:
        out.append(
            f"the data off the device ({data / GiB:.1f} GiB of it there): "
            "dataset.loader=dataloader, or a smaller dataset.train_size"
        )
    if model >= budget or not out:
        per = model / max(rehearsal.parameters, 1)
        out.append(
            f"the weights, gradients and optimizer states alone hold {model / GiB:.1f} GiB "
            f"({per:.0f} bytes a parameter): a smaller model"
        )
        if per > 9:
            out.append("precision=bf16_pure (8 bytes a parameter under Adam)")
    return out
