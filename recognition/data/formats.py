"""`data.format` resolved by what `data.root` holds: the one look at the training data that
needs neither torch nor an index, so that a run checks it before any work
(`recognition.preflight`)."""

from __future__ import annotations

from pathlib import Path

from recognition.config import DataConfig
from recognition.data.cuhk03 import image_folder, split_file
from recognition.data.msmt17 import release_folders
from recognition.registry import FORMATS

TRAIN_FOLDER = "bounding_box_train"
"""The training crops' folder of a Market-1501 layout."""


def resolve_format(data_cfg: DataConfig) -> str:
    """`data.format`, with `auto` resolved by what `data.root` holds."""
    root = Path(data_cfg.root)
    if not root.exists():
        raise FileNotFoundError(f"data.root: {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(
            f"data.root: {root} is a file; expected a folder (one sub-folder per identity, "
            "train.rec with train.idx, or a re-id data set's folder)"
        )
    if data_cfg.format in ("msmt17", "cuhk03"):
        check_reid_release(root, data_cfg.format, data_cfg.cuhk03_boxes)
    if data_cfg.format != "auto":
        return data_cfg.format
    # The first format whose marker root holds (registry.FORMATS, in order), else folder.
    for name, entry in FORMATS.items():
        if not entry.marker or next(root.glob(entry.marker[0]), None) is None:
            continue
        for companion in entry.marker[1:]:
            if not (root / companion).exists():
                raise FileNotFoundError(
                    f"data.root: {root / entry.marker[0]} has no {companion} beside it "
                    f"(data.format {name}: {entry.about}); copy it there too"
                )
        if name in ("msmt17", "cuhk03"):  # the rest of the release, by its files
            check_reid_release(root, name, data_cfg.cuhk03_boxes)
        return name
    return "folder"


def check_reid_release(root: Path, kind: str, cuhk03_boxes: str) -> None:
    """Raise FileNotFoundError in one line when `root` is not a release of `kind` (msmt17,
    cuhk03), by its files alone (its lists and split files are read when it is loaded)."""
    if kind == "msmt17":
        try:
            release_folders(root)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"data.root: {exc}") from None
        return
    if (
        not split_file(root, cuhk03_boxes).is_file()
        or not image_folder(root, cuhk03_boxes).is_dir()
    ):
        raise FileNotFoundError(
            f"data.root: {root} is not a CUHK03 new-protocol tree for data.cuhk03_boxes="
            f"{cuhk03_boxes}: it needs {split_file(root, cuhk03_boxes).name} and "
            f"{image_folder(root, cuhk03_boxes).name}/"
        )
