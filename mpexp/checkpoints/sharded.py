"""Checkpoints of FSDP runs, whose ranks each hold a shard of the weights and optimizer state.

A checkpoint is a folder, `checkpoints/step-<N>/`:
- the model and optimizer, written by every rank's shard through torch.distributed.checkpoint
  (DCP: `.metadata` and one `.distcp` file per rank), so that it loads on any number of ranks;
- `common.pt`, from rank 0: what every rank shares (position, loss scaler, schedule, the metric
  log's state, the config), as in a single-file checkpoint;
- `rng-rank<r>.pt`, every rank's random number generators;
- `SHA256SUMS`, the checksum of every file, in `sha256sum -c` format.
It is written into `step-<N>.tmp/` and renamed into place once complete, like a single file.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from mpexp.checkpoints.checksums import sha256_of
from mpexp.rundir import REPLACED

COMMON = "common.pt"
SUMS = "SHA256SUMS"


def _dcp():
    """torch.distributed.checkpoint and its state-dict helpers (torch >= 2.2)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict


def _trained_only():
    """The state-dict options that leave frozen weights out (mpexp/checkpoints/frozen.py): not
    saved, and not expected back when loading."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False)


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def save(path: Path, common: dict, rng: dict, model, optimizer, rank: int) -> None:
    """Write the folder `path` from every rank (a collective); rank 0 writes `common`.

    Whatever stops the write, the half-written folder is removed and `path`, if it was there,
    is untouched.
    """
    dcp, get_state_dict, _ = _dcp()
    tmp, aside = path.with_name(path.name + ".tmp"), path.with_name(path.name + REPLACED)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()  # the folder exists before any rank writes into it
    try:
        model_state, optimizer_state = get_state_dict(model, optimizer, options=_trained_only())
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp))
        # an optimizer's own per-rank state beyond its per-parameter states (pure bf16's
        # rounding generator, its count of lost updates), which DCP's optimizer state leaves out
        own = getattr(optimizer, "rank_state", None)
        torch.save({**rng, "optimizer": own()} if own else rng, tmp / rng_file(rank))
        if rank == 0:
            torch.save(common, tmp / COMMON)
        dist.barrier()  # every rank's files are complete
        if rank == 0:
            _write_sums(tmp)
            # A folder of the same name (an epoch's end at a step that already has one) is moved
            # aside, then deleted: deleted in place, a kill during the deletion would leave half
            # a checkpoint under the name a resume takes. A kill between the two renames leaves
            # it aside, and the next resume or save puts it back (rundir.put_back_replaced).
            shutil.rmtree(aside, ignore_errors=True)
            if path.exists():
                os.replace(path, aside)
            os.replace(tmp, path)
            shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        if rank == 0:
            if aside.is_dir() and not path.exists():  # stopped between the two renames
                os.replace(aside, path)
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_sums(folder: Path) -> None:
    lines = [f"{sha256_of(f)}  {f.name}\n" for f in sorted(folder.iterdir()) if f.name != SUMS]
    with (folder / SUMS).open("w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())


def corrupt_files(path: Path) -> list[str] | None:
    """The files of a checkpoint folder that no longer match their checksums (or are missing);
    None when the folder has no SHA256SUMS to check against."""
    sums = path / SUMS
    if not sums.is_file():
        return None
    bad = []
    for number, line in enumerate(sums.read_text(errors="replace").splitlines(), start=1):
        parts = line.split(maxsplit=1)
        if len(parts) != 2:  # a damaged list cannot vouch for the files
            bad.append(f"{SUMS} (line {number})")
            continue
        digest, name = parts[0], parts[1].strip()
        file = path / name
        if not file.is_file() or sha256_of(file) != digest:
            bad.append(name)
    return bad


def load_common(path: Path) -> dict:
    return torch.load(path / COMMON, map_location="cpu", weights_only=True)


def load_into(path: Path, model, optimizer) -> None:
    """Load the sharded model and optimizer state into this rank's FSDP model and optimizer,
    resharded to however many ranks there are now (a collective)."""
    dcp, get_state_dict, set_state_dict = _dcp()
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_trained_only())
    state = {"model": model_state, "optimizer": optimizer_state}
    # DCP reads the folder's `.metadata` with pickle, and torch has no weights-only reader for
    # it: a sharded checkpoint is trusted as one the user's own FSDP run wrote (trainer.resume
    # names it; load() has compared it with its SHA256SUMS where it has one). The other files
    # load with weights_only=True.
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_trained_only(),
    )


def load_rng(path: Path, rank: int) -> dict | None:
    """This rank's random number generators, if the checkpoint has a file for its rank."""
    file = path / rng_file(rank)
    return torch.load(file, weights_only=True) if file.is_file() else None
