"""Faults that must not cost a result: W&B down, an unwritable output dir, a failing sweep job."""

from __future__ import annotations

import json

import torch

from mpexp.tracking import RunContext
from mpexp.train import train
from tests.conftest import TINY, make_cfg, run_cli
from tests.test_resume import ARGS, comparable, start_cli, status
from tests.test_training import read_metrics


def test_an_unreachable_wandb_server_does_not_stop_training(tmp_path):
    run_dir = tmp_path / "run"
    unreachable = {
        "WANDB_BASE_URL": "http://127.0.0.1:9",  # the discard port: nothing listens
        "WANDB_API_KEY": "x" * 40,
        "WANDB_MODE": "online",
    }
    args = [a for a in ARGS if a != "wandb.mode=disabled"]
    proc = start_cli(
        *args,
        "trainer.epochs=1",
        "wandb.mode=online",
        "wandb.init_timeout=1",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        env=unreachable,
    )
    output, _ = proc.communicate(timeout=300)

    assert proc.returncode == 0, output
    assert output.count("W&B could not start") == 1
    steps, epochs = read_metrics(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 9)) and len(epochs) == 1
    assert status(run_dir) == "finished"


def test_an_unwritable_output_dir_fails_with_one_message(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a directory cannot be made inside a file, even by root
    result = run_cli("mpexp.train", *TINY, f"hydra.run.dir={blocker}/run", cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "Traceback" not in output
    assert f"Cannot write to the output directory {blocker}/run" in output
    assert "hydra.run.dir=" in output


def test_a_failing_job_does_not_stop_the_sweep_and_is_recorded(tmp_path):
    args = [a for a in ARGS if not a.startswith("optimizer.lr=")]
    result = run_cli(
        "mpexp.train", "-m", *args, "trainer.epochs=1", "optimizer.lr=3e-3,-1,1e-3", cwd=tmp_path
    )
    assert result.returncode != 0  # Hydra reports the failed job once the sweep is done

    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(3)]
    assert [s["status"] for s in summaries] == ["finished", "failed", "finished"]
    assert "optimizer.lr=-1" in summaries[1]["error"]
    assert all("val/acc" in summaries[i] for i in (0, 2))


def test_deterministic_runs_with_one_seed_repeat_exactly(tmp_path):
    summaries = [
        train(make_cfg(*ARGS, "trainer.epochs=1"), RunContext(tmp_path / name)) for name in "ab"
    ]
    assert torch.are_deterministic_algorithms_enabled()
    assert all(s["ran"]["deterministic"] for s in summaries)
    assert comparable(tmp_path / "a") == comparable(tmp_path / "b")
    assert len(read_metrics(tmp_path / "a")[0]) == 8
