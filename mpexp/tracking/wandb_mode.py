"""Which W&B a run logs to: online where a key is configured, else offline (wandb.mode=auto); the
ids of new W&B runs, and the group a sweep's runs share."""

from __future__ import annotations

import netrc
import os
import secrets
import string
from pathlib import Path
from urllib.parse import urlparse


def has_wandb_key() -> bool:
    """True when W&B could log online: an API key in the environment or in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_wandb_mode(mode: str) -> str:
    """auto: online when a key is configured, else offline (WANDB_MODE in the environment wins)."""
    if mode != "auto":
        return mode
    return os.environ.get("WANDB_MODE") or ("online" if has_wandb_key() else "offline")


def new_wandb_id() -> str:
    """A fresh W&B run id: 8 characters of [a-z0-9], as W&B makes them."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def sweep_group(sweep_dir: Path) -> str:
    """The W&B group of a sweep's runs when `wandb.group` is not set: named after its folder,
    `sweep-<date>_<time>` for outputs/multirun/<date>/<time>."""
    return "sweep-" + "_".join(Path(sweep_dir).parts[-2:])
