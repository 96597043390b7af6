"""`data.format` resolved by what `data.root` holds: the one look at the training data that
needs neither torch nor an index, so that a run checks it before any work
(`recognition.preflight`)."""

from __future__ import annotations

from pathlib import Path

from recognition.config import DataConfig

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
            "train.rec with train.idx, or a Market-1501 folder)"
        )
    if data_cfg.format != "auto":
        return data_cfg.format
    if (root / "train.rec").is_file():
        if not (root / "train.idx").is_file():
            raise FileNotFoundError(
                f"data.root: {root / 'train.rec'} has no train.idx beside it (the RecordIO "
                "index of record offsets that comes with the pack); copy it there too"
            )
        return "recordio"
    if (root / TRAIN_FOLDER).is_dir():
        return "market1501"
    return "folder"
