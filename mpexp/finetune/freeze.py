"""`model.freeze`: parameters trained no more, chosen by name.

A pattern is matched against the names of `named_parameters()` with fnmatch's rules, case
sensitive: `*` matches any run of characters, dots included, `?` one character, `[...]` one of a
set. A pattern that names a module takes every parameter inside it: `wte` freezes `wte.weight`,
`blocks.0` the whole first block, `blocks.*.attn` every attention layer. A pattern that matches
no parameter is refused with the model's layers listed: a misspelt name must not leave the
weights it meant training."""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from mpexp.errors import ConfigError
from mpexp.finetune.names import listed


def matches(name: str, pattern: str) -> bool:
    """Whether parameter `name` is `pattern`'s, itself or inside the module it names."""
    return fnmatchcase(name, pattern) or fnmatchcase(name, f"{pattern}.*")


def freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """Set requires_grad=False on the parameters `patterns` match; their names. Every pattern
    must match at least one parameter."""
    names = [name for name, _ in model.named_parameters()]
    unmatched = [p for p in patterns if not any(matches(name, p) for name in names)]
    if unmatched:
        holders = [name for name, module in model.named_modules() if module._parameters]
        raise ConfigError(
            f"model.freeze: {', '.join(map(repr, unmatched))} matches no parameter of "
            f"{type(model).__name__}. Its layers: {listed(holders)}. A pattern is a parameter's "
            "or a module's name, with * for any characters (blocks.*.attn)."
        )
    frozen = []
    for name, parameter in model.named_parameters():
        if any(matches(name, p) for p in patterns):
            parameter.requires_grad_(False)
            frozen.append(name)
    return frozen
