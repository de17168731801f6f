"""Tiny Shakespeare: about 1.1 MB of Shakespeare's plays in one text file, a classic small corpus
for character- and byte-level language models; downloaded once into the data root."""

from __future__ import annotations

import logging
import os
import urllib.error
import urllib.request
from pathlib import Path

from mpexp.data.text import Source, TextData, path_source
from mpexp.errors import DataError

log = logging.getLogger(__name__)

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
FILE = Path("tiny_shakespeare") / "input.txt"  # below dataset.root
TIMEOUT_S = 60


class TinyShakespeare(TextData):
    """The corpus at `<root>/tiny_shakespeare/input.txt`, fetched there first when missing."""

    def __init__(self, root: str = "data", download: bool = True, **windows):
        super().__init__(path=None, **windows)
        self.root = root
        self.download = download

    def corpus(self) -> Source:
        path = Path(self.root).expanduser() / FILE
        if not path.is_file():
            if not self.download:
                raise DataError(
                    f"Tiny Shakespeare is not at {path} and dataset.download=false. Put the file "
                    f"there (from {URL}), or set dataset.root=<dir> to where it is."
                )
            fetch(URL, path)
        return path_source(str(path))


def fetch(url: str, path: Path) -> None:
    """Download `url` to `path`, whole or not at all (a partial download is removed)."""
    log.info("Downloading %s to %s", url, path)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            partial.write_bytes(response.read())
        os.replace(partial, path)
    except (urllib.error.URLError, OSError) as err:
        partial.unlink(missing_ok=True)
        reason = getattr(err, "reason", None) or err
        raise DataError(
            f"Tiny Shakespeare could not be downloaded (no network?): {reason}.\n"
            f"Put the file at {path.resolve()} (from {url}), or train on text of your own with "
            "dataset=text dataset.path=<file or folder>."
        ) from None
