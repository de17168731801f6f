from __future__ import annotations

import torch

from mpexp.step.history import StepHistory


def record(history: StepHistory, step: int) -> None:
    history.note(step, 0.1)
    before_update = torch.stack(
        (torch.tensor(float(step)), torch.tensor(8.0), torch.tensor(step % 2.0))
    )
    history.record(before_update, torch.tensor(float(step == 3)))


def test_flush_hands_back_the_previous_batch_and_wait_drains_everything():
    history = StepHistory()
    for s in (1, 2):
        record(history, s)
    assert history.flush() == []  # the copy of steps 1-2 has only been started
    record(history, 3)
    rows = history.flush()
    assert [r.step for r in rows] == [1, 2]
    assert [(r.loss, r.scale, r.skipped) for r in rows] == [(1.0, 8.0, True), (2.0, 8.0, False)]
    (last,) = history.flush(wait=True)
    assert (last.step, last.floor_hit) == (3, True)
    assert history.flush(wait=True) == []


def test_eager_steps_grow_the_ring_past_its_capacity():
    history = StepHistory(capacity=2)
    for s in range(1, 6):
        record(history, s)
    assert [r.step for r in history.flush(wait=True)] == [1, 2, 3, 4, 5]


def test_captured_steps_write_where_the_device_keeps_count_after_eager_ones():
    """Steps replayed from a graph write at a position the device keeps: it is set from the
    host's count when eager steps or a flush moved that on, and advanced by the replay itself."""
    history = StepHistory(capacity=4)
    record(history, 1)  # eager
    for step in (2, 3):  # as replays: the host notes, the graph writes
        history.note(step, 0.1)
        history.before_replay()
        history.record_captured(torch.tensor([float(step), 8.0, 0.0]), torch.tensor(0.0))
    assert [r.loss for r in history.flush(wait=True)] == [1.0, 2.0, 3.0]
    history.note(4, 0.1)  # after the flush: row 0 again
    history.before_replay()
    history.record_captured(torch.tensor([4.0, 8.0, 0.0]), torch.tensor(0.0))
    assert [(r.step, r.loss) for r in history.flush(wait=True)] == [(4, 4.0)]
