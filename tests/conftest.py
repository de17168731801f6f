from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from mpexp import config
from mpexp.precision import tf32
from mpexp.precision.modes import Precision, setup_precision
from mpexp.resolvers import register_resolvers

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
CPU = torch.device("cpu")
config.register()
register_resolvers()  # what conf/ resolves (a preset's derived values), as the commands have it

# One intra-op thread, here and in the commands the tests start: the tests' models are tiny, and
# a second thread only adds its hand-offs. On a shared two-core machine a simplecnn step took
# 0.08 s with one thread and 0.36 s (at best) with two, the threads spinning while they wait.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"

# A run small enough for a test on 2 CPU cores: ~1 s an epoch.
TINY = [
    "dataset=synthetic",
    "dataset.train_size=1024",
    "dataset.noise=0.6",
    "dataset.val_size=128",
    "dataset.batch_size=64",
    "model=simplecnn",
    "model.width=8",
    "optimizer.lr=3e-3",
    "trainer.epochs=2",
    "trainer.log_every=4",
    "trainer.progress=false",
    "wandb.mode=disabled",
]


# A ViT small enough for a test: 2 blocks of width 64 on 16 patches of 7x7, on data it learns in
# two epochs. fp8 converts its 8 Linear layers (sizes multiples of 16), not its 10-class head.
TINY_VIT = [
    *(o for o in TINY if not o.startswith("model")),
    "model=vit",
    "model.patch_size=7",
    "model.width=64",
    "model.depth=2",
    "model.heads=2",
    "dataset.noise=0.3",
    "optimizer.lr=1e-3",
]
VIT_FP8_LAYERS = [
    f"encoder.layers.encoder_layer_{block}.{layer}"
    for block in (0, 1)
    for layer in ("self_attention.qkv", "self_attention.proj", "mlp.0", "mlp.3")
]


def make_cfg(*overrides: str):
    """The composed `train` config, as `python -m mpexp.train <overrides>` would see it: a copy
    of its own, so that a test may change it."""
    return copy.deepcopy(_composed(overrides))


@functools.cache
def _composed(overrides: tuple[str, ...]):
    # Hydra takes about a second (on two shared cores) to compose; the same overrides compose
    # to the same config, and a copy takes a hundredth of that
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def _read_each_config_file_once() -> None:
    """Hydra reads and parses every YAML file of a config again for each composition: a quarter
    of its time in the suite's few hundred compositions. The files do not change while the
    tests run (a test's own config folders are new paths), so each is read once here and Hydra
    gets a copy of it, which it is free to change as it composes."""
    from hydra._internal.config_repository import ConfigRepository

    read = ConfigRepository.load_config
    results = {}

    def load_config(self, config_path):
        key = (tuple(source.full_path() for source in self.get_sources()), config_path)
        if key not in results:
            results[key] = read(self, config_path)
        return copy.deepcopy(results[key])

    ConfigRepository.load_config = load_config


_read_each_config_file_once()


def precision_of(mode: str, device: torch.device = CPU) -> Precision:
    """`precision=<mode>` set up on `device`, from its YAML as a run would."""
    return setup_precision(make_cfg(f"precision={mode}").precision, device)


def scaling_cfg(option: str, **values):
    """The composed `loss_scaling=<option>` config with `values` overridden."""
    return make_cfg(
        f"loss_scaling={option}", *(f"loss_scaling.{k}={v}" for k, v in values.items())
    ).loss_scaling


def run_cli(
    *args: str,
    cwd: Path,
    timeout: float = 300,
    pythonpath: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`python -m <args>` in a subprocess, from `cwd`, offline; `pythonpath` is importable too,
    and `env` is added to the environment."""
    path = os.pathsep.join(str(p) for p in (ROOT, pythonpath) if p)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": path,
           **(env or {})}  # fmt: skip
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def command_in_process(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`mpexp-train <args>` from `cwd`, run in this process through the command's own entry
    point, as `run_cli` runs it in a process of its own: for what the command says and where it
    stops, where the process boundary itself is not what a test checks. The same
    CompletedProcess, its stdout and stderr as the command wrote them. A test's own modules
    (`monkeypatch.syspath_prepend`) stay imported in this process: each takes a name of its own."""
    from hydra.core.global_hydra import GlobalHydra

    import mpexp.train

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("HYDRA_FULL_ERROR", raising=False)
        patch.setattr(logging, "raiseExceptions", logging.raiseExceptions)  # the command sets it
        patch.chdir(cwd)
        patch.setattr(sys, "argv", ["mpexp-train", *args])
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                mpexp.train.cli()
            status = 0
        except SystemExit as exited:
            status = exited.code if isinstance(exited.code, int) else int(exited.code is not None)
        finally:
            GlobalHydra.instance().clear()  # as the command's process would, ending
            # a run that started has Hydra's handlers on the root logger (train.log, the console)
            for handler in set(root.handlers) - set(handlers):
                root.removeHandler(handler)
                handler.close()
            root.setLevel(level)
    return subprocess.CompletedProcess(["mpexp-train", *args], status, out.getvalue(),
                                       err.getvalue())  # fmt: skip


def job_dir(sweep: Path, job: int) -> Path:
    """A sweep job's folder: its number, then the overrides the sweep varies."""
    (found,) = [p for p in sweep.iterdir() if p.is_dir() and p.name.split("_")[0] == str(job)]
    return found


def one_line_failure(result: subprocess.CompletedProcess) -> str:
    """The output of a command that failed as a mistake should: a non-zero exit, no traceback,
    nothing trained."""
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output and "Epoch:" not in output
    return output


@pytest.fixture
def in_process():
    """command_in_process, for a test."""
    return command_in_process


# The files whose tests stop, kill or time processes (signals, SIGKILL, W&B's process, pre-emption):
# under `pytest -n 2` they run one after another in one process, never beside each other
ONE_AT_A_TIME = {"test_faults", "test_preemption", "test_resume", "test_wandb"}
# The groups that take longest (about 170 s, then 35 to 60 s each, on two cores) start first,
# each as a worker comes free, so that the many short files even out the two workers' ends
LONGEST_FIRST = ["processes", "test_plan", "test_report", "test_config", "test_distributed"]


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # a worker of `pytest -n 2`
        _group_for_xdist(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _group_for_xdist(items) -> None:
    """Each file's tests in one worker (its module-scoped runs are made once), the files of
    ONE_AT_A_TIME in one worker together; the groups of LONGEST_FIRST first, in its order."""
    group = {}
    for item in items:
        module = item.path.stem
        group[item] = "processes" if module in ONE_AT_A_TIME else module
        item.add_marker(pytest.mark.xdist_group(group[item]))

    def rank(item) -> int:
        name = group[item]
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest in file order


@pytest.fixture(autouse=True)
def _restore_precision_flags():
    """Precision modes flip process-wide TF32 switches; give every test the defaults back."""
    saved = tf32.switches()
    yield
    tf32.put_back(saved)
