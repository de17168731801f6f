"""What mpexp's own commands other than mpexp-train (mpexp-plan, mpexp-cache) print of mpexp's
log: its messages, INFO and up, on stderr while the command runs, and nothing changed after it.
A command may run inside another program (a test, a notebook), whose logging it must leave as it
found it; `logging.basicConfig` would give the root logger a handler and a level for good."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def messages_on_stderr() -> Iterator[None]:
    logger = logging.getLogger("mpexp")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
