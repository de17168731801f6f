"""Image folders as people have them, beyond the tests' own layout: class folders put beside
train/, a test/ folder of loose images among the classes, advice on slow data that the run would
take, an image rewritten in place with its time put back, and the cache's lock naming its
holder."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mpexp import atomic
from mpexp.data import file_digest
from mpexp.data.image_folder import ImageFolderData
from mpexp.errors import DataError
from tests.conftest import ROOT
from tests.test_image_cache import cached
from tests.test_image_folder import open_folder, write_images


def test_a_class_folder_beside_train_is_refused_naming_it(tmp_path):
    # root/{train/{cat,dog,fox}, val/..., owl/}: owl/ was left out without a word
    write_images(tmp_path / "train", 2)
    write_images(tmp_path / "val", 1)
    write_images(tmp_path / "owl", 1)
    with pytest.raises(DataError) as refused:
        open_folder(tmp_path)
    message = str(refused.value)
    assert "holds owl/ beside train/" in message and f"{tmp_path}/train/owl/" in message
    assert len(message.splitlines()) == 1
    shutil.rmtree(tmp_path / "owl")
    (tmp_path / "notes").mkdir()  # a folder of anything else: refused alike
    (tmp_path / "notes" / "todo.txt").write_text("label the owls")
    with pytest.raises(DataError, match="holds notes/ beside train/"):
        open_folder(tmp_path)
    shutil.rmtree(tmp_path / "notes")
    (tmp_path / ".cache").mkdir()  # hidden folders are no classes
    # nor is an unzipped archive's __MACOSX/, which holds hidden files alone: nothing left out
    (tmp_path / "__MACOSX" / "train" / "cat").mkdir(parents=True)
    (tmp_path / "__MACOSX" / "train" / "cat" / "._0.jpg").write_bytes(b"\0")
    assert open_folder(tmp_path).classes == ["cat", "dog", "fox"]


def test_a_test_folder_of_loose_images_among_the_classes_is_refused_not_trained(tmp_path):
    # root/{cat,dog,fox,test/x.jpg}: test/ became a fourth class
    write_images(tmp_path, 2)
    (tmp_path / "test").mkdir()
    Image.new("RGB", (12, 12)).save(tmp_path / "test" / "x.jpg")
    with pytest.raises(DataError) as refused:
        open_folder(tmp_path)
    message = str(refused.value)
    assert "holds test/ among its class folders, and test/ holds images but no class" in message
    assert "rename test/ if it is a class" in message and len(message.splitlines()) == 1


def jpegs(folder: Path) -> Path:
    """A train/ and val/ folder of JPEGs alone (write_images alternates PNG and JPEG)."""
    write_images(folder / "train", 4)
    write_images(folder / "val", 2)
    for png in folder.rglob("*.png"):
        png.unlink()
    return folder


@pytest.mark.parametrize("kind", ["png", "jpeg"])
def test_the_slow_data_advice_names_only_what_this_run_takes(tmp_path, kind):
    # a CPU run was told to set dataset.decode=gpu, which it refuses (a folder of PNGs too)
    folder = jpegs(tmp_path / "j") if kind == "jpeg" else tmp_path / "p"
    if kind == "png":
        write_images(folder / "train", 2)
        write_images(folder / "val", 1)
    data = open_folder(folder)
    assert data.faster_data_keys() == ["dataset.num_workers", "dataset.cache=resized"]
    decoded_on_gpu = ImageFolderData(path=str(folder), decode="gpu")  # taken: nothing else
    assert decoded_on_gpu.faster_data_keys() == ["dataset.num_workers"]


def rewrite_keeping_size_and_time(path: Path) -> None:
    """The same number of bytes, other pixels, the modification time put back (`touch -r`)."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[-20:-2] = bytes(255 - b for b in data[-20:-2])  # inside the compressed image data
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns


def test_an_image_rewritten_at_its_size_and_time_gets_a_store_and_a_resume_key_of_its_own(
    tmp_path,
):
    # the cache's key was path, size and mtime: the old store was read for the new image, and
    # a resume passed its check
    folder = jpegs(tmp_path / "photos")
    first = cached(folder, tmp_path / "cache")
    key, store = first.resume_key(), first.splits["train"].cache.store
    rewrite_keeping_size_and_time(folder / "train" / "dog" / "001.jpg")
    again = cached(folder, tmp_path / "cache")
    assert again.splits["train"].cache.store != store  # built anew
    assert again.resume_key()["train/dog"] != key["train/dog"]
    assert again.resume_key()["train/cat"] == key["train/cat"]  # the others as they were


def test_a_files_digest_reads_its_size_and_both_ends(tmp_path):
    path = tmp_path / "f"
    body = np.random.default_rng(0).bytes(3 * file_digest.EDGE)
    path.write_bytes(body)
    digest = file_digest.file_digest(str(path), len(body))
    for changed_at, differs in ((0, True), (len(body) - 1, True), (len(body) // 2, False)):
        spoiled = bytearray(body)
        spoiled[changed_at] ^= 1
        path.write_bytes(bytes(spoiled))
        assert bool(file_digest.file_digest(str(path), len(body)) != digest) is differs
    assert file_digest.file_digest(str(tmp_path / "gone"), -1) == file_digest.UNREADABLE
    paths = [str(path)] * 1100  # stretches of BATCH files, read by threads, in order
    digests = file_digest.file_digests(paths, np.full(1100, len(body)))
    assert (digests == file_digest.file_digest(str(path), len(body))).all()


WAITER = """
import logging, sys
from pathlib import Path
from mpexp import atomic
logging.basicConfig(filename=sys.argv[2], level=logging.INFO, format="%(message)s")
with atomic.exclusive(Path(sys.argv[1]), "Waiting for the builder", "to build as well"):
    pass
"""


def test_a_waiting_process_names_the_holder_that_took_the_lock_never_an_earlier_one(tmp_path):
    # the builder wrote its note after taking the lock: a process that came in between logged
    # "(holder unknown)", or the previous builder's line
    lock, said = tmp_path / "store.lock", tmp_path / "said.log"
    lock.write_text("2026-01-01T00:00:00+00:00 elsewhere pid 1: an earlier build\n")
    with atomic.exclusive(lock, "Waiting", "building 12 images"):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        waiter = subprocess.Popen([sys.executable, "-c", WAITER, str(lock), str(said)], env=env)
        deadline = time.monotonic() + 120
        while not (said.exists() and said.read_text()) and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                waiter.wait(0.05)  # until the waiter has said whom it waits for
    assert waiter.wait(120) == 0
    (line,) = said.read_text().splitlines()
    assert line.startswith("Waiting for the builder (") and line.endswith(
        f"pid {os.getpid()}: building 12 images)."
    )
    assert lock.read_text().splitlines()[-1].endswith("to build as well")  # its own, once in
