"""The SHA-256 both kinds of checkpoint are checked by: a whole checkpoint's `.sha256` file and a
sharded one's SHA256SUMS hold it in `sha256sum` format."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
