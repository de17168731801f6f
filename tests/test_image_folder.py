"""dataset=image_folder on folders of PNG and JPEG files written here: classes from the folder
names, every image once per epoch in a seeded order, a resumed epoch that decodes only what it
trains on, the same batches with and without worker processes, shards, the split, normalisation,
one message for each kind of bad input; and whole runs: from the command line, killed and
resumed, and on two DDP ranks."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mpexp.data.image_folder import ImageFolderData
from mpexp.data.image_folder import reading as image_folder
from mpexp.errors import ConfigError, DataError
from mpexp.run.runner import train
from mpexp.tracking.run_context import RunContext
from mpexp.validate import validate
from tests.conftest import make_cfg, run_cli
from tests.test_distributed import TORCHRUN, losses, only_run_dir
from tests.test_resume import assert_same_final_state, comparable, crashed_and_resumed

CPU = torch.device("cpu")
CLASSES = ("cat", "dog", "fox")


def write_images(folder: Path, per_class: int, seed: int = 0, numbered: bool = False) -> None:
    """`per_class` images of each class in `folder/<class>/`, of assorted sizes, alternately PNG
    and JPEG. Numbered ones are PNGs of one colour each, whose red and green say which image
    (within its class) and which class it is: a batch then tells what it holds."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(CLASSES):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = rng.integers(14, 40, 2)
            if numbered:
                pixels = np.empty((h, w, 3), np.uint8)
                pixels[:] = (i, 100 * c, 7)
                Image.fromarray(pixels).save(folder / name / f"{i:03d}.png")
                continue
            colour = np.roll([220, 30, 30], c)
            pixels = np.clip(colour + rng.normal(0, 50, (h, w, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / name / f"{i:03d}.{('png', 'jpg')[i % 2]}")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    write_images(root / "train", 16)
    write_images(root / "val", 4, seed=1)
    return root


@pytest.fixture(scope="module")
def numbered(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("numbered")
    write_images(root / "train", 20, numbered=True)
    write_images(root / "val", 3, numbered=True)
    return root


def open_folder(path: Path, **kwargs) -> ImageFolderData:
    options = {"image_size": 8, "batch_size": 8, "num_workers": 0, "mean": [0.0] * 3,
               "std": [1.0] * 3, **kwargs}  # fmt: skip
    data = ImageFolderData(path=str(path), **options)
    data.setup(CPU)
    return data


def ids(images: torch.Tensor) -> list[tuple[int, int]]:
    """(class, image) of each numbered image in a batch (unnormalised: mean 0, std 1)."""
    centre = (images[:, :, 4, 4] * 255).round().long()
    return [(int(g) // 100, int(r)) for r, g, _ in centre]


def epoch(data: ImageFolderData, number: int = 1, seed: int = 0, start: int = 0) -> list:
    return [(x.clone(), y.clone()) for x, y in data.train_batches(number, seed, CPU, start=start)]


def test_classes_are_the_sorted_folder_names_and_validation_is_every_image_in_order(numbered):
    data = open_folder(numbered)
    assert data.classes == ["cat", "dog", "fox"]
    assert (data.task.channels, data.task.height, data.task.num_classes) == (3, 8, 3)
    assert data.train_size == 60 and data.steps_per_epoch() == 7
    seen = [(i, int(y)) for x, ys in data.val_batches(CPU) for i, y in zip(ids(x), ys, strict=True)]
    assert seen == [((c, i), c) for c in range(3) for i in range(3)]  # labels follow the classes
    record = data.record()
    assert record["classes"] == ["cat", "dog", "fox"] and record["layout"] == "train/ and val/"
    assert (record["train_images"], record["val_images"]) == (60, 9)
    assert "60 training images, 3 classes: cat, dog, fox" in data.describe()


def test_an_epoch_takes_every_image_once_in_an_order_set_by_seed_and_epoch(numbered):
    data = open_folder(numbered, drop_last=False)

    def order(number, seed):
        return [i for x, _ in epoch(data, number, seed) for i in ids(x)]

    first = order(1, 0)
    assert sorted(first) == [(c, i) for c in range(3) for i in range(20)]
    assert order(1, 0) == first and order(2, 0) != first and order(1, 1) != first


def test_a_resumed_epoch_decodes_only_the_images_it_trains_on(photos, monkeypatch):
    data = open_folder(photos)
    whole = epoch(data, 3)
    decoded = []
    real = image_folder.decode
    monkeypatch.setattr(image_folder, "decode", lambda *args: decoded.append(args) or real(*args))
    resumed = epoch(data, 3, start=4)
    assert len(resumed) == len(whole) - 4 and len(decoded) == len(resumed) * 8
    for (x, y), (rx, ry) in zip(whole[4:], resumed, strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)  # the same crops and flips too


def test_worker_processes_give_the_same_batches_as_the_main_process(photos):
    alone = epoch(open_folder(photos, augment={"crop_padding": 2}))
    workers = epoch(open_folder(photos, num_workers=2, augment={"crop_padding": 2}))
    assert len(alone) == len(workers) == 6
    for (x, y), (wx, wy) in zip(alone, workers, strict=True):
        assert torch.equal(x, wx) and torch.equal(y, wy)


def test_augmentation_changes_the_images_and_can_be_turned_off(photos):
    augmented = epoch(open_folder(photos))
    plain = epoch(open_folder(photos, augment={"crop_scale": None, "flip": False}))
    again = epoch(open_folder(photos, augment={"crop_scale": None, "flip": False}))
    assert all(torch.equal(a[1], p[1]) for a, p in zip(augmented, plain, strict=True))
    assert not any(torch.equal(a[0], p[0]) for a, p in zip(augmented, plain, strict=True))
    assert all(torch.equal(a[0], p[0]) for a, p in zip(again, plain, strict=True))
    validation = [x for x, _ in open_folder(photos).val_batches(CPU)]
    assert all(torch.equal(a, b) for a, b in zip(validation, validation, strict=True))


def test_ranks_share_an_epoch_without_overlap(numbered):
    seen = []
    for rank in (0, 1):
        data = open_folder(numbered, batch_size=5)
        data.shard(rank, 2)
        assert data.steps_per_epoch() == 6
        seen += [i for x, _ in epoch(data, 2, 7) for i in ids(x)]
    assert len(seen) == len(set(seen)) == 60


def test_one_folder_of_classes_is_split_per_class_by_the_split_seed(tmp_path):
    write_images(tmp_path, 20, numbered=True)

    def split(**kwargs):
        data = open_folder(tmp_path, val_fraction=0.25, **kwargs)
        return data, [i for x, _ in data.val_batches(CPU) for i in ids(x)]

    data, held = split()
    assert data.record()["layout"] == "class folders split by val_fraction"
    assert data.train_size + len(held) == 60 and 8 <= len(held) <= 22  # about a quarter
    assert sorted({c for c, _ in held}) == [0, 1, 2] and held == sorted(held)  # in label order
    trained = {i for x, _ in epoch(data) for i in ids(x)}
    assert not trained & set(held)
    assert split()[1] == held and split(split_seed=1)[1] != held


def test_the_normalisation_is_computed_from_training_images_when_not_given(numbered, caplog):
    with caplog.at_level(logging.INFO, logger="mpexp.data.image_folder"):
        data = open_folder(numbered, mean=None, std=None)
    pixels = torch.tensor([[i, 100 * c, 7] for c in range(3) for i in range(20)]) / 255
    assert data.mean == pytest.approx(pixels.mean(0).tolist(), abs=1e-4)
    assert data.std == pytest.approx(pixels.std(0, unbiased=False).clamp(min=1e-3).tolist(),
                                     abs=1e-4)  # fmt: skip
    assert "computed from 60 training images" in caplog.text
    images, _ = next(iter(data.val_batches(CPU)))
    first = (torch.tensor([0, 0, 7]) / 255 - torch.tensor(data.mean)) / torch.tensor(data.std)
    assert torch.allclose(images[0, :, 4, 4], first)  # the first cat, (0, 0, 7), normalised


def test_a_file_that_cannot_be_decoded_is_replaced_counted_and_named_once(photos, tmp_path,
                                                                           caplog):  # fmt: skip
    root = tmp_path / "photos"
    write_images(root / "train", 16)
    write_images(root / "val", 4, seed=1)
    broken = root / "train" / "dog" / "broken.jpg"
    broken.write_bytes(b"<html>not found</html>")
    with caplog.at_level(logging.WARNING):
        data = open_folder(root)
        for number in (1, 2):
            epoch(data, number)
    warned = [r.getMessage() for r in caplog.records if "cannot be decoded" in r.getMessage()]
    assert len(warned) == 1 and str(broken) in warned[0] and "stands in" in warned[0]
    assert data.record()["undecodable"] == [str(broken)]


def test_files_that_are_not_images_are_left_out_with_one_warning(photos, tmp_path, caplog):
    write_images(tmp_path / "train", 2)
    write_images(tmp_path / "val", 1)
    (tmp_path / "train" / "cat" / "notes.txt").write_text("taken in May")
    (tmp_path / "train" / "dog" / ".DS_Store").write_bytes(b"\0")
    (tmp_path / "train" / ".ipynb_checkpoints").mkdir()  # hidden: no class
    with caplog.at_level(logging.WARNING):
        data = open_folder(tmp_path, batch_size=2)
    assert data.classes == ["cat", "dog", "fox"] and data.train_size == 6
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "Ignored 1 file(s)" in warning and "train/cat/notes.txt" in warning


def bad(tmp_path: Path, case: str) -> Path:
    """A folder with one kind of bad input."""
    root = tmp_path / case
    if case == "missing":
        return root
    root.mkdir()
    if case == "empty":
        return root
    write_images(root / "train", 2)
    write_images(root / "val", 1)
    if case == "no images in a class":
        (root / "train" / "owl").mkdir()
        (root / "train" / "owl" / "owl.txt").write_text("hoot")
        (root / "val" / "owl").mkdir()
    elif case == "classes differ":
        (root / "val" / "fox").rename(root / "val" / "wolf")
    elif case == "no class folders":
        for image in (root / "train").rglob("*.*"):
            image.rename(root / "train" / f"{image.parent.name}-{image.name}")
        for folder in CLASSES:
            (root / "train" / folder).rmdir()
    elif case == "one class":
        for split in ("train", "val"):
            for name in CLASSES[1:]:
                shutil.rmtree(root / split / name)
    elif case == "nothing decodes":
        for image in root.rglob("*.*"):
            image.write_bytes(b"")
    return root


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("missing", "does not exist"),
        ("empty", "is empty. dataset.path="),
        ("no images in a class", "train/owl holds no images (.jpg, .jpeg, .png"),
        ("classes differ", "differ (only in train/: fox; only in val/: wolf)"),
        ("no class folders", "holds 6 files but no class folder"),
        ("nothing decodes", "None of 6 images in a row from"),
        ("one class", "holds one class folder (cat): one class leaves nothing to learn"),
    ],
)
def test_bad_input_gets_one_message_naming_the_place(tmp_path, case, said):
    root = bad(tmp_path, case)
    with pytest.raises(DataError) as err:
        epoch(open_folder(root, batch_size=2))
    message = str(err.value)
    assert said in message and str(root) in message
    assert len(message.splitlines()) == 1


def test_a_file_name_that_is_not_utf8_is_read(photos, tmp_path):
    """A Latin-1 name (an old archive's), which Python holds with surrogates: decoded as any."""
    root = tmp_path / "latin1"
    shutil.copytree(photos, root)
    cat = os.fsencode(root / "train" / "cat")
    os.rename(os.path.join(cat, b"000.png"), os.path.join(cat, b"caf\xe9.png"))
    data = open_folder(root)
    assert data.train_size == 48 and len(epoch(data)) == 6
    assert not data.undecodable


def test_a_run_of_broken_files_longer_than_the_search_stops_with_the_first(tmp_path, monkeypatch):
    write_images(tmp_path / "train", 4)
    write_images(tmp_path / "val", 1)
    for name in ("000.png", "001.jpg"):
        (tmp_path / "train" / "dog" / name).write_bytes(b"")
    monkeypatch.setattr(image_folder, "MAX_TRIES", 2)
    data = open_folder(tmp_path, batch_size=12)  # every image in the batch, the rest decodable
    with pytest.raises(DataError, match=r"None of 2 images in a row from \S*dog/000.png on"):
        epoch(data)


def test_the_folder_must_be_given_before_anything_runs():
    with pytest.raises(ConfigError, match=r"needs dataset.path=<folder>"):
        validate(make_cfg("dataset=image_folder"))
    with pytest.raises(ConfigError, match=r"dataset.augment.crop_scale=\[0.5, 0.1\]"):
        validate(make_cfg("dataset=image_folder", "dataset.path=x",
                          "dataset.augment.crop_scale=[0.5,0.1]"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"dataset\.mean is given without dataset\.std"):
        validate(make_cfg("dataset=image_folder", "dataset.path=x", "dataset.mean=[0.5,0.5,0.5]"))


SMALL = [
    "dataset=image_folder",
    "dataset.image_size=16",
    "dataset.batch_size=8",
    "model=simplecnn_small",
    "trainer.epochs=2",
    "trainer.progress=false",
    "wandb.mode=disabled",
]


@pytest.mark.slow  # the command itself; the tests above train the same folder in-process
def test_a_folder_of_images_trains_from_the_command_line(photos, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("mpexp.train", *SMALL, f"dataset.path={photos}", "dataset.num_workers=2",
                     f"hydra.run.dir={run_dir}", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["val/acc"] > 0.5
    ran = summary["ran"]
    assert ran["data"]["classes"] == ["cat", "dog", "fox"] and ran["steps_per_epoch"] == 6
    assert ran["task"]["num_classes"] == 3 and ran["task"]["height"] == 16
    assert "48 training images, 3 classes: cat, dog, fox" in (run_dir / "train.log").read_text()


@pytest.mark.slow  # the command itself; each message is tested in-process above
def test_bad_input_on_the_command_line_is_one_line_and_exit_code_2(tmp_path):
    root = bad(tmp_path, "classes differ")
    result = run_cli("mpexp.train", *SMALL, f"dataset.path={root}", cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output
    assert "only in val/: wolf" in output


@pytest.fixture
def _nondeterministic_afterwards():
    yield
    torch.use_deterministic_algorithms(False)


def test_a_run_crashed_after_a_checkpoint_resumes_to_the_same_result(
    photos, tmp_path, monkeypatch, caplog, _nondeterministic_afterwards
):
    args = [*SMALL, f"dataset.path={photos}", "dataset.num_workers=2",
            "dataset.augment.crop_padding=2", "trainer.epochs=3", "trainer.deterministic=true",
            "trainer.checkpoint_every_steps=4"]  # fmt: skip
    # resumed on fewer workers: the batches do not depend on how many decode them
    fewer = [a.replace("num_workers=2", "num_workers=1") for a in args]
    whole, killed = crashed_and_resumed(args, tmp_path, monkeypatch, caplog, resume_args=fewer)
    assert comparable(killed) == comparable(whole)  # every step's loss: the same batches
    assert_same_final_state(whole, killed, ("model", "optimizer", "position"))


@pytest.mark.slow  # torchrun with two ranks, each with a worker: about 20 s on 2 cores
def test_two_ranks_under_ddp_train_like_one_process_with_their_joint_batch(photos, tmp_path):
    args = [*SMALL, f"dataset.path={photos}", "dataset.num_workers=1", "trainer.epochs=1"]
    cwd = tmp_path / "ddp"
    cwd.mkdir()
    # dataset.batch_size=8 (SMALL's) is the step's: each of the two ranks takes 4 of it
    result = run_cli(*TORCHRUN, "-m", "mpexp.train", "trainer.strategy=ddp", *args, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = only_run_dir(cwd)
    ran = json.loads((run_dir / "summary.json").read_text())["ran"]
    assert (ran["world_size"], ran["steps_per_epoch"], ran["replicas_identical"]) == (2, 6, True)

    train(make_cfg(*args), RunContext(tmp_path / "one"))  # the same 8 in one process
    assert losses(run_dir) == pytest.approx(losses(tmp_path / "one"), rel=1e-4)


# --- resumes that never leak: the folder's resume key ---------------------------------------

IN_PROCESS = [a for a in SMALL if a != "trainer.epochs=2"] + ["dataset.num_workers=0"]


def test_a_resume_on_a_changed_folder_is_refused_naming_what_changed(photos, tmp_path):
    """A file removed, a class added, another normalisation: each refused with one message that
    names it, the run's files as they were; the logged mean and std given back resume."""
    root = tmp_path / "photos"
    shutil.copytree(photos, root)
    args = [*IN_PROCESS, f"dataset.path={root}"]
    run = tmp_path / "run"
    summary = train(make_cfg(*args, "trainer.epochs=1"), RunContext(run))
    before = (run / "metrics.jsonl").read_bytes()
    mean, std = summary["ran"]["data"]["mean"], summary["ran"]["data"]["std"]
    logged = [
        f"dataset.mean=[{','.join(map(str, mean))}]",
        f"dataset.std=[{','.join(map(str, std))}]",
    ]

    def refused(*extra) -> str:
        resume = make_cfg(*args, "trainer.epochs=2", f"trainer.resume={run}", *extra)
        with pytest.raises(ConfigError, match="was written while training on other data") as err:
            train(resume, RunContext(run))
        assert (run / "metrics.jsonl").read_bytes() == before
        return str(err.value)

    removed = root / "train" / "cat" / "003.jpg"
    kept, stat = removed.read_bytes(), removed.stat()
    removed.unlink()
    message = refused()
    assert "train/cat 16 files, " in message and "then, 15 files, " in message
    assert "train/dog" not in message and len(message.splitlines()) == 1
    removed.write_bytes(kept[:-1] + b"\xd9")  # rewritten at the same size: another photo
    os.utime(removed, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    message = refused()  # the same count and bytes, another time
    assert "train/cat 16 files, " in message and "then, 16 files, " in message
    removed.write_bytes(kept)  # put back as it was (as cp -p would)
    os.utime(removed, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    write_images(tmp_path / "owls", 2)
    for split in ("train", "val"):
        shutil.copytree(tmp_path / "owls" / "fox", root / split / "owl")
    assert "classes 3 then, 4 now, train/owl absent then, 2 files, " in refused()
    for split in ("train", "val"):
        shutil.rmtree(root / split / "owl")

    assert f"mean {mean} then, [0.5, 0.5, 0.5] now" in refused(
        "dataset.mean=[0.5,0.5,0.5]", logged[1]
    )
    resumed = train(make_cfg(*args, *logged, "trainer.epochs=2", f"trainer.resume={run}"),
                    RunContext(run))  # fmt: skip
    assert resumed["epoch"] == 2 and resumed["ran"]["data"]["mean"] == mean


def split_of(root: Path) -> dict[str, list[str]]:
    data = open_folder(root, val_fraction=0.3)
    val = data.splits["val"]
    return {c: [str(val.files[i]) for i in val.of_class(k)] for k, c in enumerate(data.classes)}


def test_a_class_keeps_its_split_when_another_class_changes(tmp_path):
    write_images(tmp_path, 10)
    held = split_of(tmp_path)
    assert all(held.values())
    (tmp_path / "cat" / "004.png").unlink()  # a damaged file removed, as the warning asks
    changed = split_of(tmp_path)
    assert changed["dog"] == held["dog"] and changed["fox"] == held["fox"]
    shutil.copy(tmp_path / "fox" / "000.png", tmp_path / "cat" / "extra.png")
    shutil.copy(tmp_path / "fox" / "002.png", tmp_path / "cat" / "more.png")
    added = split_of(tmp_path)
    assert added["dog"] == held["dog"] and added["fox"] == held["fox"]


def test_an_image_added_to_a_class_moves_no_other_image_between_the_splits(tmp_path):
    """Each file validates or trains by its own path's place (split_place): a photo added to a
    class leaves every other one where it was (before, none of the class's 10 validation images
    stayed in validation)."""
    write_images(tmp_path, 34, numbered=True)

    def splits() -> tuple[set, set]:
        data = open_folder(tmp_path, val_fraction=0.3)
        train, val = (set(data.splits[s].files.tolist()) for s in ("train", "val"))
        return train, val

    train, val = splits()
    assert len(val) >= 10
    shutil.copy(tmp_path / "cat" / "000.png", tmp_path / "cat" / "new.png")
    train_after, val_after = splits()
    assert train <= train_after and val <= val_after
    assert (train_after | val_after) - (train | val) == {b"cat/new.png"}


# --- folders as people have them -------------------------------------------------------------


@pytest.mark.parametrize("name", ["valid", "validation"])
def test_valid_and_validation_folders_validate_as_val_does(photos, tmp_path, name):
    root = tmp_path / "photos"
    shutil.copytree(photos, root)
    (root / "val").rename(root / name)
    data = open_folder(root)
    assert data.record()["layout"] == f"train/ and {name}/"
    assert (data.train_size, len(data.splits["val"])) == (48, 12)
    shutil.copytree(root / name, root / "val")
    with pytest.raises(DataError, match=f"holds both val/ and {name}/"):
        open_folder(root)


def test_a_test_folder_is_evaluated_once_at_the_end_and_reported_apart(photos, tmp_path):
    root = tmp_path / "photos"
    shutil.copytree(photos, root)
    write_images(root / "test", 2, seed=2)
    run = tmp_path / "run"
    summary = train(make_cfg(*IN_PROCESS, f"dataset.path={root}"), RunContext(run))
    assert summary["ran"]["data"]["test_images"] == 6
    assert summary["ran"]["data"]["layout"] == "train/ and val/, test/"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tested = [r for r in rows if "test/acc" in r]
    assert len(tested) == 1 and rows[-1] is tested[0] and "epoch" not in tested[0]
    assert tested[0]["test/acc"] == summary["test/acc"] and summary["test/acc"] in (
        0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1)  # fmt: skip
    assert summary["test/loss"] > 0 and "test/acc" not in rows[-2]
    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk["test/acc"] == summary["test/acc"]
    validated = (run / "val_files.txt").read_text().splitlines()  # which images val/acc measured
    assert validated == sorted(str(p.relative_to(root)) for p in (root / "val").rglob("*.*"))


@pytest.mark.parametrize("name", ["val", "test"])
def test_a_split_folder_among_the_class_folders_is_refused_showing_the_layout(tmp_path, name):
    """cat/, dog/ and fox/ beside val/<class>/ (or test/<class>/) and no train/: the split's
    folder would be trained as one more class, swallowing its images (before: silently)."""
    write_images(tmp_path, 2)
    write_images(tmp_path / name, 1)
    with pytest.raises(DataError) as err:
        open_folder(tmp_path)
    message = str(err.value)
    assert f"holds {name}/ among its class folders, and {name}/ holds folders of its" in message
    assert f"out as {tmp_path}/train/<class>/ and {tmp_path}/{name}/<class>/" in message
    assert len(message.splitlines()) == 1
    (tmp_path / "train").mkdir()
    for folder in ("cat", "dog", "fox"):
        (tmp_path / folder).rename(tmp_path / "train" / folder)
    assert open_folder(tmp_path).record()["layout"].startswith("train/")


def test_a_photo_turned_by_its_exif_orientation_comes_out_upright(tmp_path):
    """A camera's 20x10 sensor image, red above blue, with EXIF orientation 6 ("turn 90 degrees
    clockwise to view"): upright it is 10 wide and 20 high, red on the right."""
    pixels = np.zeros((10, 20, 3), np.uint8)
    pixels[:5] = (255, 0, 0)
    pixels[5:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "turned.jpg"
    Image.fromarray(pixels).save(path, exif=exif, quality=95)
    image = image_folder.decode(str(path))
    assert image.shape == (3, 20, 10)
    assert image[0, 10, 8] > 200 and image[2, 10, 8] < 50  # the right: red
    assert image[2, 10, 1] > 200 and image[0, 10, 1] < 50  # the left: blue


@pytest.mark.parametrize("case", ["loop", "link out"])
def test_symbolic_link_loops_and_links_out_of_the_folder_are_refused(photos, tmp_path, case):
    root = tmp_path / "photos"
    shutil.copytree(photos, root)
    cat = root / "train" / "cat"
    if case == "loop":
        (cat / "again").symlink_to(cat)
        said = f"{cat / 'again'} is a symbolic link to {cat.resolve()}, a folder that holds it"
    else:
        outside = tmp_path / "elsewhere.png"
        shutil.copy(cat / "000.png", outside)
        (cat / "borrowed.png").symlink_to(outside)
        said = f"{cat / 'borrowed.png'} leads through a symbolic link to {outside.resolve()}"
    (root / "train" / "dog" / "inside.png").symlink_to(cat / "000.png")  # inside: followed
    with pytest.raises(DataError) as err:
        open_folder(root)
    assert said in str(err.value) and len(str(err.value).splitlines()) == 1
    (cat / ("again" if case == "loop" else "borrowed.png")).unlink()
    assert open_folder(root).train_size == 49


def test_a_class_whose_every_image_is_undecodable_is_named(photos, tmp_path):
    root = tmp_path / "photos"
    shutil.copytree(photos, root)
    for split in ("train", "val"):
        shutil.copytree(root / split / "fox", root / split / "owl")
    for image in (root / "train" / "owl").iterdir():
        image.write_bytes(b"")
    with pytest.raises(DataError) as err:
        epoch(open_folder(root))
    assert str(err.value).startswith("None of the 16 train images of class owl can be decoded")
    assert "never be seen" in str(err.value)


def test_a_transient_read_error_is_retried_not_counted_as_damage(photos, monkeypatch):
    real, failed = Image.open, []

    def flaky(path, *args, **kwargs):
        if not failed:
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(image_folder.Image, "open", flaky)
    data = open_folder(photos)
    assert len(epoch(data)) == 6
    assert failed and not data.undecodable


def test_a_checkpoint_that_kept_no_record_of_the_folder_is_not_resumed(photos, tmp_path,
                                                                       monkeypatch):  # fmt: skip
    """A run from before the key (simulated): its split may have been drawn otherwise, and
    nothing says the folder is the same."""
    args = [*IN_PROCESS, f"dataset.path={photos}"]
    run = tmp_path / "run"
    with monkeypatch.context() as old_mpexp:
        old_mpexp.setattr(ImageFolderData, "resume_key", lambda self: None)
        train(make_cfg(*args, "trainer.epochs=1"), RunContext(run))
    with pytest.raises(ConfigError, match="kept no record of the data it trained on"):
        train(make_cfg(*args, "trainer.epochs=2", f"trainer.resume={run}"), RunContext(run))
