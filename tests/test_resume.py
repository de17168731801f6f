"""Checkpoints and resume: a killed, stopped or crashed run continues exactly where it was."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mpexp.checkpoints import files
from mpexp.checkpoints.checkpoint import Checkpointer, checkpoint_files
from mpexp.checkpoints.resume import check_config
from mpexp.config import to_dict
from mpexp.errors import ConfigError, OutputError
from mpexp.run.runner import train
from mpexp.rundir import hydra_quoted
from mpexp.tracking.run_context import RunContext
from tests.conftest import ROOT, TINY, make_cfg
from tests.test_training import read_metrics

# two epochs of 8 steps, bitwise repeatable on CPU
ARGS = [*TINY, "dataset.train_size=512", "trainer.deterministic=true"]
NOT_REPEATABLE = ("perf/", "mem/")  # timings and memory differ between any two runs


@pytest.fixture(autouse=True)
def _nondeterministic_afterwards():
    yield
    torch.use_deterministic_algorithms(False)


def start_cli(*overrides: str, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """`python -m mpexp.train <overrides>` started in the background, output in one stream."""
    full_env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.Popen(
        [sys.executable, "-m", "mpexp.train", *overrides],
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(condition, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the run ended first:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            kill_all(proc)
            pytest.fail(f"timed out waiting for the run; it printed:\n{printed(proc)}")
        time.sleep(0.02)


def printed(proc: subprocess.Popen) -> str:
    """What a killed `proc` printed, where its children let the pipe close (a hung loader
    worker, or a rank torchrun started, may hold it open)."""
    try:
        return proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        return "(not read: a process it started still holds its output open)"


def kill_all(proc: subprocess.Popen) -> None:
    """`proc`, and its loader's workers where it leads a process group of its own (started with
    `start_new_session`): a hung worker would outlive the test."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
            return
    except ProcessLookupError:
        return
    proc.kill()


def comparable(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the values that no two runs share."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(NOT_REPEATABLE)} for r in rows]


def status(run_dir: Path) -> str:
    return json.loads((run_dir / "summary.json").read_text())["status"]


def assert_bitwise_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_bitwise_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bitwise_equal(x, y)
    else:
        assert a == b


def killed_and_resumed(
    args: list[str], tmp_path: Path, caplog, resume_args: list[str] | None = None
) -> tuple[Path, Path]:
    """The run of `args` whole in this process, and again in a process killed (SIGKILL) after
    its first checkpoint and resumed (with `resume_args` if given, else `args`): the two run
    directories, for the test to compare."""
    whole = tmp_path / "whole"
    train(make_cfg(*args), RunContext(whole))

    killed = tmp_path / "killed"
    proc = start_cli(*args, f"hydra.run.dir={killed}", cwd=tmp_path)
    wait_for(lambda: checkpoint_files(killed), proc)
    proc.kill()
    proc.wait()
    assert status(killed) == "running"  # it died mid-run

    resume(resume_args if resume_args is not None else args, killed, caplog)
    return whole, killed


def crashed_and_resumed(
    args: list[str], tmp_path: Path, monkeypatch, caplog, resume_args: list[str] | None = None
) -> tuple[Path, Path]:
    """As killed_and_resumed, the run dying in this process as it comes to its second checkpoint
    (test_resume tests a real kill; a test of what a checkpoint keeps needs no process of its
    own): the two run directories, for the test to compare."""
    whole = tmp_path / "whole"
    train(make_cfg(*args), RunContext(whole))

    crashed = tmp_path / "crashed"
    real_save, saves = Checkpointer.save, []

    def dying_at_the_second(self, *position_and_rows):
        saves.append(position_and_rows)
        if len(saves) == 2:
            raise SimulatedCrash
        return real_save(self, *position_and_rows)

    monkeypatch.setattr(Checkpointer, "save", dying_at_the_second)
    with pytest.raises(SimulatedCrash):
        train(make_cfg(*args), RunContext(crashed))
    monkeypatch.undo()
    assert len(checkpoint_files(crashed)) == 1  # it died mid-run

    resume(resume_args if resume_args is not None else args, crashed, caplog)
    return whole, crashed


def resume(args: list[str], run_dir: Path, caplog) -> None:
    """`trainer.resume=<run_dir>` in this process (the command line's resume is
    test_faults's to test), which says it resumes from the newest checkpoint."""
    newest = checkpoint_files(run_dir)[-1]
    with caplog.at_level(logging.INFO, logger="mpexp"):
        train(make_cfg(*args, f"trainer.resume={run_dir}"), RunContext(run_dir))
    assert f"Resuming {newest}: epoch" in caplog.text


class SimulatedCrash(BaseException):
    """The process dying: nothing in the code under test handles it."""


def assert_same_final_state(whole: Path, resumed: Path, parts: tuple[str, ...]) -> None:
    """The newest checkpoints of two runs hold the same `parts`, bit for bit."""
    final = [files.load(checkpoint_files(d)[-1]) for d in (whole, resumed)]
    for part in parts:
        assert_bitwise_equal(final[0][part], final[1][part])


def test_a_run_killed_after_a_checkpoint_resumes_to_the_same_result(tmp_path, caplog):
    args = [*ARGS, "trainer.checkpoint_every_steps=3"]  # checkpoints fall mid-epoch
    whole, killed = killed_and_resumed(args, tmp_path, caplog)

    # every step and epoch once, with the uninterrupted run's values; the same final state
    assert comparable(killed) == comparable(whole)
    assert status(killed) == "finished"
    assert_same_final_state(whole, killed, ("model", "optimizer", "scaler", "position"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_writes_a_checkpoint_and_says_how_to_resume(tmp_path, signum):
    run_dir = tmp_path / "run"
    # log_every=1: the first rows reach metrics.jsonl after step 2, a sign that training is on
    proc = start_cli(*ARGS, "trainer.log_every=1", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, proc)
    proc.send_signal(signum)
    output, _ = proc.communicate(timeout=240)

    assert proc.returncode == 128 + signum, output
    assert "Traceback" not in output
    (path,) = checkpoint_files(run_dir)
    position = files.load(path)["position"]
    steps, _ = read_metrics(run_dir)
    assert steps[-1]["step"] == position["step"] < 16  # stopped early, every step logged
    assert status(run_dir) == "interrupted"
    assert f"trainer.resume={run_dir}" in output


@pytest.mark.slow  # a stopped run and its resume through a shell: about 11 s on 2 cores
def test_the_printed_resume_command_works_pasted_into_a_shell(tmp_path):
    run_dir = tmp_path / "it's a run"  # a space and a quote: both the shell's and Hydra's
    proc = start_cli(*ARGS, "trainer.log_every=1", f"hydra.run.dir={hydra_quoted(str(run_dir))}",
                     cwd=tmp_path)  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=240)
    assert status(run_dir) == "interrupted", output

    printed = output.split("Resume with:\n", 1)[1].splitlines()[0].strip()
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    env = {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true"}
    resumed = subprocess.run(printed, shell=True, cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, printed + "\n" + resumed.stderr[-3000:]
    assert status(run_dir) == "finished"
    assert [r["step"] for r in read_metrics(run_dir)[0]] == list(range(1, 17))


FP16 = [
    *ARGS,
    "precision=fp16",
    "loss_scaling=dynamic",
    "loss_scaling.init_scale=4",
    "loss_scaling.growth_interval=3",
]


def test_resume_restores_the_loss_scale_and_growth_tracker_and_the_wandb_run(tmp_path):
    part = tmp_path / "part"
    train(make_cfg(*FP16, "trainer.epochs=1", "wandb.mode=offline"), RunContext(part))

    saved = files.load(checkpoint_files(part)[-1])["scaler"]
    # 8 clean steps from 4, doubling every 3: two doublings and two steps towards the next
    assert (saved["scale"], saved["_growth_tracker"]) == (16.0, 2)

    # continue to 2 epochs; the run goes on in its own directory whatever RunContext says
    cfg = make_cfg(*FP16, f"trainer.resume={part}", "wandb.mode=offline")
    train(cfg, RunContext(tmp_path / "elsewhere"))
    # as in one uninterrupted run: step 9 completes the growth interval begun before the
    # checkpoint, so step 10 runs at twice the scale; with a reset tracker that would be step 12
    scales = [r["amp/scale"] for r in read_metrics(part)[0]]
    assert scales == [4.0] * 3 + [8.0] * 3 + [16.0] * 3 + [32.0] * 3 + [64.0] * 3 + [128.0]

    wandb_runs = sorted((part / "wandb").glob("offline-run-*"))
    # offline-run-<date>_<time>-<run id>, with "-1" added by W&B when both began in one second
    ids = {re.match(r"offline-run-\d{8}_\d{6}-(\w+)", p.name).group(1) for p in wandb_runs}
    assert len(wandb_runs) == 2 and len(ids) == 1


def test_resume_under_a_different_config_is_refused_with_the_command_to_use(tmp_path):
    run = RunContext(tmp_path, overrides=["dataset=synthetic", "optimizer.lr=3e-3"])
    train(make_cfg(*ARGS, "trainer.epochs=1"), run)
    changed = [a for a in ARGS if not a.startswith("optimizer.lr")]
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*changed, f"trainer.resume={tmp_path}"), run)
    message = str(err.value)
    assert "optimizer.lr: 0.003 in the run, 0.0001 now" in message
    assert f"mpexp.train dataset=synthetic optimizer.lr=3e-3 trainer.resume={tmp_path}" in message


@pytest.mark.parametrize(
    ("failure", "raised"),
    [
        (SimulatedCrash(), SimulatedCrash),
        (OSError(errno.ENOSPC, "No space left on device"), OutputError),
        # what torch.save raises when the disk fills under its zip writer
        (
            RuntimeError("PytorchStreamWriter failed writing file data/3: file write failed"),
            OutputError,
        ),
    ],
    ids=["crash", "disk-full", "disk-full-in-torch"],
)
def test_a_checkpoint_write_that_dies_halfway_leaves_the_previous_one(
    tmp_path, monkeypatch, failure, raised
):
    real_save, calls = torch.save, []

    def save_dying_the_second_time(obj, f, *args, **kwargs):
        calls.append(obj)
        if len(calls) == 2:
            f.write(b"half a checkpoint")
            raise failure
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_dying_the_second_time)
    args = [*ARGS, "trainer.checkpoint_every_steps=3"]
    with pytest.raises(raised) as err:
        train(make_cfg(*args), RunContext(tmp_path))
    monkeypatch.undo()

    (previous,) = checkpoint_files(tmp_path)
    assert files.load(previous)["position"]["step"] == 3  # intact: its checksum agrees
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))  # no partial file filling the disk
    if raised is OutputError:
        message = str(err.value)
        assert str(failure.args[-1]) in message and str(previous) in message
        assert f"trainer.resume={tmp_path}" in message
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["status"] == "failed" and str(failure.args[-1]) in summary["error"]
        assert not (tmp_path / "summary.json.tmp").exists()

    train(make_cfg(*args, f"trainer.resume={tmp_path}"), RunContext(tmp_path))
    steps, epochs = read_metrics(tmp_path)
    assert [r["step"] for r in steps] == list(range(1, 17)) and len(epochs) == 2
    assert status(tmp_path) == "finished"


def stop_before_renaming_over(path: Path, monkeypatch) -> None:
    """A second Ctrl-C just before a new file is renamed over the checkpoint at `path`."""
    real_replace = os.replace

    def stopping(src, dst):
        if Path(dst) == path and path.exists():
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", stopping)


def test_a_kill_while_an_epochs_end_replaces_its_steps_checkpoint_leaves_it_resumable(
    tmp_path, monkeypatch
):
    # Every 8 steps is every epoch's last step: the checkpoint written after it is replaced by
    # the epoch's end, validated. A second Ctrl-C (or a kill) lands between the checksum's rename
    # and the checkpoint's: the file in place is still the first one.
    args = [*ARGS, "trainer.checkpoint_every_steps=8"]
    stop_before_renaming_over(tmp_path / "checkpoints" / "step-00000008.pt", monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train(make_cfg(*args), RunContext(tmp_path))
    monkeypatch.undo()

    (kept,) = checkpoint_files(tmp_path)
    assert files.load(kept)["position"] == {"epoch": 1, "batch": 8, "step": 8}
    train(make_cfg(*args, f"trainer.resume={tmp_path}"), RunContext(tmp_path))
    steps, epochs = read_metrics(tmp_path)
    assert [r["step"] for r in steps] == list(range(1, 17)) and len(epochs) == 2
    assert status(tmp_path) == "finished"
    (last,) = checkpoint_files(tmp_path)  # and its checksum file is back to one sum
    assert len(files.checksum_file(last).read_text().splitlines()) == 1


def test_a_checkpoint_replaced_beside_no_checksum_verifies_after_a_kill(tmp_path, monkeypatch):
    path = tmp_path / "checkpoints" / "step-00000008.pt"
    path.parent.mkdir()
    files.write_atomically({"written": "first"}, path)
    files.checksum_file(path).unlink()  # lost, or never written (an older mpexp's file)
    stop_before_renaming_over(path, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        files.write_atomically({"written": "second"}, path)
    monkeypatch.undo()
    files.verify(path)  # the file in place is the first, and its sum is listed
    assert torch.load(path, weights_only=True)["written"] == "first"


def test_a_replacing_save_that_cannot_trim_its_checksum_file_still_succeeds(tmp_path, monkeypatch):
    # the new file is in place and listed: a full disk at the last rewrite must not fail the save
    # (with keep_checkpoints=1 the run would call itself without a checkpoint)
    path = tmp_path / "step-00000008.pt"
    files.write_atomically({"written": "first"}, path)
    real_write, writes = files._write_synced, []

    def full_disk_the_second_time(where, text):
        writes.append(where)
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        real_write(where, text)

    monkeypatch.setattr(files, "_write_synced", full_disk_the_second_time)
    files.write_atomically({"written": "second"}, path)
    monkeypatch.undo()
    files.verify(path)
    assert torch.load(path, weights_only=True)["written"] == "second"
    assert not list(tmp_path.glob("*.tmp*"))


def test_a_cosine_run_cannot_be_resumed_with_more_epochs():
    from omegaconf import OmegaConf

    from mpexp.errors import ConfigError

    def state(*overrides):
        cfg = make_cfg(*TINY, *overrides)
        return {"config": OmegaConf.to_container(cfg, resolve=True), "overrides": list(overrides)}

    # more epochs are fine for a constant rate, but would bend a cosine schedule mid-run
    check_config(state(), make_cfg(*TINY, "trainer.epochs=5"), "run")
    saved = state("scheduler=cosine")
    with pytest.raises(ConfigError, match=r"trainer\.epochs"):
        check_config(saved, make_cfg(*TINY, "scheduler=cosine", "trainer.epochs=5"), "run")


def test_files_in_checkpoints_that_mpexp_did_not_name_are_left_alone(tmp_path):
    train(make_cfg(*ARGS, "trainer.epochs=1"), RunContext(tmp_path))
    folder = tmp_path / "checkpoints"
    (first,) = checkpoint_files(tmp_path)
    theirs = {"step-best.pt": b"a user's best model", "notes.tmp": b"a note", "step-7": b"x"}
    for name, content in theirs.items():
        (folder / name).write_bytes(content)
    # what a kill leaves between writing a checkpoint's checksum and renaming it into place,
    # and a write cut short
    lone = folder / "step-00000012.pt.sha256"
    lone.write_text(files.checksum_file(first).read_text())
    (folder / "step-00000012.pt.tmp").write_bytes(b"half a checkpoint")

    # a resume reads the checkpoints, and the resumed run writes and prunes them
    train(make_cfg(*ARGS, f"trainer.resume={tmp_path}"), RunContext(tmp_path))
    assert status(tmp_path) == "finished"
    assert [p.name for p in checkpoint_files(tmp_path)] == ["step-00000016.pt"]
    assert {p.name for p in folder.iterdir()} == {
        *theirs, "step-00000016.pt", "step-00000016.pt.sha256"
    }  # fmt: skip
    assert {name: (folder / name).read_bytes() for name in theirs} == theirs


def test_an_empty_checksum_beside_a_checkpoint_is_warned_about(tmp_path, caplog):
    # a power loss after the rename of a checksum not yet on disk leaves it empty
    train(make_cfg(*ARGS, "trainer.epochs=1"), RunContext(tmp_path))
    (saved,) = checkpoint_files(tmp_path)
    files.checksum_file(saved).write_text("")
    with caplog.at_level(logging.WARNING):
        train(make_cfg(*ARGS, f"trainer.resume={tmp_path}"), RunContext(tmp_path))
    assert (
        f"step-00000008.pt.sha256 holds no SHA-256 (it is empty or damaged): {saved} is not "
        "verified." in caplog.text
    )
    assert status(tmp_path) == "finished"


def test_a_run_from_before_a_key_existed_resumes_when_the_key_does_what_it_did():
    """dataset.augment came after runs were checkpointed without it: such a run resumes with
    augmentation off (what it trained with), and is refused with it on."""
    cfg = make_cfg(*ARGS)
    before = to_dict(cfg)
    del before["dataset"]["augment"]
    state = {"config": before, "overrides": []}
    check_config(state, cfg, "run")  # no augmentation now either: the same run
    with pytest.raises(ConfigError, match=r"dataset\.augment\.flip: absent in the run, True now"):
        check_config(state, make_cfg(*ARGS, "dataset.augment.flip=true"), "run")


def test_a_run_saved_under_the_former_target_paths_trains_and_resumes(tmp_path):
    """Configs from before the loss scalers and schedules moved into packages name them by their
    former paths: a run started with them trains what they name, and a checkpoint whose saved
    config names them resumes under today's config."""
    args = [*ARGS, "dataset.train_size=256", "loss_scaling=dynamic", "scheduler=step"]
    cfg = make_cfg(*args, "trainer.epochs=1")
    cfg.loss_scaling._target_ = "mpexp.scaling.DynamicLossScaler"
    cfg.scheduler._target_ = "mpexp.schedules.step_decay"
    train(cfg, RunContext(tmp_path))
    (saved,) = checkpoint_files(tmp_path)
    state = torch.load(saved, weights_only=True)
    # the run ran, and kept, what the former paths name today
    assert (
        state["config"]["loss_scaling"]["_target_"] == "mpexp.precision.scaling.DynamicLossScaler"
    )
    state["config"]["loss_scaling"]["_target_"] = "mpexp.scaling.DynamicLossScaler"
    state["config"]["scheduler"]["_target_"] = "mpexp.schedules.step_decay"
    files.write_atomically(state, saved)  # as a run from before the move saved it

    train(make_cfg(*args, f"trainer.resume={tmp_path}"), RunContext(tmp_path))
    assert status(tmp_path) == "finished"
    assert [p.name for p in checkpoint_files(tmp_path)] == ["step-00000008.pt"]
