"""A run measured in steps: trainer.max_steps stops at that step (mid-epoch if need be),
trainer.eval_every_steps validates, logs a row and checkpoints every N steps, and a step-measured
run resumes to the uninterrupted run's result. Bad combinations get one message."""

from __future__ import annotations

import pytest

from mpexp.checkpoints.files import load
from mpexp.errors import ConfigError
from mpexp.run.runner import train
from mpexp.rundir import checkpoint_files
from mpexp.tracking.run_context import RunContext
from tests.conftest import TINY, make_cfg
from tests.test_language_model import tiny_lm
from tests.test_resume import ARGS, assert_same_final_state, comparable, crashed_and_resumed
from tests.test_training import read_metrics

# TINY's 1024 samples in batches of 64: 16 steps an epoch
BY_STEPS = [*TINY, "trainer.epochs=null", "trainer.max_steps=20", "trainer.eval_every_steps=6"]


def test_max_steps_stops_at_that_step_mid_epoch(tmp_path):
    cfg = make_cfg(*TINY, "trainer.epochs=null", "trainer.max_steps=10")
    summary = train(cfg, RunContext(tmp_path))
    steps, rows = read_metrics(tmp_path)
    assert [r["step"] for r in steps] == list(range(1, 11))
    (row,) = rows  # the run validates once, at its last step
    assert (row["epoch"], row["step"], row["samples"]) == (1, 10, 640)
    assert summary["step"] == 10
    assert load(checkpoint_files(tmp_path)[-1])["position"] == {"epoch": 1, "batch": 10, "step": 10}


def test_eval_every_steps_validates_and_checkpoints_on_those_steps(tmp_path):
    train(make_cfg(*BY_STEPS, "trainer.keep_checkpoints=9"), RunContext(tmp_path))
    _, rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [6, 12, 18, 20]  # and the last step
    assert [r["epoch"] for r in rows] == [1, 1, 2, 2]  # the epoch each fell in
    assert [r["samples"] for r in rows] == [384, 768, 1152, 1280]
    for row in rows:
        assert 0 <= row["val/acc"] <= 1 and row["perf/epoch_time_s"] > 0
    assert [p.name for p in checkpoint_files(tmp_path)] == [
        f"step-{s:08d}.pt" for s in (6, 12, 18, 20)
    ]


def test_a_step_measured_run_crashed_mid_interval_resumes_to_the_uninterrupted_result(
    tmp_path, monkeypatch, caplog
):
    # checkpoints at steps 3, 5 (a validation), 6, 9, 10 (a validation), 12, 13: the run dies
    # at the second, and resumes from the first, mid-interval and mid-epoch
    args = [*ARGS, "trainer.epochs=null", "trainer.max_steps=13", "trainer.eval_every_steps=5",
            "trainer.checkpoint_every_steps=3"]  # fmt: skip
    whole, killed = crashed_and_resumed(args, tmp_path, monkeypatch, caplog)
    assert comparable(killed) == comparable(whole)
    assert_same_final_state(whole, killed, ("model", "optimizer", "position"))


def test_a_language_model_counts_the_tokens_it_trained_on(tmp_path):
    cfg = make_cfg(*tiny_lm(tmp_path, "trainer.epochs=null", "trainer.max_steps=6",
                            "trainer.eval_every_steps=3"))  # fmt: skip
    train(cfg, RunContext(tmp_path / "run"))
    _, rows = read_metrics(tmp_path / "run")
    assert [(r["step"], r["tokens"]) for r in rows] == [(3, 3 * 16 * 32), (6, 6 * 16 * 32)]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.epochs=1", "trainer.max_steps=40"], r"1 epochs of 16 steps end at step 16"),
        (["trainer.epochs=null"], r"trainer.epochs=null needs trainer.max_steps"),
        (["trainer.max_steps=0"], r"trainer.max_steps=0 must be an integer >= 1"),
    ],
)
def test_a_length_that_cannot_work_is_refused_before_training(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train(make_cfg(*TINY, *overrides), RunContext(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()
