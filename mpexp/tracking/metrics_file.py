"""metrics.jsonl, a row a line, held open by the run that writes it: deleted (or replaced) while the
run trains, it is written again, whole, from the open file."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from mpexp.tracking.histogram import histogram_json

log = logging.getLogger(__name__)

CHECK_FILE_EVERY_S = 1.0  # how often logging rows looks whether metrics.jsonl is still there


class MetricsFile:
    """A run's metrics.jsonl, appended to one row at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # a+: readable too, so that the rows can be copied back if the file is deleted mid-run
        self._file = path.open("a+", buffering=1)
        self._checked_at = time.monotonic()
        self._restorable = True  # until a copy back has failed

    def write(self, row: dict[str, Any]) -> None:
        if time.monotonic() - self._checked_at > CHECK_FILE_EVERY_S:
            self.keep()
        self._file.write(json.dumps(row, default=histogram_json) + "\n")

    def flush(self) -> int:
        """Push the file to disk; return its size in bytes."""
        self.keep()
        self._file.flush()
        os.fsync(self._file.fileno())
        return os.fstat(self._file.fileno()).st_size

    def close(self) -> None:
        self.keep()
        self._file.close()

    def keep(self) -> None:
        """If metrics.jsonl was deleted (or replaced) since it was opened, write it again from
        the open file, which still holds every row, and go on appending there.

        A stat per call: the rows call it once a second at most, checkpoints and the end always.
        """
        self._checked_at = time.monotonic()
        if not self._restorable:
            return
        opened = os.fstat(self._file.fileno())
        try:
            there = os.stat(self.path)
            if (there.st_dev, there.st_ino) == (opened.st_dev, opened.st_ino):
                return
        except FileNotFoundError:
            pass
        try:
            self._file.flush()
            self._file.seek(0)
            tmp = self.path.with_name(self.path.name + ".tmp")
            with tmp.open("w") as copy:
                shutil.copyfileobj(self._file, copy)
            tmp.replace(self.path)
            reopened = self.path.open("a+", buffering=1)
        except OSError as err:  # training goes on; the rows stay in the open (deleted) file
            log.warning("%s is gone and could not be written again (%s).", self.path, err)
            self._restorable = False  # one warning, not one a second
            return
        self._file.close()
        self._file = reopened
        log.warning(
            "%s was deleted or replaced while the run went on; it is written again with every "
            "row the run has logged (%d bytes), and the run keeps appending to it.",
            self.path,
            opened.st_size,
        )
