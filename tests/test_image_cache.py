"""dataset.cache=resized (mpexp/data/image_cache.py) on folders of JPEG and PNG files written here:
the stored images are the decoded-and-resized ones, a store is reused while its folder and size are
the same and built again (said) when not, a folder that changes while its store is built is found,
and a cache folder that cannot be written costs the cache (loudly), not the run."""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing as mp
import os
import pickle
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mpexp.data import image_cache
from mpexp.data.image_folder import ImageFolderData
from mpexp.data.image_folder import reading as image_folder
from mpexp.data.image_folder.reading import decode
from mpexp.errors import ConfigError, DataError
from mpexp.run.runner import train
from mpexp.tracking.run_context import RunContext
from tests.conftest import make_cfg, run_cli
from tests.test_distributed import TORCHRUN, only_run_dir
from tests.test_image_folder import epoch, write_images

CPU = torch.device("cpu")


@pytest.fixture
def photos(tmp_path) -> Path:
    """A folder of its own for each test: some tests change it."""
    root = tmp_path / "photos"
    write_images(root / "train", 6)
    write_images(root / "val", 2, seed=1)
    return root


def cached(path: Path, cache_dir: Path, **kwargs) -> ImageFolderData:
    options = {"image_size": 8, "batch_size": 4, "num_workers": 0, "mean": [0.0] * 3,
               "std": [1.0] * 3, "cache": "resized", "cache_dir": str(cache_dir),
               **kwargs}  # fmt: skip
    data = ImageFolderData(path=str(path), **options)
    data.setup(CPU)
    return data


def builds(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Cached ")]


def test_the_stored_images_are_the_decoded_and_resized_ones(photos, tmp_path):
    """Validation's images resized as validation resizes them; training's kept at most at the
    side its random resized crop needs (ceil(8 / sqrt(0.08)) = 29 px), never enlarged."""
    data = cached(photos, tmp_path / "cache", resize_size=10)
    for name, split in data.splits.items():
        side, enlarge = (29, False) if name == "train" else (10, True)
        for i in range(len(split)):
            decoded = decode(split.path(i), side)
            expected = image_cache.fitted(decoded, side, enlarge)
            assert min(expected.shape[1:]) == (side if enlarge else min(side, *decoded.shape[1:]))
            assert torch.equal(split.cache.image(i), expected)
    assert {s.shape[1] for s in map(data.splits["train"].cache.image, range(18))} > {29}
    assert data.record()["cache"]["side"] == 29 and data.record()["cache"]["val_side"] == 10
    # validation (resize, centre crop) reads exactly what the decoding workers give
    plain = ImageFolderData(path=str(photos), image_size=8, resize_size=10, batch_size=4,
                            num_workers=0, mean=[0.0] * 3, std=[1.0] * 3)  # fmt: skip
    plain.setup(CPU)
    for (x, y), (px, py) in zip(data.val_batches(CPU), plain.val_batches(CPU), strict=True):
        assert torch.equal(x, px) and torch.equal(y, py)


def test_an_epoch_from_the_cache_decodes_nothing_and_workers_agree(photos, tmp_path, monkeypatch):
    cached(photos, tmp_path / "cache")  # built
    data = cached(photos, tmp_path / "cache")
    monkeypatch.setattr(image_folder, "decode", lambda *args: pytest.fail("decoded"))
    alone = epoch(data)
    assert len(alone) == 4 and all(x.shape == (4, 3, 8, 8) for x, _ in alone)
    workers = epoch(cached(photos, tmp_path / "cache", num_workers=2))
    for (x, y), (wx, wy) in zip(alone, workers, strict=True):
        assert torch.equal(x, wx) and torch.equal(y, wy)


def test_a_store_is_reused_and_built_again_when_the_folder_or_size_changes(
    photos, tmp_path, caplog, monkeypatch
):
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="mpexp"):
        cached(photos, cache)
        assert len(builds(caplog)) == 2  # train and val
        caplog.clear()
        cached(photos, cache)
        assert builds(caplog) == []  # reused, nothing decoded
        monkeypatch.chdir(photos.parent)
        cached(Path(photos.name), cache)
        assert builds(caplog) == []  # the same folder by a relative path: the same store
        caplog.clear()

        (photos / "train" / "cat" / "000.png").unlink()
        data = cached(photos, cache)
        (rebuilt,) = builds(caplog)
        assert "Cached 17 images" in rebuilt
        said = [r.getMessage() for r in caplog.records if "earlier image cache" in r.getMessage()]
        assert len(said) == 1 and "stays for any run still reading it" in said[0]
        assert data.train_size == 17
        caplog.clear()

        cached(photos, cache, resize_size=12)  # validation's size: its store alone is new
        assert len(builds(caplog)) == 1 and "resized to 12 px" in builds(caplog)[0]
        caplog.clear()
        cached(photos, cache, cache_side=16)  # training's size: its store alone is new
        assert len(builds(caplog)) == 1 and "at most 16 px" in builds(caplog)[0]
    stores = [p for p in cache.iterdir() if p.is_dir()]
    assert len(stores) == 5  # none replaced: 2 of the first folder, 1 of the second, 2 sizes


def test_a_store_cut_short_is_not_trusted(photos, tmp_path, caplog):
    data = cached(photos, tmp_path / "cache")
    store = data.splits["train"].cache.pixels_path
    store.write_bytes(store.read_bytes()[:100])
    with caplog.at_level(logging.INFO, logger="mpexp"):
        data = cached(photos, tmp_path / "cache")
    assert any("cut short" in r.getMessage() and "built again" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    split = data.splits["train"]
    expected = image_cache.fitted(decode(split.path(5), 29), 29, enlarge=False)
    assert torch.equal(split.cache.image(5), expected)


def test_a_folder_that_changes_during_the_build_is_built_again_or_refused(
    photos, tmp_path, caplog, monkeypatch
):
    """A file rewritten while the store is built: the store is built again from the folder as
    it is then; rewritten at every build, it is refused with one message."""
    victim = photos / "train" / "dog" / "001.jpg"
    calls = []
    real = image_folder.decode

    def decode_and_touch(path, least=None, every_build=False):
        calls.append(path)
        if path == str(victim) and (every_build or len(calls) <= 18):  # during the first build
            victim.write_bytes(victim.read_bytes() + b"\0")  # a JPEG with a trailing byte
        return real(path, least)

    monkeypatch.setattr(image_folder, "decode", decode_and_touch)
    with caplog.at_level(logging.WARNING, logger="mpexp"):
        data = cached(photos, tmp_path / "cache")
    (said,) = [r.getMessage() for r in caplog.records if "changed while" in r.getMessage()]
    assert "it is built again from the folder as it is now" in said
    store = data.splits["train"].cache
    key = json.loads((store.store / "key.json").read_text())["key"]
    assert (
        key
        == store.key()
        == image_cache.ResizedImages(  # the folder as it is now
            store.paths, image_cache.file_stats(store.paths), 29, False, store.folder, "", decode
        ).key()
    )

    def always(path, least=None):
        return decode_and_touch(path, least, every_build=True)

    monkeypatch.setattr(image_folder, "decode", always)
    with pytest.raises(DataError, match=r"changed again while .* was built a second time"):
        cached(photos, tmp_path / "other_cache")
    assert not [p for p in (tmp_path / "other_cache").glob("*train*") if p.is_dir()]  # no part


def test_a_cache_folder_that_cannot_be_written_trains_without_it_loudly(photos, tmp_path, caplog):
    """A file where the folder should be (as a read-only or full disk, an OSError): the run
    warns, decodes as usual and records that the cache was not used."""
    blocked = tmp_path / "blocked"
    blocked.write_text("not a folder")
    cfg = make_cfg("dataset=image_folder", f"dataset.path={photos}", "dataset.image_size=8",
                   "dataset.batch_size=4", "dataset.num_workers=0", "dataset.mean=[0.5,0.5,0.5]",
                   "dataset.std=[0.25,0.25,0.25]", "dataset.cache=resized",
                   f"dataset.cache_dir={blocked / 'images'}", "model=simplecnn", "model.width=4",
                   "trainer.epochs=1", "trainer.progress=false", "wandb.mode=disabled")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="mpexp"):
        train(cfg, RunContext(tmp_path / "run"))
    (warned,) = [r.getMessage() for r in caplog.records if "is NOT used" in r.getMessage()]
    assert f"{blocked / 'images'} cannot hold the image cache (Not a directory)" in warned
    assert "dataset.cache_dir" in warned
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished"
    ran = summary["ran"]["data"]["cache"]
    assert ran["kind"] == "none" and ran["asked"] == "resized" and "cannot hold" in ran["why"]


def test_a_full_cache_folder_leaves_no_partial_store(photos, tmp_path, monkeypatch, caplog):
    """The disk fills after the pixels were written: no part of the store is left, and the run
    decodes as without the cache."""

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(image_cache.np, "save", full)
    with caplog.at_level(logging.WARNING, logger="mpexp"):
        data = cached(photos, tmp_path / "cache")
    assert "No space left on device" in data.record()["cache"]["why"]
    # the lock and its guard (mpexp/atomic.py), no part of a store
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".guard", ".lock"]
    assert all(split.cache is None for split in data.splits.values())
    assert len(epoch(data)) == 4


def test_an_unknown_cache_kind_is_refused():
    with pytest.raises(ConfigError, match=r"dataset\.cache=memory is none of none, resized"):
        ImageFolderData(path=".", cache="memory")


def test_a_store_is_read_through_a_memory_map_never_whole(photos, tmp_path):
    """A folder larger than memory trains: an image's read copies its own pixels only, and a
    worker started by pickling (spawn) gets the store's paths, not its pixels."""
    data = cached(photos, tmp_path / "cache", resize_size=96)
    store = data.splits["val"].cache
    image = store.image(3)
    assert isinstance(store._pixels, np.memmap)
    assert image.untyped_storage().nbytes() == image.numel()  # its own pixels, no more
    assert store.pixels_path.stat().st_size > 100 * 1024
    assert len(pickle.dumps(store)) < 10 * 1024
    assert torch.equal(pickle.loads(pickle.dumps(store)).image(3), image)


def test_building_a_store_draws_nothing_from_the_runs_generator(photos, tmp_path):
    """A run that builds the store trains as one that reads it: the same weights from the seed."""
    draws = []
    for _ in ("built", "read"):
        torch.manual_seed(0)
        cached(photos, tmp_path / "cache")
        draws.append(torch.rand(4))
    assert torch.equal(*draws)


# --- many processes on one cache -------------------------------------------------------------


def slow_decoding(monkeypatch_or_none, counter, wait_s: float):
    """image_folder.decode counting into `counter` (shared between processes) and taking
    `wait_s` per image: builds that overlap in time, and a count of the images decoded."""
    real = image_folder.decode

    def slow(path, least=None):
        with counter.get_lock():
            counter.value += 1
        time.sleep(wait_s)
        return real(path, least)

    if monkeypatch_or_none is None:
        image_folder.decode = slow  # in a forked child: its own module, changed for good
    else:
        monkeypatch_or_none.setattr(image_folder, "decode", slow)


def test_two_runs_started_together_on_one_cache_build_one_store(photos, tmp_path):
    """Two jobs of a sweep start together on a new cache: one builds each store, the other waits
    on its lock and reads it (before: both built, every image decoded twice)."""
    forked = mp.get_context("fork")  # as the DataLoader's workers are; no torch thread used
    decoded, start = forked.Value("i", 0), forked.Barrier(2)

    def job() -> None:
        torch.set_num_threads(1)
        slow_decoding(None, decoded, 0.02)
        start.wait()
        data = cached(photos, tmp_path / "cache")
        os._exit(0 if data.record()["cache"]["kind"] == "resized" else 1)

    jobs = [forked.Process(target=job) for _ in range(2)]
    for process in jobs:
        process.start()
    for process in jobs:
        process.join(60)
    assert [p.exitcode for p in jobs] == [0, 0]
    assert decoded.value == 24  # 18 training and 6 validation images, each decoded once
    cache = tmp_path / "cache"
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2  # one store per split
    for lock in cache.glob("*.lock"):  # a note from each process that held it, its pid and
        # what it held it for (the waiter, if it waited, found the store built: decoded above)
        notes = lock.read_text().splitlines()
        pids = {note.split(" pid ")[1].split(":")[0] for note in notes}
        assert 1 <= len(notes) == len(pids) <= 2 and all(" to build " in n for n in notes)


def test_a_killed_builds_partial_store_is_removed_by_the_next(photos, tmp_path, caplog):
    """A builder killed mid-build (SIGKILL: no cleanup runs) leaves its partial store; the next
    build of that store removes it, said (before: it stayed, as large as the images cached)."""
    forked = mp.get_context("fork")
    decoded = forked.Value("i", 0)

    def job() -> None:
        torch.set_num_threads(1)
        slow_decoding(None, decoded, 0.5)
        cached(photos, tmp_path / "cache")

    builder = forked.Process(target=job)
    builder.start()
    cache = tmp_path / "cache"
    for _ in range(200):
        if decoded.value >= 2:
            break
        time.sleep(0.05)
    os.kill(builder.pid, signal.SIGKILL)
    builder.join(10)
    (left,) = cache.glob("*.partial")
    assert (left / "pixels.bin").exists()
    with caplog.at_level(logging.INFO, logger="mpexp"):
        data = cached(photos, cache)
    assert not list(cache.glob("*.partial"))
    (said,) = [r.getMessage() for r in caplog.records if "Removed" in r.getMessage()]
    assert str(left) in said and "stopped before it finished" in said
    assert len(epoch(data)) == 4


@pytest.mark.slow  # torchrun with two ranks: about 20 s on 2 cores
def test_two_ranks_under_torchrun_build_a_new_cache_once(photos, tmp_path):
    """Rank 0 builds each store while rank 1 waits, then rank 1 reads it: one build, rank 0's."""
    cache, cwd = tmp_path / "cache", tmp_path / "ddp"
    cwd.mkdir()
    result = run_cli(*TORCHRUN, "-m", "mpexp.train", "trainer.strategy=ddp", "dataset=image_folder",
                     f"dataset.path={photos}", "dataset.image_size=8", "dataset.batch_size=2",
                     "dataset.num_workers=0", "dataset.cache=resized", f"dataset.cache_dir={cache}",
                     "model=simplecnn_small", "trainer.epochs=1", "trainer.progress=false",
                     "wandb.mode=disabled", cwd=cwd)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((only_run_dir(cwd) / "summary.json").read_text())
    assert summary["ran"]["data"]["cache"]["kind"] == "resized"
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2 and not list(
        cache.glob("*.partial")
    )
    for lock in cache.glob("*.lock"):
        (build,) = lock.read_text().splitlines()
        assert "rank 0" in build


def test_the_cache_command_builds_the_stores_a_run_then_reads(photos, tmp_path, capsys, caplog):
    from mpexp import cache as command

    cache = tmp_path / "cache"
    overrides = [f"dataset.path={photos}", "dataset.image_size=8", f"dataset.cache_dir={cache}",
                 "dataset.num_workers=0"]  # fmt: skip
    assert command.main(overrides) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == sorted(str(p) for p in cache.iterdir() if p.is_dir())
    caplog.clear()  # the command's own "Cached ..." lines: the run after it builds nothing
    with caplog.at_level(logging.INFO, logger="mpexp"):
        data = cached(photos, cache)
    assert builds(caplog) == [] and sorted(data.record()["cache"]["stores"]) == sorted(printed)
    assert command.main([*overrides, "dataset.path=nowhere"]) == 2
    assert "dataset.path=nowhere does not exist" in capsys.readouterr().err
