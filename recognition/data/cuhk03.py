"""CUHK03 under the new protocol (Zhong et al., CVPR 2017): its split files over the images.

    cuhk03/
        cuhk03_new_protocol_config_labeled.mat      the split of the hand-labeled boxes
        cuhk03_new_protocol_config_detected.mat     the split of the detector's boxes
        images_labeled/1_001_1_01.png ...           the crops the split files name
        images_detected/1_001_1_01.png ...

A split file (MATLAB v5, read with scipy.io) holds `filelist` (the crops' file names),
`labels` (person ids) and `camId` (1 or 2, the camera of the pair that took the crop), one
per crop, and `train_idx`, `query_idx`, `gallery_idx`, 1-based indices into them: 7,365
training crops of 767 persons, 1,400 queries and 5,332 gallery crops of the other 700.
The crops are not files in the release (cuhk03_release/cuhk-03.mat stores them as arrays,
in MATLAB v7.3, which needs h5py): they are expected as the split files name them, in
images_labeled/ and images_detected/, as torchreid extracts them (`<pair>_<person:03d>_
<camera>_<n:02d>.png`). Which split: `data.cuhk03_boxes` for training, `--cuhk03-boxes` for
evaluation (labeled, the default, or detected).

Every field is checked (present, one entry per crop, indices in range, crops present); a
file or tree that is not one stops with one line naming the file and what is wrong.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from recognition.data.market1501 import PersonImages

BOXES = ("labeled", "detected")
"""The two sets of boxes, each with its own split file and image folder."""
FIELDS = ("filelist", "labels", "camId", "train_idx", "query_idx", "gallery_idx")
"""The variables a split file must hold."""


def split_file(root: str | os.PathLike, boxes: str = "labeled") -> Path:
    """The split file of `boxes` under `root`."""
    return Path(root) / f"cuhk03_new_protocol_config_{boxes}.mat"


def image_folder(root: str | os.PathLike, boxes: str = "labeled") -> Path:
    """The folder of the crops of `boxes` under `root`."""
    return Path(root) / f"images_{boxes}"


def is_cuhk03(root: str | os.PathLike) -> bool:
    """Whether `root` holds a new-protocol split file of either set of boxes."""
    return any(split_file(root, boxes).is_file() for boxes in BOXES)


def cuhk03_split(
    root: str | os.PathLike, boxes: str = "labeled"
) -> tuple[PersonImages, PersonImages, PersonImages]:
    """(training crops, query, gallery) of CUHK03's new protocol for `boxes` (labeled or
    detected) at `root`. Raises FileNotFoundError / ValueError in one line naming the file."""
    if boxes not in BOXES:
        raise ValueError(f"cuhk03 boxes: {boxes!r} is not one of {', '.join(BOXES)}")
    path, folder = split_file(root, boxes), image_folder(root, boxes)
    if not path.is_file():
        raise FileNotFoundError(
            f"{root}: not a CUHK03 new-protocol tree: no {path.name} (expected the split "
            f"files cuhk03_new_protocol_config_{{labeled,detected}}.mat beside images_labeled/ "
            "and images_detected/)"
        )
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder}: no such folder (the crops {path.name} names, as torchreid extracts "
            "them from cuhk-03.mat)"
        )
    names, person_ids, camera_ids, indices = _read_split(path)
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{path}: {len(missing)} of its {len(names)} crops are not in {folder} "
            f"(first: {missing[0]})"
        )

    def subset(which: np.ndarray) -> PersonImages:
        return PersonImages(folder, [names[i] for i in which], person_ids[which], camera_ids[which])

    train, query, gallery = (subset(indices[field]) for field in FIELDS[3:])
    return train, query, gallery


def _read_split(path: Path) -> tuple[list[str], np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """File names, person ids, cameras and the three 0-based index arrays of a split file."""
    from scipy.io import loadmat  # scipy comes with scikit-learn
    from scipy.io.matlab import MatReadError

    try:
        content = loadmat(path)
    except NotImplementedError:
        raise ValueError(
            f"{path}: a MATLAB v7.3 (HDF5) file, which scipy cannot read; save it as v7 "
            "(MATLAB: save(name, '-struct', 's', '-v7'))"
        ) from None
    except (MatReadError, ValueError, TypeError, OSError) as exc:
        raise ValueError(f"{path}: not a MATLAB file scipy can read ({exc})") from None
    absent = [field for field in FIELDS if field not in content]
    if absent:
        raise ValueError(
            f"{path}: no {', '.join(absent)} (a new-protocol split file holds {', '.join(FIELDS)})"
        )
    names = [_text(cell) for cell in np.asarray(content["filelist"], dtype=object).ravel()]
    person_ids = _integers(content["labels"], path, "labels")
    camera_ids = _integers(content["camId"], path, "camId")
    for field, values in (("labels", person_ids), ("camId", camera_ids)):
        if len(values) != len(names):
            raise ValueError(f"{path}: {field} has {len(values)} entries for {len(names)} crops")
    indices = {}
    for field in FIELDS[3:]:
        one_based = _integers(content[field], path, field)
        if len(one_based) == 0 or one_based.min() < 1 or one_based.max() > len(names):
            raise ValueError(
                f"{path}: {field} must hold 1-based indices into the {len(names)} crops"
            )
        indices[field] = one_based - 1
    return names, person_ids, camera_ids, indices


def _text(cell: object) -> str:
    """A MATLAB string as scipy gives it: a str, or arrays of one around it."""
    while isinstance(cell, np.ndarray):
        cell = cell.ravel()[0] if cell.size else ""
    return str(cell)


def _integers(values: object, path: Path, field: str) -> np.ndarray:
    array = np.asarray(values).ravel()
    if array.dtype.kind not in "iuf" or (
        array.dtype.kind == "f" and not np.array_equal(array, np.round(array))
    ):
        raise ValueError(f"{path}: {field} must hold integers, got {array.dtype}")
    return array.astype(np.int64)
