"""`data.format` resolved by what `data.root` holds: the one look at the training data that
needs neither torch nor an index, so that a run checks it before any work
(`recognition.preflight`)."""

from __future__ import annotations

from pathlib import Path

from recognition.config import DataConfig
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
            "train.rec with train.idx, or a Market-1501 folder)"
        )
    if data_cfg.format != "auto":
        return data_cfg.format
    # The first format whose marker root holds (registry.FORMATS, in order), else folder.
    for name, entry in FORMATS.items():
        if not entry.marker or not (root / entry.marker[0]).exists():
            continue
        for companion in entry.marker[1:]:
            if not (root / companion).exists():
                raise FileNotFoundError(
                    f"data.root: {root / entry.marker[0]} has no {companion} beside it "
                    f"(data.format {name}: {entry.about}); copy it there too"
                )
        return name
    return "folder"
