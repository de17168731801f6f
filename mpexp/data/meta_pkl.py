"""nanoGPT's `meta.pkl`: the vocabulary its character-level prepare.py scripts write beside
train.bin and val.bin (a dict of `vocab_size`, and `itos` / `stoi` between ids and characters).

A pickle can name any function and have the unpickler call it, so a file from elsewhere could run
code as it loads. This one is read by an unpickler that resolves no global at all: the plain
containers, numbers and strings a vocabulary is made of load, and a pickle that names a class or a
function is refused before anything in it is called.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from pathlib import Path

from mpexp.errors import DataError

NAME = "meta.pkl"
MOST_IDS = 1 << 32  # token files hold uint16 or uint32 ids


class _NoGlobals(pickle.Unpickler):
    """Loads plain data only: every class or function a pickle names is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}")


@dataclass(frozen=True)
class Meta:
    """A meta.pkl's vocabulary: its size, and the characters of its ids where it has them."""

    path: Path
    vocab_size: int
    itos: dict[int, str] | None  # id -> character
    stoi: dict[str, int] | None  # character -> id


def read_meta(path: Path) -> Meta:
    """The vocabulary in nanoGPT's meta.pkl at `path`, or one message saying why it is refused."""
    try:
        meta = _NoGlobals(io.BytesIO(path.read_bytes())).load()
    except OSError as err:
        raise DataError(f"{path} cannot be read ({err.strerror or err}).") from None
    except pickle.UnpicklingError as err:
        raise DataError(
            f"{path} was not loaded: {err}, and mpexp loads only plain data from a meta.pkl "
            "(nanoGPT's holds a dict of vocab_size, itos and stoi), so that no pickle runs code "
            "here. Write the vocabulary as plain data, or remove the file and give "
            "dataset.vocab_size."
        ) from None
    except Exception as err:  # a truncated or corrupt pickle raises almost any error
        raise DataError(f"{path} is no readable pickle ({type(err).__name__}: {err}).") from None
    size = meta.get("vocab_size") if isinstance(meta, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise DataError(
            f"{path} holds no vocab_size (a positive whole number) in a dict, as nanoGPT's "
            "prepare.py writes it. Fix the file, or remove it and give dataset.vocab_size."
        )
    if size > MOST_IDS:
        raise DataError(
            f"{path} gives vocab_size {size:,}, more ids than a token file can hold (uint32 "
            f"ids: {MOST_IDS:,} at most). Fix the file, or remove it and give "
            "dataset.vocab_size."
        )
    itos, stoi = meta.get("itos"), meta.get("stoi")
    itos_ok = isinstance(itos, dict) and all(
        isinstance(i, int) and isinstance(s, str) for i, s in itos.items()
    )
    stoi_ok = isinstance(stoi, dict) and all(
        isinstance(s, str) and isinstance(i, int) for s, i in stoi.items()
    )
    return Meta(path, size, itos if itos_ok else None, stoi if stoi_ok else None)
