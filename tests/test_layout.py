"""The package's layout reads top-down: the commands (train, sample, cache, report, export) stand
above the run's shell (run/), which imports the plan a run makes of itself (plan/); both stand above
the builder (build.py), the config's checks and resolvers (validate.py, resolvers.py), and the
loop (step/); the loop above the checkpoints, and what both need (the run directory's files, stop
signals, the launch, `_target_` paths) below them all. The data (data/) and fine-tuning
(finetune/) stand below the builder that builds and fine-tunes the model."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mpexp"

# each room, and the rooms above it, which it must not import
# mpexp-plan: plan/__main__.py, in plan/
COMMANDS = {"train", "sample", "cache", "report", "export"}
ABOVE = {
    "run": {"train", "cache", "report"},  # sample.py: run/ draws an LM run's samples with it
    "plan": {"run"} | COMMANDS,
    "build": {"run", "plan"} | COMMANDS,
    "validate": {"run", "plan", "build"} | COMMANDS,
    "resolvers": {"run", "plan", "build"} | COMMANDS,
    "data": {"run", "plan", "build"} | COMMANDS,
    # fine-tuning acts on a built model; the builder, the plan and the commands call it
    "finetune": {"run", "plan", "build", "step", "checkpoints"} | COMMANDS,
    "step": {"run"},
    "checkpoints": {"run", "step"},
    "rundir": {"run", "step", "checkpoints"},
    "stopping": {"run", "step", "checkpoints"},
    "launch": {"run", "step", "checkpoints"},
    "targets": {"run", "step", "checkpoints"},
    "distributed": {"run", "step", "checkpoints"},
}


def imported_rooms(room: str) -> dict[str, str]:
    """The mpexp rooms (subpackages, top-level modules) that `room` imports, each with one file
    that does."""
    files = sorted((PACKAGE / room).rglob("*.py")) if (PACKAGE / room).is_dir() else []
    found = {}
    for path in files or [PACKAGE / f"{room}.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            for module in modules:
                parts = module.split(".")
                if parts[0] == "mpexp" and len(parts) > 1:
                    found.setdefault(parts[1], path.relative_to(PACKAGE).as_posix())
    return found


@pytest.mark.parametrize("room", sorted(ABOVE))
def test_no_room_imports_one_above_it(room):
    climbs = {r: f for r, f in imported_rooms(room).items() if r in ABOVE[room]}
    assert not climbs, f"{room} imports from above it: {climbs}"


def test_no_two_rooms_lean_on_each_other():
    """The rooms' imports form no circle (distributed/ and precision/ once did, over a helper for
    sharded tensors that now stands below both in shards.py)."""
    rooms = sorted(
        p.name.removesuffix(".py")
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" or p.is_dir()) and not p.name.startswith("__")
    )
    graph = {room: set(imported_rooms(room)) - {room} for room in rooms}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as circle:
        pytest.fail(f"rooms that import each other: {' -> '.join(circle.args[1])}")


def test_the_former_modules_are_gone_and_their_paths_still_name_the_same_objects():
    from hydra.utils import get_object

    from mpexp.targets import FORMER_MODULES

    for former, current in FORMER_MODULES.items():
        assert not (PACKAGE / f"{former.removeprefix('mpexp.')}.py").exists()
        assert get_object(former) is get_object(current)


# one idea a room: a file that grows past these holds more than one idea (step/ and data/, the
# rooms contributors change most, are held to less)
MOST_LINES = {"step": 500, "data": 500}
MOST_LINES_ELSEWHERE = 600
MOST_CLASS_LINES = 250


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_room_holds_more_than_one_ideas_worth_of_lines(path):
    room = path.relative_to(PACKAGE).parts[0]
    most = MOST_LINES.get(room, MOST_LINES_ELSEWHERE)
    lines = path.read_text().count("\n")
    assert lines <= most, (
        f"{path.relative_to(PACKAGE)} has {lines} lines (at most {most}): split it by idea"
    )
    big = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MOST_CLASS_LINES
    }
    assert not big, f"classes over {MOST_CLASS_LINES} lines in {path.relative_to(PACKAGE)}: {big}"
