"""The person re-id data sets, each read from its release layout: training crops, queries and
gallery with their person and camera ids.

    market1501   root/bounding_box_train/, query/, bounding_box_test/   Market-1501, DukeMTMC-reID
    msmt17       root/list_*.txt over train/ and test/ (V2: mask_*_v2/)   MSMT17 (msmt17.py)
    cuhk03       root/cuhk03_new_protocol_config_*.mat over images_*/     CUHK03 (cuhk03.py)

`reid_layout` tells which a folder holds; `reid_test_sets` reads its queries and gallery,
`reid_train_set` its training crops. Nothing here imports
torch: the training sources (`recognition.data.market_train`) and the ranking
(`recognition.evaluation.reid`) sit on top.
"""

from __future__ import annotations

import os
from pathlib import Path

from recognition.data.cuhk03 import cuhk03_split, is_cuhk03
from recognition.data.market1501 import DISTRACTOR_ID, JUNK_ID, PersonImages, list_folder
from recognition.data.msmt17 import is_msmt17, msmt17_test, msmt17_train

MARKET_FOLDERS = ("bounding_box_train", "query", "bounding_box_test")
"""Market-1501's training, query and gallery folders."""
LAYOUTS = ("market1501", "msmt17", "cuhk03")


def reid_layout(root: str | os.PathLike) -> str | None:
    """Which of LAYOUTS the folder `root` holds, or None."""
    root = Path(root)
    if (root / MARKET_FOLDERS[0]).is_dir() or (root / MARKET_FOLDERS[1]).is_dir():
        return "market1501"
    if is_msmt17(root):
        return "msmt17"
    if is_cuhk03(root):
        return "cuhk03"
    return None


def reid_test_sets(
    root: str | os.PathLike, *, cuhk03_boxes: str = "labeled"
) -> tuple[PersonImages, PersonImages]:
    """(queries, gallery) of the re-id data set at `root` (its layout told by `reid_layout`).

    Market-1501's gallery keeps junk (-1) and distractors (0000): the ranking's protocol
    handles them. `cuhk03_boxes`: CUHK03's labeled or detected boxes. Raises
    FileNotFoundError / ValueError in one line naming the file.
    """
    root = Path(root)
    layout = _layout(root)
    if layout == "market1501":
        return list_folder(root / MARKET_FOLDERS[1]), list_folder(root / MARKET_FOLDERS[2])
    if layout == "msmt17":
        return msmt17_test(root)
    _, query, gallery = cuhk03_split(root, cuhk03_boxes)
    return query, gallery


def reid_train_set(
    root: str | os.PathLike, layout: str, *, cuhk03_boxes: str = "labeled"
) -> PersonImages:
    """The training crops of the re-id data set of `layout` at `root` (Market-1501's without
    junk and distractors). Raises FileNotFoundError / ValueError naming the file."""
    root = Path(root)
    if layout == "market1501":
        return market_train(root)
    if layout == "msmt17":
        return msmt17_train(root)
    if layout == "cuhk03":
        return cuhk03_split(root, cuhk03_boxes)[0]
    raise ValueError(f"re-id layout: {layout!r} is not one of {', '.join(LAYOUTS)}")


def market_train(root: Path) -> PersonImages:
    """Market-1501's training crops, junk and distractors left out."""
    listing = list_folder(root / MARKET_FOLDERS[0], keep_junk=False)
    keep = (listing.person_ids != DISTRACTOR_ID) & (listing.person_ids != JUNK_ID)
    if not keep.any():
        raise ValueError(f"{listing.folder}: no crops of real persons (only junk/distractors)")
    return PersonImages(
        listing.folder,
        [p for p, k in zip(listing.paths, keep, strict=True) if k],
        listing.person_ids[keep],
        listing.camera_ids[keep],
    )


def _layout(root: Path) -> str:
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder (a re-id data set's root)")
    layout = reid_layout(root)
    if layout is None:
        raise FileNotFoundError(
            f"{root}: not a re-id data set (expected Market-1501's query/ and "
            "bounding_box_test/, MSMT17's list_query.txt and list_gallery.txt beside test/, "
            "or CUHK03's cuhk03_new_protocol_config_labeled.mat beside images_labeled/)"
        )
    return layout
