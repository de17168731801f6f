"""Files and folders that appear whole or not at all, for the data caches (tokens, encoded
corpora, resized images) and pure bf16's kernel builds, and what a killed writer left behind
removed by the next one.

A writer writes under a temporary name beside the final one (`<name>.<pid>-<random>.partial`),
holding an flock on it all the while; when done it fsyncs the data, renames the partial to the
final name (one atomic step, for a folder too) and fsyncs the folder that holds it, so that a
crash of the machine cannot leave a final name over data that never reached the disk. A writer
that fails removes its partial. One that is killed (SIGKILL, a node lost) cannot, but the kernel
drops its lock as it dies: the next writer of the same name finds partials whose lock it can take
and removes them, and never one whose writer is still at work.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import secrets
import shutil
import socket
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

SUFFIX = ".partial"


@contextlib.contextmanager
def whole_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file to write `path` through: on leaving the block it becomes `path` (synced),
    or, where the block raises, it is removed."""
    partial, fd = _claim(path, folder=False)
    try:
        with os.fdopen(os.dup(fd), "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, path)
    except BaseException:
        _remove(partial)
        raise
    finally:
        os.close(fd)  # the lock goes with the last descriptor
    sync_folder(path.parent)


def write_whole(path: Path, data: bytes) -> None:
    """`path` holding `data`, written through `whole_file`."""
    with whole_file(path) as out:
        out.write(data)


@contextlib.contextmanager
def whole_folder(path: Path) -> Iterator[Path]:
    """An empty folder to fill (and sync, see `sync_file`) in place of `path`: on leaving the
    block it is renamed to `path`, or, where the block raises, removed. `path` must not exist:
    a folder in place is never replaced under its readers (FileExistsError)."""
    partial, fd = _claim(path, folder=True)
    try:
        yield partial
        os.fsync(fd)
        if path.exists():  # rename(2) would silently replace an empty folder
            raise FileExistsError(f"{path} appeared while it was written")
        os.rename(partial, path)
    except BaseException:
        _remove(partial)
        raise
    finally:
        os.close(fd)
    sync_folder(path.parent)


def sync_file(path: Path) -> None:
    """Push a written file's data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_folder(folder: Path) -> None:
    """Make a rename in `folder` last: where a file system cannot sync a folder, it keeps its
    own order, and nothing is lost by skipping it."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove_abandoned(path: Path) -> list[Path]:
    """Remove the partials of `path` whose writers are gone (their lock is free); the ones
    removed. A partial being written (its lock held) is left alone."""
    removed = []
    for name in glob.glob(glob.escape(str(path)) + ".*" + SUFFIX):
        try:
            fd = os.open(name, os.O_RDONLY)
        except OSError:  # gone already: its writer finished, or another cleaner was first
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its writer is at work
            with contextlib.suppress(OSError):
                # the name still leads to the file locked: no writer renamed it meanwhile
                if os.stat(name).st_ino == os.fstat(fd).st_ino:
                    _remove(Path(name))
                    removed.append(Path(name))
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def exclusive(lock: Path, waiting: str, note: str) -> Iterator[None]:
    """The block run by one process at a time among those that take `lock` (an flock on that
    file, which the kernel drops if the holder dies); `waiting` is logged once by a process that
    has to wait, with the note of the process it waits for.

    Taking the lock and adding `note` to the file (time, host, pid, rank: what the holder does)
    is one step to the others, so that a waiting process never reads the note of an earlier
    holder, or none: both happen under a second lock (`<lock>.guard`), held for as long as
    they take, under which a waiting process reads the note too."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    guard = lock.with_name(lock.name + ".guard")
    said = False
    try:
        while True:
            with _held(guard):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = lock.read_text(errors="replace").strip().splitlines()
                else:
                    _note_holder(lock, note)
                    break
            if not said:
                log.info("%s (%s).", waiting, holder[-1] if holder else "holder unknown")
                said = True
            # until the holder is done; then the lock is taken again under the guard, its
            # note with it
            fcntl.flock(fd, fcntl.LOCK_EX)
            fcntl.flock(fd, fcntl.LOCK_UN)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _held(path: Path) -> Iterator[None]:
    """An flock on `path` for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _note_holder(lock: Path, what: str) -> None:
    """Add a line saying who holds `lock` for what (time, host, pid, rank): a process waiting
    on it names it, and the file lists every holder of its store."""
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    rank = f" rank {os.environ['RANK']}" if "RANK" in os.environ else ""  # under torchrun
    with lock.open("a") as out:
        out.write(f"{stamp} {socket.gethostname()} pid {os.getpid()}{rank}: {what}\n")


def _claim(path: Path, folder: bool) -> tuple[Path, int]:
    """A new partial of `path`, locked, and its descriptor; the abandoned ones removed first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for gone in remove_abandoned(path):
        log.warning("Removed %s, left by a writer that was stopped before it finished.", gone)
    while True:
        partial = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}")
        if folder:
            partial.mkdir()
            fd = os.open(partial, os.O_RDONLY)
        else:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        # a cleaner may have taken the new partial for an abandoned one between its creation
        # and the lock: it is gone then, and another is made
        with contextlib.suppress(OSError):
            if os.stat(partial).st_ino == os.fstat(fd).st_ino:
                return partial, fd
        os.close(fd)


def _remove(partial: Path) -> None:
    with contextlib.suppress(OSError):
        if partial.is_dir() and not partial.is_symlink():
            shutil.rmtree(partial)
        else:
            partial.unlink()
