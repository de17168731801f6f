"""A model's names in short: numbered parts (`blocks.0`, `layers.31`) folded into `*`, so that a
message can list a model's layers in a line rather than in hundreds."""

from __future__ import annotations

import re
from collections.abc import Iterable

NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")  # a numbered part inside a name: blocks.0
SHOWN = 24  # names a message lists before it counts the rest


def outline(names: Iterable[str]) -> list[str]:
    """`names` with each numbered part as `*`, each outline once, in the model's order:
    `blocks.0.attn.qkv` and `blocks.1.attn.qkv` are `blocks.*.attn.qkv`, itself a pattern
    that `model.freeze` takes."""
    return list(dict.fromkeys(NUMBER.sub("*", name) for name in names))


def listed(names: Iterable[str]) -> str:
    """The outline of `names` as one line, the first SHOWN of them and a count of the rest."""
    shown = outline(names)
    more = f" (and {len(shown) - SHOWN} more)" if len(shown) > SHOWN else ""
    return ", ".join(shown[:SHOWN]) + more
