"""The image folder's layout: which folders are the splits and which the classes, walked once for
each file's name, size and modification time; the layouts that would mislead a run are refused,
named (a split's folder among the classes, a link out of the folder or round in a loop, splits
whose classes differ, a single class)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from mpexp.data.image_folder.val_split import split_by_fraction
from mpexp.errors import DataError

log = logging.getLogger(__name__)

# what Pillow reads; other files in the class folders are not images
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")
LAYOUT = (
    "train/<class>/ and val/<class>/ folders of images, or one folder per class to split by "
    "dataset.val_fraction"
)
VAL_FOLDERS = ("val", "valid", "validation")  # the names people give the validation split
SPLIT_FOLDERS = (*VAL_FOLDERS, "test", "train")  # never a class that holds folders of its own


def find_root(path: str | None) -> Path:
    """dataset.path as a folder, or a DataError saying what it should be."""
    if path is None:
        raise DataError(f"dataset=image_folder needs dataset.path=<folder> holding {LAYOUT}.")
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(
            f"dataset.path={path} does not exist (from {Path.cwd()}). Give the folder "
            f"that holds {LAYOUT}."
        )
    if not root.is_dir():
        raise DataError(f"dataset.path={path} is a file, not a folder holding {LAYOUT}.")
    return root


def scan(
    root: Path, path: str, val_fraction: float, split_seed: int
) -> tuple[dict[str, dict[str, list[str]]], str]:
    """Each split's image files (relative to `root`) by class: "train", "val", and "test"
    where there is a test/ folder beside train/; warns once about files that are not
    images. With the layout, in words. `path`: dataset.path as given."""
    ignored: list[str] = []
    train = root / "train"
    if train.is_dir():
        refuse_folders_beside_train(root, path)
    val = val_folder(root, path) if train.is_dir() else None
    if val is not None:
        layout = f"train/ and {val.name}/"
        splits = {"train": scan_classes(root, train, ignored)}
        splits["val"] = scan_classes(root, val, ignored)
        check_same_classes(splits["train"], splits["val"], root, val.name)
    else:
        whole = train if train.is_dir() else root
        layout = f"{'train/' if whole == train else 'class folders'} split by val_fraction"
        refuse_split_folders(root, whole, path)
        train_files, val_files = split_by_fraction(
            scan_classes(root, whole, ignored), whole, root, val_fraction, split_seed
        )
        splits = {"train": train_files, "val": val_files}
    if train.is_dir() and (root / "test").is_dir():
        layout += ", test/"
        splits["test"] = scan_classes(root, root / "test", ignored)
        check_same_classes(splits["train"], splits["test"], root, "test")
    # a path one level too high: a 100 % accuracy that means nothing
    if len(splits["train"]) < 2:
        (only,) = splits["train"]
        raise DataError(
            f"dataset.path={path} holds one class folder ({only}): one class leaves "
            f"nothing to learn. Give the folder that holds {LAYOUT}, with two classes or more."
        )
    if ignored:
        more = f" and {len(ignored) - 3} more" if len(ignored) > 3 else ""
        log.warning(
            "Ignored %d file(s) in %s that are not images (%s): %s%s. Move them out of the "
            "class folders to silence this.",
            len(ignored),
            root,
            ", ".join(IMAGE_EXTENSIONS),
            ", ".join(ignored[:3]),
            more,
        )
    return splits, layout


def val_folder(root: Path, path: str) -> Path | None:
    """The validation split's folder beside train/ (val/, valid/ or validation/), if any."""
    found = [root / name for name in VAL_FOLDERS if (root / name).is_dir()]
    if len(found) > 1:
        names = " and ".join(f"{p.name}/" for p in found)
        raise DataError(
            f"dataset.path={path} holds both {names}: which one validates is not clear. "
            "Merge them into one, or move one out."
        )
    return found[0] if found else None


def refuse_folders_beside_train(root: Path, path: str) -> None:
    """Beside train/ stand the other splits' folders only: the classes are train/'s folders,
    and a class folder put beside train/ (root/dog/ by root/train/cat/) would be left out of
    the run without a word. Refused, naming it; a folder with no file to leave out (an unzipped
    archive's __MACOSX/, which holds hidden files alone) is let be."""
    splits = {*VAL_FOLDERS, "test", "train"}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if folder.name.startswith(".") or folder.name.lower() in splits:
            continue
        if not any(_visible_files(folder)):
            continue
        raise DataError(
            f"dataset.path={path} holds {folder.name}/ beside train/: with a train/ folder the "
            f"classes are the folders in train/ (and in val/), so {folder.name}/ would be left "
            f"out. If it is a class, move its images into {root}/train/{folder.name}/ (and "
            f"some into val/{folder.name}/); otherwise move it out of {root}."
        )


def _visible_files(folder: Path):
    """The files below `folder` that are not hidden and not in a hidden folder, lazily."""
    for entry in folder.rglob("*"):
        relative = entry.relative_to(folder).parts
        if entry.is_file() and not any(part.startswith(".") for part in relative):
            yield entry


def refuse_split_folders(root: Path, whole: Path, path: str) -> None:
    """A folder named as a split (val/, test/, ...) among the class folders to split is a split
    put in the wrong place, or a class whose name says otherwise: trained as one more class, a
    split would swallow the images meant to validate or test. Refused, showing the layout to
    use: whether it holds folders of its own (a split's classes) or images alone."""
    for folder in sorted(p for p in whole.iterdir() if p.is_dir()):
        if folder.name.lower() not in SPLIT_FOLDERS:
            continue
        where = "" if whole == root else f"{whole.name}/"
        name = f"{where}{folder.name}/"
        inner = next((p for p in sorted(folder.iterdir()) if p.is_dir() and
                      not p.name.startswith(".")), None)  # fmt: skip
        if inner is not None:
            held = f"and {name} holds folders of its own ({inner.name}/, ...)"
        else:
            held = f"and {name} holds images but no class folders (a split's images, unlabelled)"
        raise DataError(
            f"dataset.path={path} holds {name} among its class folders, {held}: it would be "
            f"trained as a class named {folder.name}. Lay the folder out as "
            f"{root}/train/<class>/ and {root}/{folder.name.lower()}/<class>/ (move the class "
            f"folders into train/), or rename {folder.name}/ if it is a class."
        )


def scan_classes(root: Path, folder: Path, ignored: list[str]) -> dict[str, list[tuple]]:
    """{class: its image files (path relative to `root`, size, mtime in ns)} for the class
    folders in `folder` (sorted, at any depth below them, hidden files and folders left out);
    other files go to `ignored`."""
    entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    folders = [p for p in entries if p.is_dir()]
    loose = [p for p in entries if not p.is_dir()]
    if not folders:
        what = f"holds {len(loose)} files but no class folder" if loose else "is empty"
        raise DataError(
            f"{folder} {what}. dataset.path={root} should hold {LAYOUT}, each class's images in a "
            "folder named after the class."
        )
    ignored += [str(p.relative_to(root)) for p in loose]
    classes = {}
    real_root = os.path.realpath(root)
    for class_folder in folders:
        real = os.path.realpath(class_folder)
        if not is_inside(real, real_root):  # train/ or the class folder a link out
            refuse_link_out(class_folder, real, root)
        images, others = [], []
        walk_class(root, real_root, str(class_folder), (real,), images, others)
        if not images:
            held = f"only {len(others)} other files, e.g. {others[0]}" if others else "nothing"
            raise DataError(
                f"The class folder {class_folder} holds no images ({', '.join(IMAGE_EXTENSIONS)})"
                f", {held}. Put the class's images there, or remove the folder."
            )
        ignored += others
        classes[class_folder.name] = images
    return classes


def walk_class(
    root: Path, real_root: str, folder: str, chain: tuple[str, ...], images: list, others: list
) -> None:
    """The files below `folder` into `images` (path, size, mtime in ns) and `others` (paths),
    relative to `root`: each folder's own files (sorted) before its subfolders'. `chain`: the
    real paths of the folders walked into, the last `folder`'s. A symbolic link is followed
    where it stays inside `root`; one that leads out of it, or into a folder of `chain` (a
    loop), is refused."""
    with os.scandir(folder) as listing:
        entries = sorted((e for e in listing if not e.name.startswith(".")), key=lambda e: e.name)
    subfolders = []
    # every path walked starts with root's own (links are followed, not resolved; pathlib writes
    # no "./" before the children of "."): a cut costs a fraction of os.path.relpath, which was
    # half the walk's time
    cut = 0 if str(root) == "." else len(os.path.join(root, ""))
    for entry in entries:
        real = None
        if entry.is_symlink():
            real = os.path.realpath(entry.path)
            if not is_inside(real, real_root):
                refuse_link_out(Path(entry.path), real, root)
        if entry.is_dir():  # a link to a folder too
            real = real or os.path.join(chain[-1], entry.name)
            if real in chain:
                raise DataError(
                    f"{entry.path} is a symbolic link to {real}, a folder that holds it: "
                    f"dataset.path={root} would be read without end. Remove the link."
                )
            subfolders.append((entry.path, real))
            continue
        rel = entry.path[cut:]
        if not entry.name.lower().endswith(IMAGE_EXTENSIONS):
            others.append(rel)
            continue
        try:  # the walk's one stat of the file: the split, the cache and the resume key use it
            stat = entry.stat()
            images.append((rel, stat.st_size, stat.st_mtime_ns))
        except OSError:  # a link to nothing: named as undecodable when read
            images.append((rel, -1, -1))
    for path, real in subfolders:
        walk_class(root, real_root, path, (*chain, real), images, others)


def is_inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def refuse_link_out(path: Path, target: str, root: Path) -> None:
    raise DataError(
        f"{path} leads through a symbolic link to {target}, outside dataset.path={root}: a run "
        "reads only the folder it is given, so that its split and its resume check cover every "
        "image. Copy or move those images into the folder, or give dataset.path the folder "
        "that holds them all."
    )


def check_same_classes(train: dict, other: dict, root: Path, name: str) -> None:
    """train/ and another split's folder (`name`) must name the same classes: a label is a
    class's place among them."""
    only_train, only_other = (
        sorted(train.keys() - other.keys()),
        sorted(other.keys() - train.keys()),
    )
    if only_train or only_other:
        differences = [
            f"only in {where}/: {', '.join(names)}"
            for where, names in (("train", only_train), (name, only_other))
            if names
        ]
        raise DataError(
            f"The class folders of {root / 'train'} and {root / name} differ ("
            f"{'; '.join(differences)}). Each split needs a folder, with images, for every class: "
            "add the missing ones, or remove the extra ones."
        )
