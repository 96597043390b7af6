"""Market-1501 file names: identity and camera of each person crop.

    <root>/bounding_box_train/0002_c1s1_000451_03.jpg     training crops
    <root>/query/0001_c1s1_001051_00.jpg                  probes
    <root>/bounding_box_test/0001_c1s1_001051_03.jpg      gallery

A name is `PPPP_cCsS_FFFFFF_BB.jpg`: person id (4 digits), camera C (1-6), video sequence S,
frame number and the index of the box in that frame. In the gallery, person id `0000` marks
distractors (false detections kept as true negatives) and `-1` junk crops (partial bodies,
ignored by the protocol). DukeMTMC-reID uses the same pattern without the sequence number
(`0005_c2_f0046985.jpg`), which the parser accepts too.

Only the naming lives here; training on the crops and ranking them live with the datasets and
the evaluation.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

JUNK_ID = -1
"""Person id of junk gallery crops: never a match nor a non-match."""
DISTRACTOR_ID = 0
"""Person id of distractor gallery crops: background detections, always non-matches."""

# Person id, then the camera: Market-1501 `0002_c1s1_000451_03`, DukeMTMC `0005_c2_f0046985`.
_NAME = re.compile(r"^(-1|\d+)_c(\d+)(?:s\d+)?_")
_SUFFIXES = (".jpg", ".jpeg", ".png")


def parse_name(name: str) -> tuple[int, int]:
    """(person id, camera id) from a Market-1501-style file name (a base name or a path).

    Raises ValueError naming the file when it does not follow the pattern.
    """
    base = os.path.basename(name)
    match = _NAME.match(base)
    if match is None:
        raise ValueError(
            f"{name}: not a Market-1501 file name (expected PPPP_cCsS_FFFFFF_BB.jpg, "
            "e.g. 0002_c1s1_000451_03.jpg)"
        )
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class PersonImages:
    """The crops of one Market-1501 folder, sorted by file name.

    paths: names relative to the folder; person_ids, camera_ids: (N,) int64 arrays.
    """

    folder: Path
    paths: list[str]
    person_ids: np.ndarray
    camera_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.paths)


def list_folder(folder: str | os.PathLike, *, keep_junk: bool = True) -> PersonImages:
    """Every image in `folder` with its person and camera id (`Thumbs.db` and others skipped).

    With `keep_junk=False`, crops with person id -1 are left out. Raises FileNotFoundError
    for a missing folder, ValueError for a folder without images or an image whose name does
    not parse (naming it).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder (expected a Market-1501 layout)")
    names = sorted(
        entry.name
        for entry in os.scandir(folder)
        if entry.is_file() and entry.name.lower().endswith(_SUFFIXES)
    )
    paths: list[str] = []
    person_ids: list[int] = []
    camera_ids: list[int] = []
    for name in names:
        person, camera = parse_name(str(folder / name))
        if person == JUNK_ID and not keep_junk:
            continue
        paths.append(name)
        person_ids.append(person)
        camera_ids.append(camera)
    if not paths:
        raise ValueError(f"{folder}: no Market-1501 images (.jpg named PPPP_cCsS_FFFFFF_BB.jpg)")
    return PersonImages(
        folder,
        paths,
        np.asarray(person_ids, dtype=np.int64),
        np.asarray(camera_ids, dtype=np.int64),
    )
