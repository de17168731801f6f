"""The fault matrix: each fault, what the user sees, and what is kept.

| fault | the user sees | kept |
|---|---|---|
| W&B unreachable or slow | one warning naming wandb.init_timeout | the whole run |
| output dir unwritable, full, its name too long | one line, exit 2, before Hydra writes | - |
| a sweep job fails | Hydra's report at the end, exit != 0 | the other jobs |
| two runs started in the same second | nothing: two directories | both runs |
| new run in a dir holding a run | one line naming trainer.resume, exit 2 | the old run |
| second process on a live run's dir | one line naming the pid, exit 2 | the live run |
| second sweep into a live sweep's dir | one line naming the pid, exit 2 | the live sweep |
| checkpoint write fails (full disk) | one line: last good checkpoint, resume | that one |
| stop signal that no run answers (--cfg) | one line, 128+sig | - |
| stop signal as the run starts, data loads | one line, status interrupted, 128+sig | - |
| stop signal while W&B starts | one line naming the checkpoint, interrupted | the checkpoint |
| a second Ctrl-C | one line naming the last checkpoint, 130 | checkpoints |
| Ctrl-C while the command imports Hydra | one line, 130 | - |
| Ctrl-C as the process exits | nothing more; the exit status it had | the run |
| the terminal closes (SIGHUP) | as SIGTERM: status interrupted, 129 | the checkpoint |
| SIGTERM to the whole job, workers too | as to the main process alone, 143 | the checkpoint |
| a run with no step per epoch | one line, exit 2, before training | - |
| every step skipped | a warning per epoch, status failed | the metrics |
| truncated / corrupt / mislabelled / empty data | one line naming the file and the fault | - |
| a synthetic set larger than memory | one line with the sizes that fit | - |
| metrics.jsonl deleted while the run trains | one warning; the file written again | every row |
| NaN or inf in the images | one warning at setup naming the split | the run |
| impossible config values | one line naming the key | - |
| a model unfit for the data, or for the memory | one line naming the key, exit 2 | - (no dir) |
| `mpexp.log` under a name of mpexp's own | one line naming the key and the call, exit 2 | - |
| resume of a finished run | one line saying how to train on | the run |
| a checkpoint with flipped bytes | one line: corrupt; another one if kept | the run |
| a checkpoint missing a part, or not fitting the model | one line, exit 2 | the run, every file |

Checkpoint writes that die halfway, kills and resumes are in tests/test_resume.py; crashed runs
in the report in tests/test_report.py.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import multiprocessing
import os
import pickle
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

import mpexp.train
from mpexp.build import build_parts
from mpexp.checkpoints import files
from mpexp.data.cifar10 import CIFAR10Data
from mpexp.data.mnist import FashionMNISTData, MNISTData, write_mnist_files
from mpexp.data.synthetic import SyntheticData
from mpexp.data.workers import WorkerLoader
from mpexp.distributed import World, start_world
from mpexp.errors import ConfigError, DataError, NumericsError, reason
from mpexp.run.runner import stop_if_asked, train
from mpexp.rundir import RunDirTaken, RunLock, SweepLock, checkpoint_files, checkpoint_step
from mpexp.step import flops
from mpexp.stopping import Preempted, StopSignals
from mpexp.tasks.classification import Classification
from mpexp.tracking.run_context import RunContext
from mpexp.tracking.tracker import Tracker
from mpexp.validate import validate
from tests.conftest import (
    ROOT,
    TINY,
    command_in_process,
    make_cfg,
    one_line_failure,
    run_cli,
)
from tests.test_image_folder import SMALL, write_images
from tests.test_resume import ARGS, comparable, start_cli, status, wait_for
from tests.test_training import read_metrics


@pytest.mark.slow  # waits on W&B's retries
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
    assert "wandb.init_timeout=<seconds> (now 1)" in output  # mpexp's key, not W&B's setting
    assert "wandb.Settings" not in output
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


@pytest.mark.parametrize("sweep", [False, True])
def test_an_output_dir_with_a_name_too_long_fails_with_one_message(tmp_path, sweep):
    too_long = tmp_path / ("x" * 300)  # file systems take 255 bytes a name
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    result = run_cli("mpexp.train", *(["-m"] if sweep else []), *TINY, f"{key}={too_long}",
                     cwd=tmp_path)  # fmt: skip
    output = one_line_failure(result)
    assert f"Cannot write to the output directory {too_long}: File name too long." in output


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB file system, filled up."""
    mount = tmp_path / "full"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                             capture_output=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        with pytest.raises(OSError), (mount / "filler").open("wb") as filler:
            while True:
                filler.write(bytes(4096))
                filler.flush()
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_an_output_dir_on_a_full_disk_fails_with_one_message(tmp_path, full_disk):
    result = run_cli("mpexp.train", *TINY, f"hydra.run.dir={full_disk}/run", cwd=tmp_path)
    output = one_line_failure(result)
    assert f"Cannot write to the output directory {full_disk}/run: No space left" in output
    assert not (full_disk / "run" / ".hydra").exists()  # stopped before Hydra wrote anything


def test_deterministic_runs_with_one_seed_repeat_exactly(tmp_path):
    summaries = [
        train(make_cfg(*ARGS, "trainer.epochs=1"), RunContext(tmp_path / name)) for name in "ab"
    ]
    assert torch.are_deterministic_algorithms_enabled()
    assert all(s["ran"]["deterministic"] for s in summaries)
    assert comparable(tmp_path / "a") == comparable(tmp_path / "b")
    assert len(read_metrics(tmp_path / "a")[0]) == 8


# --- one run, one directory --------------------------------------------------------------------


def test_two_runs_started_together_get_a_directory_each(tmp_path):
    procs = [start_cli(*ARGS, "trainer.epochs=1", cwd=tmp_path) for _ in range(2)]
    for proc in procs:
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output
    runs = sorted((tmp_path / "outputs").glob("*/*"))
    assert len(runs) == 2
    for run_dir in runs:
        steps, epochs = read_metrics(run_dir)
        assert [r["step"] for r in steps] == list(range(1, 9)) and len(epochs) == 1
        assert status(run_dir) == "finished"


def test_a_new_run_is_refused_a_directory_that_holds_a_run(tmp_path, in_process):
    run_dir = tmp_path / "sweep" / "0"
    train(make_cfg(*ARGS, "trainer.epochs=1"), RunContext(run_dir))  # the run it holds
    before = {p.name: p.read_bytes() for p in (run_dir / "metrics.jsonl", run_dir / "summary.json")}
    (saved,) = checkpoint_files(run_dir)

    again = in_process(*ARGS, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    output = one_line_failure(again)
    assert f"{run_dir} already holds a run (status: finished)" in output
    assert f"trainer.resume={run_dir}" in output
    assert {p: (run_dir / p).read_bytes() for p in before} == before  # untouched
    assert checkpoint_files(run_dir) == [saved]

    # a sweep given that folder again: refused before any job runs, naming the sweep's key
    sweep = run_cli("mpexp.train", "-m", *ARGS, f"hydra.sweep.dir={run_dir.parent}",
                    cwd=tmp_path)  # fmt: skip
    output = one_line_failure(sweep)
    assert f"{run_dir} already holds a run (status: finished)" in output
    assert "leave hydra.sweep.dir out" in output
    assert {p: (run_dir / p).read_bytes() for p in before} == before


def test_a_second_process_on_a_live_runs_directory_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    live = start_cli(*ARGS, "trainer.epochs=200", "trainer.checkpoint_every_steps=4",
                     f"hydra.run.dir={run_dir}", cwd=tmp_path)  # fmt: skip
    try:
        wait_for(lambda: checkpoint_files(run_dir), live)
        # this process is the second (the command line's one line for it: the test below)
        resume = make_cfg(*ARGS, "trainer.epochs=200", "trainer.checkpoint_every_steps=4",
                          f"trainer.resume={run_dir}")  # fmt: skip
        with pytest.raises(RunDirTaken) as refused:
            train(resume, RunContext(tmp_path / "elsewhere"))
        assert f"Another process (pid {live.pid}) is training in {run_dir}" in str(refused.value)
        assert live.poll() is None  # the live run goes on, its newest checkpoint in place
        newest = checkpoint_files(run_dir)[-1]
        wait_for(lambda: checkpoint_files(run_dir)[-1] != newest, live)
    finally:
        live.send_signal(signal.SIGTERM)
        live.communicate(timeout=120)
    assert status(run_dir) == "interrupted"


def live_run_mid_replace(run_dir: Path) -> None:
    """A run dir whose newest checkpoint reads as a live run replacing it can leave it for an
    instant: a checksum that does not match the file."""
    saved = run_dir / "checkpoints" / "step-00000004.pt"
    saved.parent.mkdir(parents=True)
    saved.write_bytes(b"the old checkpoint")
    files.checksum_file(saved).write_text(f"{'0' * 64}  {saved.name}\n")


def test_a_resume_of_a_live_run_is_refused_before_it_reads_the_checkpoints(tmp_path):
    # the resume names the live run, not a corrupt checkpoint
    run_dir = tmp_path / "run"
    live_run_mid_replace(run_dir)
    with RunLock(run_dir):
        resume = run_cli("mpexp.train", *ARGS, f"trainer.resume={run_dir}", cwd=tmp_path)
        output = one_line_failure(resume)
    assert f"Another process (pid {os.getpid()}) is training in {run_dir}" in output
    assert "corrupt" not in output
    assert (run_dir / ".lock").read_text() == f"{os.getpid()}\n"  # the holder's, not rewritten


def test_a_resume_from_python_of_a_live_run_is_refused_before_it_reads_the_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    live_run_mid_replace(run_dir)
    with (run_dir / ".lock").open("a+") as live:  # another process's lock, not this one's
        fcntl.flock(live, fcntl.LOCK_EX | fcntl.LOCK_NB)
        live.write("4242\n")
        live.flush()
        with pytest.raises(RunDirTaken, match=r"Another process \(pid 4242\) is training"):
            train(make_cfg(*ARGS, f"trainer.resume={run_dir}"), RunContext(tmp_path / "new"))


def test_a_look_at_a_runs_lock_is_not_taken_for_a_run_holding_it(tmp_path):
    # another process's check that no run holds the folder (a resume's, a sweep's) holds the lock
    # shared for an instant: a run claiming the folder then waits, not refusing a dead pid's run
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").write_text("99999\n")  # left by a run that ended
    look = (run_dir / ".lock").open("r")
    fcntl.flock(look, fcntl.LOCK_SH | fcntl.LOCK_NB)
    threading.Timer(0.05, look.close).start()
    with RunLock(run_dir):
        assert (run_dir / ".lock").read_text() == f"{os.getpid()}\n"


def test_a_forked_child_of_a_run_does_not_keep_its_folder_locked(tmp_path):
    # a DataLoader worker outlives a killed run for a few seconds: the run's folder is free for
    # its resume as soon as the run itself is gone, not once the worker has noticed
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
        worker.start()
    try:
        with RunLock(run_dir):  # a new holder: flock refuses a second open file while one holds
            pass
        other = (run_dir / ".lock").open("r")
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free, though the worker lives
        other.close()
    finally:
        worker.kill()
        worker.join()


def test_a_second_sweep_into_a_live_sweeps_folder_is_refused_before_it_writes(tmp_path):
    # a live sweep holds its sweep dir from its start: two sweeps started together into one
    # hydra.sweep.dir would otherwise both pass the check for runs already there, and the one
    # that lost a job folder's lock would have rewritten that folder's .hydra/ record
    sweep = tmp_path / "sweep"
    with SweepLock(sweep):
        result = run_cli("mpexp.train", "-m", *ARGS, "trainer.epochs=1", "trainer.seed=5,6",
                         f"hydra.sweep.dir={sweep}", cwd=tmp_path)  # fmt: skip
        output = one_line_failure(result)
        assert f"Another sweep (pid {os.getpid()}) is running into {sweep}" in output
        assert sorted(p.name for p in sweep.iterdir()) == [".lock"]  # nothing of its own


def test_a_run_into_a_live_runs_folder_writes_no_hydra_record(tmp_path):
    run_dir = tmp_path / "run"
    with RunLock(run_dir):  # a run started a moment earlier, still importing torch
        result = run_cli("mpexp.train", *ARGS, "trainer.epochs=1", f"hydra.run.dir={run_dir}",
                         cwd=tmp_path)  # fmt: skip
        output = one_line_failure(result)
        assert f"Another process (pid {os.getpid()}) is training in {run_dir}" in output
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]


# --- exits that keep the status true ------------------------------------------------------------


@pytest.mark.slow  # waits out W&B's start timeout: about 11 s on 2 cores
def test_a_stop_signal_while_wandb_starts_checkpoints_at_the_first_step(tmp_path):
    run_dir = tmp_path / "run"
    unreachable = {
        "WANDB_BASE_URL": "http://127.0.0.1:9",  # nothing listens: W&B retries until its timeout
        "WANDB_API_KEY": "x" * 40,
    }
    args = [a for a in ARGS if a != "wandb.mode=disabled"]
    proc = start_cli(*args, "trainer.epochs=50", "wandb.mode=online", "wandb.init_timeout=5",
                     f"hydra.run.dir={run_dir}", cwd=tmp_path, env=unreachable)  # fmt: skip
    # training has begun (its first row is written) while W&B is still trying to start
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)

    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "Traceback" not in output
    assert "Stopped by SIGTERM at step" in output
    assert f"trainer.resume={run_dir}" in output
    assert status(run_dir) == "interrupted"
    # the stop's checkpoint at the step it names; rows reach metrics.jsonl at an epoch's end, so
    # the epoch's validated checkpoint is kept beside it as the best so far
    stopped_at = int(re.search(r"Stopped by SIGTERM at step (\d+)", output)[1])
    *best, saved = checkpoint_files(run_dir)
    assert checkpoint_step(saved) == stopped_at and len(best) <= 1
    # the W&B run id was chosen up front, so the resume continues the same W&B run
    assert re.fullmatch(r"[a-z0-9]{8}", torch.load(saved, weights_only=False)["wandb_id"])


def test_a_stop_signal_as_the_run_starts_ends_it_interrupted_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_cli(*ARGS, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    # Hydra has made the run dir; the run now imports torch and builds data and model
    wait_for(lambda: (run_dir / ".hydra" / "config.yaml").exists(), proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)

    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "Traceback" not in output
    assert "Stopped by SIGTERM" in output and "before the first step" in output
    assert status(run_dir) == "interrupted"
    assert not checkpoint_files(run_dir)


def test_a_stop_signal_before_the_first_step_marks_the_run_interrupted(tmp_path):
    stop = StopSignals()
    stop.received = signal.SIGTERM  # as if it came while the data loaded
    run = RunContext(tmp_path, overrides=["precision=bf16"])
    stopping = pytest.raises(Preempted, match="Stopped by SIGTERM while the data loaded")
    with start_world("single", torch.device("cpu")) as world, stopping as stopped:
        stop_if_asked(stop, world, run, "while the data loaded")
    assert "python -m mpexp.train precision=bf16" in str(stopped.value)
    assert status(tmp_path) == "interrupted"


def test_a_stop_signal_that_no_run_answered_ends_the_command_with_one_line(monkeypatch, capsys):
    # e.g. during `--cfg job`: Hydra composes and prints, and no run starts that would stop
    monkeypatch.setattr(mpexp.train, "main", lambda: os.kill(os.getpid(), signal.SIGTERM))
    monkeypatch.setattr(sys, "argv", ["mpexp-train"])
    with pytest.raises(SystemExit) as exited:
        mpexp.train.cli()
    assert exited.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "Stopped by SIGTERM; nothing was trained.\n"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back


# Runs the command as `python -m mpexp.train` does, with the checkpoint that a stop writes taking
# 30 s once its file is written: a second Ctrl-C lands while it is being written, every time. (A
# save that began before the first Ctrl-C is not slowed: the stop's own save comes after it.)
# Runs the command with the checkpoint written for a stop made slow (30 s), inside torch.save's
# writer (WHERE=write: at its third write, where a KeyboardInterrupt comes out of torch.save as a
# RuntimeError) or after it (WHERE=sum: the checksum)
SLOW_STOP_CHECKPOINT = """
import builtins, os, runpy, sys, time
from mpexp.checkpoints import checkpoint, files
from mpexp.stopping import StopSignals

slow = False

class SlowFile:
    def __init__(self, f):
        self.f, self.writes = f, 0
    def write(self, data):
        self.writes += 1
        if self.writes == 3:
            print("third write", flush=True)  # the test's cue to press again
            time.sleep(30)
        return self.f.write(data)
    def __getattr__(self, name):
        return getattr(self.f, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

def save(self, *args, _save=checkpoint.Checkpointer.save):
    global slow
    slow = StopSignals.active().received is not None  # the loop saves for the stop
    return _save(self, *args)

def slow_open(*args, **kwargs):
    f = builtins.open(*args, **kwargs)
    return SlowFile(f) if slow and os.environ["WHERE"] == "write" else f

def sha256_of(path, _sha256_of=files.sha256_of):
    if slow and os.environ["WHERE"] == "sum":
        time.sleep(30)
    return _sha256_of(path)

checkpoint.Checkpointer.save, files.sha256_of, files.open = save, sha256_of, slow_open
sys.argv = ["mpexp.train", *sys.argv[1:]]
runpy.run_module("mpexp.train", run_name="__main__", alter_sys=True)
"""


def start_script(script: str, run_dir, *overrides: str) -> subprocess.Popen:
    """`script` run as a command's process with the run's overrides (and ARGS), in `run_dir`'s
    parent, output in one stream."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true"}
    return subprocess.Popen(
        [sys.executable, "-c", script, *ARGS, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.parametrize("where", ["write", "sum"])
def test_a_second_ctrl_c_stops_at_once_naming_the_last_checkpoint(tmp_path, monkeypatch, where):
    """Pressed while torch.save writes (which reports a KeyboardInterrupt in its writer as a
    RuntimeError: this run once said it could not write the checkpoint) or after."""
    monkeypatch.setenv("WHERE", where)
    run_dir = tmp_path / "run"
    proc = start_script(SLOW_STOP_CHECKPOINT, run_dir, "trainer.checkpoint_every_steps=1")
    wait_for(lambda: checkpoint_files(run_dir), proc)
    proc.send_signal(signal.SIGINT)
    # the second press once the first is taken (two signals at once would arrive as one): the
    # run says so before it writes the checkpoint that the second press cuts short
    said = []
    for line in proc.stdout:
        said.append(line)
        if ("third write" if where == "write" else "Ctrl-C again quits at once") in line:
            break
    proc.send_signal(signal.SIGINT)
    output = "".join(said) + proc.communicate(timeout=120)[0]

    assert proc.returncode == 128 + signal.SIGINT, output
    assert "Traceback" not in output
    assert "SIGINT received: writing a checkpoint at step" in output  # the first press, at once
    assert "Stopped at once by a second Ctrl-C. The last checkpoint is" in output
    assert f"trainer.resume={run_dir}" in output
    assert status(run_dir) == "interrupted"
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


# Runs the command as `python -m mpexp.train` does, with Ctrl-C pressed as the process exits: in
# an exit hook, where torch's (and W&B's) run once the run has written its files and its last line
CTRL_C_AS_IT_EXITS = """
import atexit, os, runpy, signal, sys, time

def press():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(2)  # the signal is handled in here, inside the exit hook

atexit.register(press)
sys.argv = ["mpexp.train", *sys.argv[1:]]
runpy.run_module("mpexp.train", run_name="__main__", alter_sys=True)
"""


def test_a_second_ctrl_c_as_the_process_exits_prints_no_traceback(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_script(CTRL_C_AS_IT_EXITS, run_dir, "trainer.log_every=1")
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, proc)
    proc.send_signal(signal.SIGINT)  # the first press: a checkpoint, one line, then the exit
    output, _ = proc.communicate(timeout=240)

    assert proc.returncode == 128 + signal.SIGINT, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert output.rstrip().endswith(f"trainer.resume={run_dir}")  # the run's line is the last
    assert status(run_dir) == "interrupted" and checkpoint_files(run_dir)


# Runs the command as `python -m mpexp.train` does, with Ctrl-C pressed `presses` times just as
# it starts to import Hydra: the moment a real Ctrl-C within its first second lands in.
CTRL_C_AT_IMPORT = """
import importlib.abc, os, runpy, signal, sys

class CtrlC(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "hydra":
            sys.meta_path.remove(self)
            for _ in range({presses}):
                os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
sys.argv = ["mpexp.train", *sys.argv[1:]]
runpy.run_module("mpexp.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_while_the_command_imports_gives_one_line_and_130(tmp_path, presses):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true"}
    code = CTRL_C_AT_IMPORT.format(presses=presses)
    result = subprocess.run(
        [sys.executable, "-c", code, *TINY, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 128 + signal.SIGINT, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    if presses == 1:  # the run starts and stops before its first step, as it promises
        assert "Stopped by SIGINT as the run started" in output
        assert status(run_dir) == "interrupted"
    else:  # a second press quits at once: nothing had started
        assert output == "Interrupted before the run started; nothing was trained.\n"
        assert not run_dir.exists()


def test_a_closed_terminal_stops_the_run_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true"}
    terminal, tty = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpexp.train", *ARGS, "trainer.epochs=200",
         "trainer.progress=true", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, stdin=tty, stdout=tty, stderr=tty, start_new_session=True,
        # the pty becomes the run's controlling terminal, as a shell's or an ssh session's is
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
    )  # fmt: skip
    os.close(tty)
    try:
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.stat().st_size) and proc.poll() is None:
            if select.select([terminal], [], [], 0.05)[0]:
                os.read(terminal, 65536)  # what a terminal shows; a full one would block the run
    finally:
        os.close(terminal)  # the terminal window closes: the kernel sends SIGHUP
    assert proc.wait(timeout=120) == 128 + signal.SIGHUP
    assert "Stopped by SIGHUP at step" in (run_dir / "train.log").read_text()
    assert status(run_dir) == "interrupted"
    assert checkpoint_files(run_dir)


def test_a_stop_signal_to_the_whole_job_stops_the_run_with_a_checkpoint(tmp_path):
    """SLURM's pre-emption and `timeout` send SIGTERM to every process of the job, an image
    folder's loader workers among them: the run stops as on a SIGTERM to it alone, with no
    traceback of a worker killed under it."""
    for split, count in (("train", 40), ("val", 4)):
        write_images(tmp_path / "images" / split, per_class=count)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpexp.train", *SMALL, f"dataset.path={tmp_path / 'images'}",
         "dataset.num_workers=1", "trainer.epochs=500", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # a job of its own: its process group is the job's processes
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.stat().st_size, proc)  # its workers are up
    os.killpg(proc.pid, signal.SIGTERM)
    said = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, said
    assert "Traceback" not in said and "killed by signal" not in said
    assert "Stopped by SIGTERM at step" in said
    assert status(run_dir) == "interrupted"
    assert checkpoint_files(run_dir)


class WorkerPids(torch.utils.data.Dataset):
    """Each item is the pid of the process that read it."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        return os.getpid()


def test_loader_workers_go_on_through_the_jobs_stop_signals():
    """A scheduler's SIGTERM and a terminal's SIGINT reach every process of the job; the workers
    leave them to the main process and go on serving its batches."""
    batches = iter(WorkerLoader(WorkerPids(), batch_size=1, num_workers=2))
    workers = {int(next(batches)) for _ in range(2)}
    assert len(workers) == 2 and os.getpid() not in workers
    for pid in workers:  # sent by another process, as the scheduler's and the terminal's are
        subprocess.run(["kill", "-TERM", str(pid)], check=True)
        subprocess.run(["kill", "-INT", str(pid)], check=True)
    time.sleep(0.5)  # what the signals would do, done
    assert {int(pid) for pid in batches} == workers  # the other 10 batches, from the same two


class DoneAtFork(torch.utils.data.Dataset):
    """One item: whether `work` had finished when the worker reading it was forked."""

    def __init__(self, work):
        self.work = work

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> bool:
        return self.work.done()


def test_loader_workers_are_forked_once_the_flop_count_has_ended(monkeypatch):
    """A worker forked while the FLOP count's thread ran torch's code could hang for ever before
    its first batch (the C library's atexit lock, held by that thread at the fork, stays held in
    the child), and the run with it: the loaders fork once the count's thread has ended."""

    def slow_count(*args):
        time.sleep(1)  # the count is still running when the loader starts
        return 1.0

    monkeypatch.setattr(flops, "flops_per_sample", slow_count)
    counting = flops.throughput(torch.nn.Linear(2, 2), None, 4, None, 1)
    loader = WorkerLoader(DoneAtFork(counting), batch_size=None, num_workers=1)
    assert next(iter(loader)) is True
    assert counting.result().flops_per_sample == 1.0


# The loader's worker is alive as Python exits, as it is when a run ends on an error: the exit
# ends it with a SIGTERM of the main process's own, which a worker that ignored every SIGTERM
# waited out for ever
EXIT_WITH_A_LIVE_WORKER = """
from torch.utils.data import Dataset

from mpexp.data.workers import WorkerLoader


class Items(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return index


batches = iter(WorkerLoader(Items(), num_workers=1))
next(batches)
"""


def test_a_process_that_exits_with_a_loader_worker_alive_ends_it():
    ended = subprocess.run([sys.executable, "-c", EXIT_WITH_A_LIVE_WORKER], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ended.returncode == 0, ended.stderr
    assert ended.stderr == ""


def test_metrics_deleted_while_the_run_trains_are_written_again_whole(tmp_path, caplog):
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"

    def delete_once_written() -> None:  # a clean-up script, a user's rm
        while not (metrics.exists() and metrics.stat().st_size > 0):
            time.sleep(0.005)
        metrics.unlink()

    deleter = threading.Thread(target=delete_once_written, daemon=True)
    deleter.start()
    with caplog.at_level(logging.WARNING, logger="mpexp"):
        train(make_cfg(*ARGS, "trainer.log_every=1", "trainer.epochs=3"), RunContext(run_dir))
    deleter.join(timeout=10)

    assert not deleter.is_alive()  # it deleted the file while the run went on
    assert caplog.text.count(f"{metrics} was deleted or replaced while the run went on") == 1
    steps, epochs = read_metrics(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 25)) and len(epochs) == 3
    assert status(run_dir) == "finished"


def test_a_checkpoint_after_metrics_were_deleted_records_their_whole_length(tmp_path):
    tracker = Tracker(
        RunContext(tmp_path), {}, make_cfg("wandb.mode=disabled").wandb, Classification
    )
    tracker.log({"step": 1, "train/loss": 2.5})
    whole = (tmp_path / "metrics.jsonl").stat().st_size
    (tmp_path / "metrics.jsonl").unlink()
    assert tracker.flush() == whole  # the place a resume rewinds to: after the first row
    tracker.log({"step": 2, "train/loss": 2.25})
    tracker.close()
    assert [r["step"] for r in read_metrics(tmp_path)[0]] == [1, 2]


# --- runs that train nothing ---------------------------------------------------------------------


def test_a_run_with_no_step_per_epoch_is_refused_before_training(tmp_path):
    # a ConfigError: the command line's one line and exit 2 (tests/test_cli.py)
    cfg = make_cfg(*TINY, "dataset.train_size=100", "dataset.batch_size=128")
    with pytest.raises(ConfigError) as refused:
        train(cfg, RunContext(tmp_path))
    assert "dataset.batch_size=128 is larger than the training set (100 samples)" in str(
        refused.value
    )
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_run_whose_every_step_was_skipped_ends_failed(tmp_path, caplog):
    # from 1e30 the scale needs about 80 halvings before fp16 holds the gradients: 8 steps skip
    overrides = ["precision=fp16", "loss_scaling=dynamic", "loss_scaling.init_scale=1e30",
                 "dataset.train_size=256"]  # fmt: skip
    # a NumericsError: the command line's one line and exit 2 (tests/test_diagnostics.py's floor)
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="mpexp"), pytest.raises(NumericsError) as failed:
        train(make_cfg(*TINY, *overrides), RunContext(run_dir))
    for epoch in (1, 2):
        said = f"Epoch {epoch} took no optimizer step: all 4 of its steps were skipped"
        assert caplog.text.count(said) == 1
    assert "No optimizer step was taken: all 8 steps were skipped" in str(failed.value)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "No optimizer step was taken" in summary["error"]
    assert summary["amp/skipped_steps"] == 8  # what happened is kept


# --- damaged data ------------------------------------------------------------------------------


def mnist_files(root: Path, folder: str = "MNIST", n: int = 64) -> Path:
    rng = np.random.default_rng(0)
    splits = {
        prefix: (rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
                 rng.integers(0, 10, n, dtype=np.uint8))
        for prefix in ("train", "t10k")
    }  # fmt: skip
    write_mnist_files(root, splits, folder)
    return root / folder / "raw"


@pytest.mark.parametrize(
    ("cls", "folder"), [(MNISTData, "MNIST"), (FashionMNISTData, "FashionMNIST")]
)
def test_a_truncated_images_file_is_named_with_its_size(tmp_path, cls, folder):
    raw = mnist_files(tmp_path, folder)
    images = raw / "train-images-idx3-ubyte"
    whole = images.stat().st_size
    images.write_bytes(images.read_bytes()[: whole // 3])
    with pytest.raises(DataError) as err:
        cls(root=str(tmp_path), download=False, batch_size=8).setup(torch.device("cpu"))
    assert f"train-images-idx3-ubyte is truncated: {whole // 3:,} of {whole:,} bytes" in str(
        err.value
    )


def test_a_file_cut_to_its_first_bytes_is_named(tmp_path):
    raw = mnist_files(tmp_path)
    labels = raw / "t10k-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:6])
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte is truncated: 6 bytes, less than"):
        MNISTData(root=str(tmp_path), download=False, batch_size=8).setup(torch.device("cpu"))


def test_a_label_outside_the_classes_is_named_before_training(tmp_path):
    raw = mnist_files(tmp_path)
    labels = raw / "train-labels-idx1-ubyte"
    data = bytearray(labels.read_bytes())
    data[8 + 5] = 200  # the sixth label, after the 8-byte header
    labels.write_bytes(bytes(data))
    cfg = make_cfg(
        "dataset=mnist", f"dataset.root={tmp_path}", "dataset.download=false",
        "dataset.batch_size=32", "model=simplecnn_small", "wandb.mode=disabled",
    )  # fmt: skip
    with pytest.raises(DataError) as refused:
        train(cfg, RunContext(tmp_path / "run"))
    assert f"{labels} holds the label 200 at position 5" in str(refused.value)
    assert "10 classes (0 to 9)" in str(refused.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before training


def test_image_and_label_files_that_disagree_are_named(tmp_path):
    raw = mnist_files(tmp_path)
    labels = raw / "t10k-labels-idx1-ubyte"
    labels.write_bytes(struct.pack(">HBBI", 0, 8, 1, 10) + bytes(10))
    with pytest.raises(DataError, match="holds 64 images but t10k-labels-idx1-ubyte 10 labels"):
        MNISTData(root=str(tmp_path), download=False, batch_size=8).setup(torch.device("cpu"))


@pytest.mark.parametrize("split", ["train", "t10k"])
def test_an_mnist_split_with_no_samples_is_named(tmp_path, split):
    sizes = {"train": 64, "t10k": 64, split: 0}
    splits = {prefix: (np.zeros((n, 28, 28), np.uint8), np.zeros(n, np.uint8))
              for prefix, n in sizes.items()}  # fmt: skip
    write_mnist_files(tmp_path, splits)
    images = tmp_path / "MNIST" / "raw" / f"{split}-images-idx3-ubyte"
    with pytest.raises(DataError, match=f"{images} holds no images"):
        MNISTData(root=str(tmp_path), download=False, batch_size=8).setup(torch.device("cpu"))


def test_a_synthetic_set_larger_than_memory_is_refused_before_allocating():
    data = SyntheticData(train_size=100_000_000_000, batch_size=64)
    with pytest.raises(DataError, match=r"dataset.train_size=100,000,000,000 .* need about"):
        data.setup(torch.device("cpu"))


def test_a_damaged_cifar_batch_is_named(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    (folder / "data_batch_1").write_bytes(b"\x80\x04\x95 not a whole pickle")
    with pytest.raises(DataError, match=r"data_batch_1 is not the file CIFAR-10 publishes"):
        CIFAR10Data(root=str(tmp_path), download=False, batch_size=8).setup(torch.device("cpu"))


class _OpensAFile:
    """A pickle that, once loaded, creates `marker`: any code could run in its place."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_cifar_batch_that_fails_its_checksum_is_never_unpickled(tmp_path):
    folder = tmp_path / "data" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    marker = tmp_path / "code-ran"
    (folder / "data_batch_1").write_bytes(pickle.dumps(_OpensAFile(marker)))
    data = CIFAR10Data(root=str(tmp_path / "data"), download=False, batch_size=8)
    with pytest.raises(DataError) as refused:
        data.setup(torch.device("cpu"))
    output = str(refused.value)
    assert not marker.exists()
    assert f"{folder / 'data_batch_1'} is not the file CIFAR-10 publishes" in output
    assert "dataset.download=true" in output and "cifar-10-python.tar.gz" in output


class NaNInValidation(SyntheticData):
    """The synthetic set with NaN in its first three validation images."""

    def load(self):
        train, (images, labels), classes = super().load()
        images[:3, 0, 0, 0] = float("nan")
        return train, (images, labels), classes


def test_nan_in_the_validation_images_is_warned_about_once_at_setup(tmp_path, caplog):
    cfg = make_cfg(*ARGS, "trainer.epochs=1", f"dataset._target_={__name__}.NaNInValidation")
    with caplog.at_level(logging.WARNING):
        summary = train(cfg, RunContext(tmp_path))
    warnings = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert warnings == [
        f"The validation set of dataset={__name__}.NaNInValidation holds 3 images with "
        "non-finite values (NaN or inf), the first at position 0: the run's val/loss will be "
        "NaN. Fix or drop those images."
    ]
    assert math.isnan(summary["val/loss"])


def test_a_failed_download_says_why_and_leaves_no_empty_folders(tmp_path, monkeypatch):
    # a real download attempt by torchvision, to a port where nothing listens
    monkeypatch.setattr(torchvision.datasets.MNIST, "mirrors", ["http://127.0.0.1:9/"])
    root = tmp_path / "new" / "data"
    with pytest.raises(DataError, match="could not be downloaded") as failed:
        MNISTData(root=str(root), download=True, batch_size=8).setup(torch.device("cpu"))
    # torchvision's reason is on the lines under its first: the message keeps it on one line
    first = str(failed.value).splitlines()[0]
    assert "Error downloading train-images-idx3-ubyte.gz (" in first
    assert "refused" in first.lower()
    assert list(tmp_path.iterdir()) == []


# --- impossible values -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["model=simplecnn", "model.width=0"], "model.width=0"),
        (["dataset.channels=0"], "dataset.channels=0"),
        (["dataset.num_classes=0"], "dataset.num_classes=0"),
        (["optimizer.betas=[0.9]"], "optimizer.betas=[0.9]"),
        (["dataset.noise=1.0"], "dataset.noise=1.0"),
        (["optimizer=sgd", "optimizer.momentum=2"], "optimizer.momentum=2.0"),
    ],
)
def test_impossible_values_are_named_before_anything_runs(overrides, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        validate(make_cfg(*TINY, *overrides))


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (
            ["dataset.height=2", "dataset.width=2"],
            "model=simplecnn on dataset=synthetic cannot take the dataset's 1x2x2 images: it pools "
            "twice by 2, so images need 4x4 pixels at least, not 2x2.\nChange the images' size "
            "(dataset.channels=1, dataset.height=2, dataset.width=2 now)",
        ),
        (
            ["model.width=1000000"],
            "model=simplecnn on dataset=synthetic: the model does not fit in this machine's "
            "memory (one of its tensors needs 67,055 GiB).\nUse a smaller model "
            "(model.width=1000000 now).",
        ),
    ],
    ids=["images too small", "model too large"],
)
def test_a_model_that_cannot_be_built_names_the_key_and_leaves_no_run_dir(
    tmp_path, in_process, overrides, said
):
    result = in_process(*TINY, *overrides, cwd=tmp_path)
    assert said in one_line_failure(result)
    assert result.returncode == 2
    assert not (tmp_path / "outputs").exists()  # nor the date's folder made for it


def test_images_too_small_for_a_deeper_model_are_named_with_their_keys():
    tiny = [o for o in TINY if not o.startswith("model")]
    cfg = make_cfg(*tiny, "model=deepcnn", "dataset.height=2", "dataset.width=2")
    with pytest.raises(ConfigError) as refused:
        build_parts(cfg, World(torch.device("cpu")), {"model": "deepcnn", "dataset": "synthetic"})
    assert str(refused.value).startswith(
        "model=deepcnn on dataset=synthetic cannot take the dataset's 1x2x2 images: "
    )
    assert "(dataset.channels=1, dataset.height=2, dataset.width=2 now)" in str(refused.value)


def test_a_users_value_under_mpexps_own_name_is_refused_at_the_call(
    tmp_path, in_process, monkeypatch
):
    """A model of the user's that logs `train/loss` would overwrite the loss the report reads; the
    run ends failed, with one line naming the key and the line that logged it."""
    (tmp_path / "my_logging_models.py").write_text(
        "import mpexp\n"
        "from mpexp.models.simplecnn import SimpleCNN\n\n\n"
        "class LossLoggingCNN(SimpleCNN):\n"
        "    def forward(self, x):\n"
        "        if self.training:\n"
        "            mpexp.log({'train/loss': 'oops'})\n"
        "        return super().forward(x)\n"
    )
    run_dir = tmp_path / "run"
    monkeypatch.syspath_prepend(tmp_path)
    result = in_process(*TINY, "model._target_=my_logging_models.LossLoggingCNN",
                        f"hydra.run.dir={run_dir}", cwd=tmp_path)  # fmt: skip
    said = (
        "mpexp.log: 'train/loss' is one of mpexp's own metric names (train/, val/, test/, amp/, "
        "opt/, perf/, mem/, diag/, step, epoch, lr, samples, tokens); choose another prefix for "
        "your values, e.g. "
        f"'my/train/loss'. (mpexp.log called at {tmp_path / 'my_logging_models.py'}:8)"
    )
    assert said in one_line_failure(result)
    assert result.returncode == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == said
    assert "oops" not in (run_dir / "metrics.jsonl").read_text()


# --- resuming what cannot be resumed -----------------------------------------------------------


@pytest.fixture(scope="module")
def _one_finished_run(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("finished")
    run_dir = cwd / "run"
    result = command_in_process(*ARGS, "trainer.keep_checkpoints=2", "wandb.mode=offline",
                                f"hydra.run.dir={run_dir}", cwd=cwd)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return run_dir


@pytest.fixture
def finished_run(_one_finished_run, tmp_path) -> Path:
    """A finished command-line run with two checkpoints, a copy of its own for each test (each
    test damages or resumes it): one training for all of them."""
    run_dir = tmp_path / "run"
    shutil.copytree(_one_finished_run, run_dir, symlinks=True)
    return run_dir


def snapshot(run_dir: Path) -> dict:
    """The run's own files byte for byte, and its W&B runs (W&B's service may still be writing its
    debug logs after the process ended)."""
    own = {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*")
           if p.is_file() and "wandb" not in p.relative_to(run_dir).parts}  # fmt: skip
    return {**own, "wandb runs": sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))}


@pytest.mark.parametrize(("epochs", "said"), [
    ("2", "already trained all its 2 epochs"),
    ("1", "has trained 2 epochs, more than trainer.epochs=1 asks for"),
])  # fmt: skip
def test_resuming_a_finished_run_says_how_to_train_on_and_changes_nothing(
    finished_run, in_process, epochs, said
):
    before = snapshot(finished_run)
    result = in_process(*ARGS, "trainer.keep_checkpoints=2", "wandb.mode=offline",
                        f"trainer.epochs={epochs}", f"trainer.resume={finished_run}",
                        cwd=finished_run.parent)  # fmt: skip
    output = one_line_failure(result)
    assert said in output and "To train on, give more epochs: trainer.epochs=4" in output
    assert snapshot(finished_run) == before  # no rows, no W&B segment, no .hydra rewrite


def rewrite_checkpoint(path: Path, change) -> None:
    """Change a checkpoint's state and write its checksum anew: a file that passes the checksum
    but is not what the run saved (edited by hand, written by another program)."""
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)
    files.checksum_file(path).write_text(f"{files.sha256_of(path)}  {path.name}\n")


def _narrower_first_conv(state: dict) -> None:
    key = next(k for k, v in state["model"].items() if v.ndim == 4)
    state["model"][key] = state["model"][key][:3].clone()


def _per_process_batch(state: dict) -> None:
    """As a 2-process run saved it before dataset.batch_size was the step's over all processes."""
    state["world_size"] = 2
    del state["batch"]


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda state: state.pop("config"), "is not a complete mpexp checkpoint: it lacks config"),
        (lambda state: state.pop("scaler"), "is not a complete mpexp checkpoint: it lacks scaler"),
        (_narrower_first_conv, "does not fit the run's model: conv1.weight is (3, 1, 3, 3) in the "
         "checkpoint, (8, 1, 3, 3) in the model"),
        (_per_process_batch, "was saved by a run of 2 processes when dataset.batch_size was each "
         "process's batch (2 x 64 = 128 samples a step)"),
    ],
    ids=["no config", "no scaler", "a weight of another shape", "a per-process batch"],
)  # fmt: skip
def test_a_refused_resume_leaves_the_run_as_it_was(finished_run, in_process, change, said):
    _, newest = checkpoint_files(finished_run)
    rewrite_checkpoint(newest, change)
    before = snapshot(finished_run)
    result = in_process(*ARGS, "trainer.keep_checkpoints=2", "wandb.mode=offline",
                        "trainer.epochs=3", f"trainer.resume={finished_run}",
                        cwd=finished_run.parent)  # fmt: skip
    output = one_line_failure(result)
    assert f"trainer.resume: {newest} {said}" in output
    assert result.returncode == 2
    assert snapshot(finished_run) == before  # status, rows, checkpoints, .hydra/, train.log


def test_a_checkpoint_with_flipped_bytes_is_called_corrupt(finished_run):
    older, newest = checkpoint_files(finished_run)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    cfg = make_cfg(*ARGS, "trainer.keep_checkpoints=2", "trainer.epochs=3",
                   f"trainer.resume={finished_run}")  # fmt: skip
    with pytest.raises(ConfigError) as err:
        train(cfg, RunContext(finished_run))
    message = str(err.value)
    assert f"{newest} is corrupt: its SHA-256 does not match" in message
    assert f"trainer.resume={older}" in message  # the other checkpoint there is

    older.unlink()
    with pytest.raises(ConfigError, match="keeps no other checkpoint"):
        files.load(newest)


def test_an_error_quoted_in_a_message_is_one_line():
    """What the model check, FSDP's refusal and the compile and capture fallbacks quote of an
    error: never an empty reason, never a traceback's worth of lines."""
    assert reason(ValueError("")) == "ValueError"
    assert reason(RuntimeError("shape mismatch\n  at layer 3")) == "shape mismatch"
    dynamo = RuntimeError("backend='inductor' raised:\nCompilationError: no C compiler\n...")
    assert reason(dynamo) == "backend='inductor' raised: CompilationError: no C compiler"
