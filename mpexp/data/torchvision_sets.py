"""Loading torchvision's classic datasets with an error a user can act on when files are missing."""

from __future__ import annotations

from pathlib import Path

from mpexp.errors import DataError


def open_torchvision(cls, root: str, download: bool, expected: str):
    """(train, test) instances of a torchvision dataset class, or a DataError saying what to do.

    `expected` describes the files torchvision looks for under `root`, for the message.
    """
    root_path = Path(root).expanduser()
    try:
        return cls(str(root_path), train=True, download=download), cls(
            str(root_path), train=False, download=download
        )
    except (RuntimeError, OSError) as err:
        # torchvision raises RuntimeError for missing or corrupt files and URLError/OSError
        # (both OSError) when the download cannot reach its mirrors.
        how = (
            "could not be downloaded (no network?)"
            if download
            else "is not there and dataset.download=false"
        )
        raise DataError(
            f"{cls.__name__} {how}: {str(err).strip().splitlines()[0]}\n"
            f"Put the files at {root_path.resolve() / expected} (or set dataset.root=<dir> to "
            "where they are), or train offline on generated data with dataset=synthetic."
        ) from None
