"""Loading torchvision's classic datasets with an error a user can act on when files are missing or
damaged."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mpexp.errors import DataError


def open_torchvision(cls, root: str, download: bool, expected: str, check: Callable[[], None]):
    """(train, test) instances of a torchvision dataset class, or a DataError saying what to do.

    `expected` describes the files torchvision looks for under `root`, for the message; `check`
    inspects the files that are there (see mpexp.data.checks), before torchvision reads them and
    again after a download. A download that fails leaves no empty folders behind.
    """
    root_path = Path(root).expanduser()
    before = _folders(root_path)
    existing = root_path  # the deepest folder on the way to root that exists now
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        check()
        splits = (
            cls(str(root_path), train=True, download=download),
            cls(str(root_path), train=False, download=download),
        )
        check()
        return splits
    except DataError:
        raise
    except (RuntimeError, OSError) as err:
        # torchvision raises RuntimeError for missing files and URLError/OSError (both OSError)
        # when the download cannot reach its mirrors.
        _remove_new_empty_folders(root_path, before, existing)
        how = (
            "could not be downloaded (no network?)"
            if download
            else "is not there and dataset.download=false"
        )
        raise DataError(
            f"{cls.__name__} {how}: {_reason(err)}\n"
            f"Put the files at {root_path.resolve() / expected} (or set dataset.root=<dir> to "
            "where they are), or train offline on generated data with dataset=synthetic."
        ) from None


def _reason(err: Exception) -> str:
    """The error in one line. torchvision's failed download lists every mirror it tried, one
    error per line under "Error downloading <file>:"; the last mirror's error stands for them."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0][:-1]} ({lines[-1]})"
    return lines[0]


def _folders(root: Path) -> set[Path]:
    """`root` and every folder below it that exists now."""
    if not root.is_dir():
        return set()
    return {root, *(p for p in root.rglob("*") if p.is_dir())}


def _remove_new_empty_folders(root: Path, before: set[Path], existing: Path) -> None:
    """Remove the folders that a failed attempt created and left empty: below `root`, and on the
    way up to `existing`, the deepest one that was there before."""
    for folder in sorted(_folders(root) - before, key=lambda p: len(p.parts), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()
    folder = root
    while folder != existing:
        if folder.is_dir():
            if any(folder.iterdir()):
                break
            folder.rmdir()
        folder = folder.parent
