"""A sweep job's overrides as the report reads them: the key one sets, those that make no
configuration of their own, and those a configuration's fp32 reference may differ in."""

from __future__ import annotations

SEED = "trainer.seed"
# overrides that do not make another configuration: seeds are its repeats, a resumed run is itself,
# and where W&B keeps a run changes nothing it trains (seeds added later join the sweep's group)
NOT_CONFIG = (SEED, "trainer.resume", "wandb")
# overrides that a configuration's fp32 reference may differ in
PRECISION_KEYS = ("precision", "loss_scaling")


def override_key(override: str) -> str:
    """The config key an override sets: `+trainer.seed=3` -> `trainer.seed`."""
    return override.split("=", 1)[0].lstrip("+~")


def in_groups(override: str, groups: tuple[str, ...]) -> bool:
    key = override_key(override)
    return any(key == g or key.startswith(g + ".") for g in groups)
