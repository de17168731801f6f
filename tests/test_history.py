from __future__ import annotations

import torch

from mpexp.history import StepHistory


def record(history: StepHistory, step: int) -> None:
    history.record(
        step, 0.1, torch.tensor(float(step)), torch.tensor(8.0), torch.tensor(step % 2.0)
    )


def test_flush_hands_back_the_previous_batch_and_wait_drains_everything():
    history = StepHistory()
    for s in (1, 2):
        record(history, s)
    assert history.flush() == []  # the copy of steps 1-2 has only been started
    record(history, 3)
    rows = history.flush()
    assert [r.step for r in rows] == [1, 2]
    assert [(r.loss, r.scale, r.skipped) for r in rows] == [(1.0, 8.0, True), (2.0, 8.0, False)]
    assert [r.step for r in history.flush(wait=True)] == [3]
    assert history.flush(wait=True) == []
