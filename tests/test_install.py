"""mpexp as a user installs it: a wheel built from the repository, installed apart from it, trains
and reports from another folder; the console scripts complete in bash; users add config groups
through Hydra's searchpath."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

IGNORE = shutil.ignore_patterns("__pycache__", "*.egg-info")
SMALL = [
    "experiment=quickstart",
    "trainer.epochs=1",
    "dataset.train_size=128",
    "dataset.val_size=32",
    "trainer.progress=false",
]


def run(cmd: list[str], cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """The wheel installed into a folder of its own; the environment that uses it."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"  # what a source distribution holds; the build leaves its files here
    source.mkdir()
    for part in ("pyproject.toml", "README.md", "conf", "mpexp"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(ROOT / part, source / part, **({"ignore": IGNORE} if copy is shutil.copytree else {}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    run([*build, "-w", str(tmp / "dist"), str(source)], cwd=tmp, env=env)
    (wheel,) = (tmp / "dist").glob("mpexp-*.whl")
    target = tmp / "site"
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
        cwd=tmp, env=env)  # fmt: skip
    env = {
        **env,
        "PYTHONPATH": str(target),
        "PATH": f"{target / 'bin'}{os.pathsep}{env['PATH']}",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
    }
    return target, env


@pytest.mark.slow  # a wheel built and installed (once for the module): about 17 s on 2 cores
def test_the_wheel_ships_the_configs_and_runs_from_any_folder(installed, tmp_path):
    target, env = installed
    where = run(
        [sys.executable, "-c", "import mpexp.config as c; print(c.config_dir())"], tmp_path, env
    )
    assert Path(where.stdout.strip()) == target / "mpexp" / "conf"  # not the repository's conf/
    assert (target / "mpexp" / "conf" / "precision" / "fp16.yaml").is_file()

    # (`python -m mpexp.train` from the wheel: test_messages_name_the_command_the_user_ran)
    run(["mpexp-train", *SMALL, "precision=bf16"], tmp_path, env)
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"

    reported = run(["mpexp-report", str(run_dir), "--out", str(tmp_path / "cmp")], tmp_path, env)
    assert "runs reported: 1" in reported.stdout
    assert (tmp_path / "cmp" / "report.md").is_file()


@pytest.mark.slow
def test_the_wheel_holds_every_package_of_the_repository(installed):
    """A package missing from pyproject.toml's list is missing from the wheel; an editable
    install beside it would hide that from the other tests."""
    target, _ = installed
    packages = {p.parent.relative_to(ROOT) for p in (ROOT / "mpexp").rglob("__init__.py")}
    missing = [str(p) for p in packages if not (target / p / "__init__.py").is_file()]
    assert missing == []


@pytest.mark.slow
def test_the_wheel_offers_the_extras_the_readme_names(installed):
    target, _ = installed
    (metadata,) = target.glob("mpexp-*.dist-info/METADATA")
    text = metadata.read_text()
    for extra in ("fp8", "slurm", "optuna", "joblib", "wandb-view", "bpe", "timm", "dev"):
        assert f"Provides-Extra: {extra}" in text
    assert 'Requires-Dist: hydra-joblib-launcher>=1.2; extra == "joblib"' in text
    (view,) = [line for line in text.splitlines() if line.endswith('extra == "wandb-view"')]
    assert view.startswith("Requires-Dist: wandb-workspaces")


@pytest.mark.slow
def test_messages_name_the_command_the_user_ran(installed, tmp_path):
    _, env = installed
    commands = {"mpexp-train": ["mpexp-train"],
                "python -m mpexp.train": [sys.executable, "-m", "mpexp.train"]}  # fmt: skip
    for named, command in commands.items():
        result = subprocess.run([*command, "+trainer.epoch=3"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=300)  # fmt: skip
        assert result.returncode != 0
        assert f"`{named} --cfg job` lists every key." in result.stderr, result.stderr


@pytest.mark.slow
def test_bash_completion_of_the_console_script(installed, tmp_path):
    _, env = installed
    script = run(["mpexp-train", "-sc", "install=bash"], tmp_path, env).stdout
    probe = 'COMP_LINE="mpexp-train precision=f"; COMP_POINT=${#COMP_LINE}; COMP_CWORD=1; '
    probe += 'hydra_bash_completion; echo "${COMPREPLY[@]}"'
    completed = run(["bash", "-c", f"{script}\n{probe}"], tmp_path, env).stdout.split()
    assert completed == ["precision=fp16", "precision=fp32", "precision=fp8"]


def test_a_users_own_config_group_option_through_the_searchpath(tmp_path, in_process, monkeypatch):
    (tmp_path / "my_mlps.py").write_text(
        "from torch import nn\n\n"
        "def tiny_mlp(in_channels, num_classes, image_size, hidden=32):\n"
        "    h, w = image_size\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * h * w, hidden),\n"
        "                         nn.ReLU(), nn.Linear(hidden, num_classes))\n"
    )
    option = tmp_path / "my_conf" / "model" / "tiny_mlp.yaml"
    option.parent.mkdir(parents=True)
    option.write_text("_target_: my_mlps.tiny_mlp\nhidden: 16\n")

    monkeypatch.syspath_prepend(tmp_path)
    result = in_process(*SMALL, f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]",
                        "model=tiny_mlp", "wandb.mode=disabled", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ran"]["choices"]["model"] == "tiny_mlp"
    assert summary["ran"]["parameters"] == 28 * 28 * 16 + 16 + 16 * 10 + 10
