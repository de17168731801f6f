"""Runs that outlive their process: FSDP checkpoints (sharded, resumed on the same or another
number of ranks), trainer.resume=auto, and a submitit job pre-empted, requeued and resumed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mpexp.checkpoints import files, sharded
from mpexp.checkpoints.checkpoint import checkpoint_files
from mpexp.run.runner import train
from mpexp.rundir import leftover_files
from mpexp.tracking.run_context import RunContext
from tests.conftest import ROOT, TINY, make_cfg, run_cli
from tests.test_distributed import GLOBAL, TORCHRUN
from tests.test_resume import status, wait_for
from tests.test_training import read_metrics

# 4 epochs of 16 steps: long enough that a kill at the first checkpoint comes mid-run
FSDP = [
    "trainer.strategy=fsdp",
    *TINY,
    GLOBAL,
    "trainer.epochs=4",
    "trainer.checkpoint_every_steps=5",
]


def torchrun(*args: str, cwd: Path, nproc: int = 2) -> subprocess.Popen:
    """`torchrun -m mpexp.train <args>` in a process group of its own, output in one stream."""
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launcher = [a if a != "--nproc_per_node=2" else f"--nproc_per_node={nproc}" for a in TORCHRUN]
    return subprocess.Popen(
        [sys.executable, "-m", *launcher, "-m", "mpexp.train", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def finish(proc: subprocess.Popen) -> str:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    return output


def losses(run_dir: Path) -> list[float]:
    return [r["train/loss"] for r in read_metrics(run_dir)[0]]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> dict[str, Path]:
    """An uninterrupted 2-rank FSDP run, and one killed after its first checkpoint."""
    cwd = tmp_path_factory.mktemp("fsdp")
    whole, killed = cwd / "whole", cwd / "killed"
    finish(torchrun(*FSDP, f"hydra.run.dir={whole}", cwd=cwd))
    proc = torchrun(*FSDP, f"hydra.run.dir={killed}", cwd=cwd)
    wait_for(lambda: checkpoint_files(killed), proc)
    for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun's workers have sessions of their own
        os.kill(pid, signal.SIGKILL)  # a lost node: no warning, no last checkpoint
    proc.wait()
    return {"cwd": cwd, "whole": whole, "killed": killed}


@pytest.mark.slow
def test_fsdp_checkpoints_are_sharded_folders_with_checksums(fsdp_runs):
    whole = fsdp_runs["whole"]
    (last,) = checkpoint_files(whole)  # keep_checkpoints=1: the newest, at the end
    names = sorted(p.name for p in last.iterdir())
    assert names == sorted(
        [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "rng-rank0.pt",
         "rng-rank1.pt", "SHA256SUMS"]
    )  # fmt: skip
    assert len((last / "SHA256SUMS").read_text().splitlines()) == 6
    assert status(whole) == "finished"


@pytest.mark.slow
def test_a_killed_fsdp_run_resumes_to_the_uninterrupted_result(fsdp_runs):
    killed, whole = fsdp_runs["killed"], fsdp_runs["whole"]
    assert status(killed) == "running"
    assert checkpoint_files(killed)[-1].is_dir()
    finish(torchrun(*FSDP, f"trainer.resume={killed}", cwd=fsdp_runs["cwd"]))
    assert not list((killed / "checkpoints").glob("*.tmp"))  # a write the kill cut is cleared

    steps, epochs = read_metrics(killed)
    assert [r["step"] for r in steps] == list(range(1, 65))  # each step once
    assert len(epochs) == 4 and status(killed) == "finished"
    # same ranks, same shards, every rank's random state restored: the uninterrupted run's losses
    assert losses(killed) == pytest.approx(losses(whole), rel=1e-6)
    assert epochs[-1]["val/loss"] == pytest.approx(read_metrics(whole)[1][-1]["val/loss"], rel=1e-6)


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_on_one_rank(fsdp_runs, tmp_path):
    whole = fsdp_runs["whole"]
    # continue the finished 2-rank run for one more epoch, on a single rank: dataset.batch_size is
    # the step's on any number of processes, so that epoch takes 1024 / 64 = 16 steps, as each
    # epoch before it did on two
    one = [*FSDP, "trainer.epochs=5"]
    output = finish(torchrun(*one, f"trainer.resume={whole}", cwd=tmp_path, nproc=1))
    assert "Resuming a run of 2 processes on 1" in output and "(resharded)" in output
    steps, epochs = read_metrics(whole)
    assert [r["step"] for r in steps] == list(range(1, 81)) and len(epochs) == 5
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["ran"]["world_size"] == 1
    assert epochs[-1]["val/loss"] < epochs[0]["val/loss"]  # it went on learning from the weights


@pytest.mark.slow
def test_a_dataset_change_still_refuses_an_fsdp_resume(fsdp_runs, tmp_path):
    result = run_cli(
        *TORCHRUN, "-m", "mpexp.train", *FSDP, "optimizer.lr=0.5",
        f"trainer.resume={fsdp_runs['whole']}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode != 0
    assert "optimizer.lr: 0.003 in the run, 0.5 now" in result.stdout + result.stderr


def test_a_kill_while_a_sharded_checkpoint_is_replaced_leaves_a_whole_one(tmp_path, monkeypatch):
    # An epoch's end replaces the checkpoint of its last step when that step had one. A kill while
    # the old folder is deleted must not leave half a folder under the name a resume takes.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        path = tmp_path / "checkpoints" / "step-00000008"
        sharded.save(path, {"written": "first"}, {}, model, optimizer, rank=0)
        real_rmtree = shutil.rmtree

        def killed_while_deleting(folder, *args, **kwargs):
            folder = Path(folder)
            if (folder / sharded.COMMON).is_file() and not folder.name.endswith(".tmp"):
                (folder / sharded.COMMON).unlink()  # one file gone, then the kill
                raise KeyboardInterrupt
            real_rmtree(folder, *args, **kwargs)

        monkeypatch.setattr(shutil, "rmtree", killed_while_deleting)
        with pytest.raises(KeyboardInterrupt):
            sharded.save(path, {"written": "second"}, {}, model, optimizer, rank=0)
        monkeypatch.undo()
        assert checkpoint_files(tmp_path) == [path]
        assert sharded.corrupt_files(path) == []
        assert sharded.load_common(path)["written"] == "second"
        assert [p.name for p in leftover_files(tmp_path)] == ["step-00000008.replaced"]

        # a second Ctrl-C between moving the old folder aside and renaming the new one in
        real_replace = os.replace

        def stopped_between_the_renames(src, dst):
            if Path(src).name.endswith(".tmp"):
                raise KeyboardInterrupt
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", stopped_between_the_renames)
        with pytest.raises(KeyboardInterrupt):
            sharded.save(path, {"written": "third"}, {}, model, optimizer, rank=0)
        monkeypatch.undo()
        assert checkpoint_files(tmp_path) == [path] and leftover_files(tmp_path) == []
        assert sharded.load_common(path)["written"] == "second"
    finally:
        dist.destroy_process_group()

    # a SIGKILL at that moment, which nothing catches: the resume puts the folder back
    os.replace(path, path.with_name(path.name + ".replaced"))
    assert files.find_checkpoint(tmp_path) == path
    assert sharded.load_common(path)["written"] == "second"


def test_resume_auto_starts_afresh_then_continues(tmp_path):
    run = RunContext(tmp_path / "run")
    train(make_cfg(*TINY, "trainer.epochs=1", "trainer.resume=auto"), run)  # nothing to resume
    train(make_cfg(*TINY, "trainer.epochs=2", "trainer.resume=auto"), run)  # from epoch 1's end
    steps, epochs = read_metrics(run.run_dir)
    assert [r["step"] for r in steps] == list(range(1, 33)) and len(epochs) == 2
    assert [e["epoch"] for e in epochs] == [1, 2]


def test_resume_auto_restarts_a_run_that_died_before_its_first_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train/loss": 9.0}\n{"step": 2, "tr')
    (run_dir / "summary.json").write_text('{"status": "running"}')
    train(make_cfg(*TINY, "trainer.epochs=1", "trainer.resume=auto"), RunContext(run_dir))
    steps, epochs = read_metrics(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 17)) and len(epochs) == 1
    assert status(run_dir) == "finished"


def submitit_tasks() -> list[int]:
    """Pids of the processes that submitit started to run a job's task."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if proc.name.isdigit() and b"submitit.core._submit" in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
def test_a_preempted_submitit_job_checkpoints_requeues_and_finishes(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e .[slurm]")
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [*TINY, "trainer.epochs=30", "trainer.log_every=1", "trainer.resume=auto"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpexp.train", "-m", "hydra/launcher=submitit_local", *args],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip

    def training() -> bool:
        rows = list(tmp_path.glob("outputs/multirun/*/*/0/metrics.jsonl"))
        return bool(rows) and rows[0].stat().st_size > 0 and bool(submitit_tasks())

    wait_for(training, proc)
    time.sleep(0.5)  # a few steps in, past the first epoch's start
    for pid in submitit_tasks():
        os.kill(pid, signal.SIGUSR2)  # what SLURM sends before pre-emption (submitit's default)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]

    (job,) = tmp_path.glob("outputs/multirun/*/*/0")
    log = (job / "train.log").read_text()
    assert "Stopped by SIGUSR2" in log  # it checkpointed before submitit requeued it
    assert "Resuming" in log  # and the requeued job continued from that checkpoint
    steps, epochs = read_metrics(job)
    assert [r["step"] for r in steps] == list(range(1, 30 * 16 + 1)) and len(epochs) == 30
    assert status(job) == "finished"
