"""What a sweep's job is called, from the overrides that the sweep varies: its W&B run's name
(`precision=fp16,trainer.seed=1`) and its folder, the job's number first so that folders sort in
job order (`3_precision=fp16,trainer.seed=1`).

The keys a sweep varies are read from the multirun.yaml that Hydra's sweeper writes into the
sweep folder before the first job starts (command-line sweeps and `hydra.sweeper.params`).
"""

from __future__ import annotations

import re
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

# a folder name any file system takes, and Hydra's override grammar reads back as a path only
# once quoted (mpexp.resolvers.quote_run_dirs does that for trainer.resume)
UNSAFE = re.compile(r"[^\w.=,+@-]")
MOST_CHARS = 96  # a job folder's name at most: long sweeps stay readable, well under 255 bytes


def swept_overrides(hydra_cfg: DictConfig) -> list[str]:
    """The job's overrides of the keys that its sweep varies, in command-line order."""
    task = list(hydra_cfg.overrides.task)
    varying = swept_keys(Path(hydra_cfg.sweep.dir) / "multirun.yaml")
    parser = OverridesParser.create()
    return [o for o, parsed in zip(task, parser.parse_overrides(task), strict=True)
            if parsed.key_or_group in varying]  # fmt: skip


def job_name(hydra_cfg: DictConfig) -> str:
    """A sweep job's W&B name: its overrides of the keys that the sweep varies (`precision=fp16`);
    Hydra's override_dirname, or the job's number, where the sweep's record cannot be read."""
    named = swept_overrides(hydra_cfg)
    return ",".join(named) or hydra_cfg.job.override_dirname or f"job {hydra_cfg.job.num}"


def job_folder(num: int, hydra_cfg: DictConfig) -> str:
    """A sweep job's folder: `<num>_<its swept overrides>`, made safe for a file name and cut to
    MOST_CHARS; `<num>` alone where no override varies."""
    named = ",".join(swept_overrides(hydra_cfg))
    if not named:
        return str(num)
    return f"{num}_{UNSAFE.sub('_', named)}"[:MOST_CHARS]


def swept_keys(multirun_yaml: Path) -> set[str]:
    """The keys a sweep varies, from the multirun.yaml Hydra writes into the sweep folder: those
    given several values on the command line, and a preset's `hydra.sweeper.params`, where the
    command line did not fix them."""
    try:
        saved = OmegaConf.load(multirun_yaml)
    except (OSError, ValueError):
        return set()
    overrides = [str(o) for o in OmegaConf.select(saved, "hydra.overrides.task", default=[])]
    parsed = OverridesParser.create().parse_overrides(overrides)
    swept = {o.key_or_group for o in parsed if o.is_sweep_override()}
    fixed = {o.key_or_group for o in parsed if not o.is_sweep_override()}
    # a preset's sweep (`hydra.sweeper.params`), less the keys the command line gave one value
    params = OmegaConf.select(saved, "hydra.sweeper.params", default=None) or {}
    return swept | (set(params) - fixed)
