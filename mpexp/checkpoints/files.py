"""A checkpoint on disk: its format, written atomically with its SHA-256 beside it, found, loaded
and verified, and removed. A whole checkpoint is one file from the main rank; a sharded one
(FSDP) is a folder from every rank (mpexp/checkpoints/sharded.py)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from mpexp.checkpoints import sharded
from mpexp.checkpoints.checksums import sha256_of
from mpexp.errors import ResumeRefused
from mpexp.rundir import SUBDIR, checkpoint_files, put_back_replaced, run_dir_of

log = logging.getLogger(__name__)

FORMAT = 1

# what every checkpoint holds (Checkpointer.save), and what a single-file one adds to it
STATE_KEYS = ("position", "scaler", "schedule", "log", "metrics_bytes", "wandb_id", "config",
              "overrides")  # fmt: skip
FILE_KEYS = ("model", "optimizer", "rng")
POSITION = ("epoch", "batch", "step")


def checksum_file(checkpoint: Path) -> Path:
    """Where a checkpoint's SHA-256 is kept, in `sha256sum` format (`sha256sum -c` checks it).
    A kill while a checkpoint of the same name was replaced can leave it listing two sums, one of
    them the file's (write_atomically): `sha256sum -c` then calls the other one failed."""
    return checkpoint.with_name(checkpoint.name + ".sha256")


def write_atomically(state: dict, path: Path) -> None:
    """Write a temporary file, fsync it, rename it: `path` holds the old file or all of the new.

    Its SHA-256 is written beside it first, so that a resume can tell a damaged file. A checkpoint
    that replaces one of the same name (an epoch's end at a step that already has one) is
    renamed in while the checksum file lists both files' sums: whichever one a kill leaves in
    place is verified, not called corrupt. Whatever stops the write (a full disk, which
    torch.save reports as a RuntimeError; a second Ctrl-C), the partial files are removed.
    """
    tmp = path.with_name(path.name + ".tmp")
    sums, sums_tmp = checksum_file(path), checksum_file(tmp)
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        line = f"{sha256_of(tmp)}  {path.name}\n"
        # the old file's sum as written, or as it is where its checksum file is missing or bad
        old = (written_sums(sums) or [sha256_of(path)]) if path.is_file() else []
        replaced = "".join(f"{digest}  {path.name}\n" for digest in old)
        _write_synced(sums_tmp, replaced + line)
        os.replace(sums_tmp, sums)
        os.replace(tmp, path)
        if replaced:  # the old file is gone: its sum goes too, where the disk allows
            with contextlib.suppress(OSError):  # the two-sum file verifies the new file as well
                _write_synced(sums_tmp, line)
                os.replace(sums_tmp, sums)
    except BaseException:
        for partial in (tmp, sums_tmp):  # a partial file only takes space from a full disk
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
        raise
    # make the rename itself durable; some platforms cannot open a directory, which is harmless
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:  # on disk before the rename, or a crash leaves it empty
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def written_sums(sums: Path) -> list[str]:
    """The SHA-256 sums a checkpoint's checksum file holds (two while a checkpoint of the same
    name is being replaced); none where it is missing, empty or damaged."""
    try:
        lines = sums.read_text(errors="replace").splitlines()
    except OSError:
        return []
    found = (line.split()[:1] for line in lines)
    return [f[0] for f in found if f and re.fullmatch(r"[0-9a-f]{64}", f[0])]


def remove_checkpoint(path: Path) -> None:
    """A checkpoint with its checksum, or a leftover of one (mpexp.rundir.leftover_files)."""
    if path.is_dir():
        shutil.rmtree(path)
        return
    path.unlink()
    if path.suffix != ".sha256":
        checksum_file(path).unlink(missing_ok=True)


def find_checkpoint(target: str | Path) -> Path:
    """The checkpoint `trainer.resume` names: that file, or the newest one in a run directory."""
    path = Path(str(target))
    if path.is_file() or (path.is_dir() and (path / sharded.COMMON).is_file()):
        return path
    if path.is_dir():
        put_back_replaced(path)
    found = checkpoint_files(path) if path.is_dir() else []
    if not found:
        where = (
            f"no checkpoint in {path / SUBDIR}" if path.is_dir() else "no such file or directory"
        )
        raise ResumeRefused(
            f"trainer.resume={target}: {where}.\nGive a run directory (the one holding "
            f"metrics.jsonl) or a checkpoint file in its {SUBDIR}/ folder."
        )
    return found[-1]


def load(path: Path, mmap: bool = False) -> dict:
    """A checkpoint's state on the CPU, its checksum verified and its parts all there; a damaged
    or incomplete one is refused."""
    verify(path)
    try:
        if path.is_dir():
            state = sharded.load_common(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:
        raise ResumeRefused(
            f"trainer.resume: {path} cannot be read as a checkpoint ({err}).\n{elsewhere(path)}"
        ) from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ResumeRefused(f"trainer.resume: {path} is not an mpexp checkpoint (format {FORMAT}).")
    parts = STATE_KEYS if state.get("sharded") else (*STATE_KEYS, *FILE_KEYS)
    missing = [key for key in parts if key not in state]
    position = state.get("position")
    if not missing and not (isinstance(position, dict) and position.keys() == {*POSITION}):
        missing = [f"a whole position ({', '.join(POSITION)})"]
    if missing:
        what = ", ".join(missing)
        raise ResumeRefused(
            f"trainer.resume: {path} is not a complete mpexp checkpoint: it lacks {what}.\n"
            f"{elsewhere(path)}"
        )
    return state


def verify(path: Path) -> None:
    """Compare a checkpoint with the SHA-256 written beside it; a checkpoint without one (written
    by an older mpexp) is taken as it is. A sharded checkpoint's folder lists every file's."""
    if path.is_dir():
        bad = sharded.corrupt_files(path)
        if bad:
            raise ResumeRefused(
                f"trainer.resume: {path} is corrupt: {', '.join(bad)} no longer match the "
                f"checksums written with them ({sharded.SUMS}).\n{elsewhere(path)}"
            )
        return
    sums = checksum_file(path)
    if not sums.is_file():
        log.warning("%s has no checksum beside it (%s): it is not verified.", path, sums.name)
        return
    expected = written_sums(sums)
    if not expected:
        # e.g. empty after a power loss: the checkpoint is loaded and checked as one without
        log.warning(
            "%s holds no SHA-256 (it is empty or damaged): %s is not verified.", sums.name, path
        )
        return
    if sha256_of(path) not in expected:
        raise ResumeRefused(
            f"trainer.resume: {path} is corrupt: its SHA-256 does not match the one written with "
            f"it ({sums.name}), so the file changed after it was saved.\n{elsewhere(path)}"
        )


def elsewhere(path: Path) -> str:
    """Where else a resume could start from: only a checkpoint that exists is suggested."""
    others = [p for p in checkpoint_files(run_dir_of(path)) if p != path]
    if others:
        return f"Resume from an earlier checkpoint instead: trainer.resume={others[-1]}"
    return (
        "The run keeps no other checkpoint (trainer.keep_checkpoints), so it has to start again; "
        "a higher trainer.keep_checkpoints keeps a spare."
    )
