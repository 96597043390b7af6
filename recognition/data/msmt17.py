"""MSMT17 (Wei et al., CVPR 2018) read from its release layout: list files over two folders.

    MSMT17_V1/                                           MSMT17_V2/
        train/0000/0000_000_01_0303morning_0015_0.jpg        mask_train_v2/0000/...
        test/0000/0000_000_01_0303morning_0036_0.jpg         mask_test_v2/0000/...
        list_train.txt  list_val.txt                         (the same four lists)
        list_query.txt  list_gallery.txt

A list line is `<path under its folder> <person id>`: list_train.txt and list_val.txt name
crops of the training folder (train/, or V2's mask_train_v2/), list_query.txt and
list_gallery.txt crops of the test folder. The camera (1 to 15) is the third field of the
file name. Training takes list_train.txt and list_val.txt together: the release's training
set, 32,621 crops of 1,041 persons (torchreid and fast-reid train on list_train.txt's 30,248
alone unless told to combine). Query: 11,659 crops, gallery: 82,161, of 3,060 persons.

Every line is checked (two fields, an integer id >= 0, a path inside the folder naming an
existing image, a camera in the name): a bad one stops with `FILE:LINE: ...`; a tree that
is not a release, with one line naming what is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from recognition.data.market1501 import PersonImages

LIST_FILES = ("list_train.txt", "list_val.txt", "list_query.txt", "list_gallery.txt")
"""The four list files of a release, at its root."""
FOLDERS = {"V1": ("train", "test"), "V2": ("mask_train_v2", "mask_test_v2")}
"""The (training, test) image folders of each version."""


def is_msmt17(root: str | os.PathLike) -> bool:
    """Whether `root` looks like an MSMT17 release: its list_train.txt and a training folder."""
    root = Path(root)
    return (root / LIST_FILES[0]).is_file() and any(
        _folder(root, train) is not None for train, _ in FOLDERS.values()
    )


def release_folders(root: str | os.PathLike) -> tuple[Path, Path]:
    """The (training, test) folders of the release at `root` (V1's or V2's names, any case).

    Raises FileNotFoundError naming what is missing when `root` is not a release.
    """
    root = Path(root)
    missing = [name for name in LIST_FILES if not (root / name).is_file()]
    for train, test in FOLDERS.values():
        train_dir, test_dir = _folder(root, train), _folder(root, test)
        if train_dir is not None and test_dir is not None and not missing:
            return train_dir, test_dir
    expected = " or ".join(f"{a}/ and {b}/ ({v})" for v, (a, b) in FOLDERS.items())
    what = f"no {', '.join(missing)}" if missing else "no image folders"
    raise FileNotFoundError(
        f"{root}: not an MSMT17 release: {what} (expected {', '.join(LIST_FILES)} beside "
        f"{expected})"
    )


def read_list(list_file: Path, folder: Path) -> PersonImages:
    """The crops a list file names, under `folder`, in the list's order.

    Raises ValueError `FILE:LINE: ...` for a malformed line or a missing image, and for a
    list without any line.
    """
    paths: list[str] = []
    person_ids: list[int] = []
    camera_ids: list[int] = []
    with open(list_file, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{list_file}:{number}"
            fields = line.split()
            if len(fields) != 2:
                raise ValueError(f"{where}: expected '<image path> <person id>', got {line!r}")
            path, label = fields
            if not label.isdigit():
                raise ValueError(f"{where}: person id {label!r} is not an integer >= 0")
            if Path(path).is_absolute() or ".." in Path(path).parts:
                raise ValueError(f"{where}: {path} is not a path inside {folder}")
            if not (folder / path).is_file():
                raise ValueError(f"{where}: no such image: {folder / path}")
            paths.append(path)
            person_ids.append(int(label))
            camera_ids.append(camera_of(path, where))
    if not paths:
        raise ValueError(f"{list_file}: no crops listed")
    return PersonImages(
        folder,
        paths,
        np.asarray(person_ids, dtype=np.int64),
        np.asarray(camera_ids, dtype=np.int64),
    )


def camera_of(path: str, where: str) -> int:
    """The camera of an MSMT17 file name (`0000_000_01_0303morning_0015_0.jpg`: 1)."""
    fields = Path(path).name.split("_")
    if len(fields) < 4 or not fields[2].isdigit():
        raise ValueError(
            f"{where}: {path} is not an MSMT17 file name (expected "
            "PPPP_NNN_CC_<date><time>_..., e.g. 0000_000_01_0303morning_0015_0.jpg)"
        )
    return int(fields[2])


def msmt17_train(root: str | os.PathLike) -> PersonImages:
    """The training crops (list_train.txt, then list_val.txt) of the release at `root`."""
    root = Path(root)
    train_dir, _ = release_folders(root)
    train, val = (read_list(root / name, train_dir) for name in LIST_FILES[:2])
    return PersonImages(
        train_dir,
        train.paths + val.paths,
        np.concatenate([train.person_ids, val.person_ids]),
        np.concatenate([train.camera_ids, val.camera_ids]),
    )


def msmt17_test(root: str | os.PathLike) -> tuple[PersonImages, PersonImages]:
    """The (queries, gallery) of the release at `root`."""
    root = Path(root)
    _, test_dir = release_folders(root)
    query, gallery = (read_list(root / name, test_dir) for name in LIST_FILES[2:])
    return query, gallery


def _folder(root: Path, name: str) -> Path | None:
    """The folder `name` under `root`, matched without regard to case; None if absent."""
    if (root / name).is_dir():
        return root / name
    if not root.is_dir():
        return None
    for entry in os.scandir(root):
        if entry.is_dir() and entry.name.lower() == name.lower():
            return root / entry.name
    return None
