"""Market-1501 (and DukeMTMC-reID) training crops as a training source.

    root/bounding_box_train/0002_c1s1_000451_03.jpg ...

The identity comes from the file name (`recognition.data.market1501.parse_name`); the
person ids found (junk `-1` and distractor `0000` crops left out, neither is in the training
split of the published data) become labels 0..C-1 in increasing id order, so class name c is
the zero-padded person id. Crops are taken in sorted file-name order, which groups them by
person.
"""

from __future__ import annotations

import os

import numpy as np
from PIL import Image

from recognition.data.formats import TRAIN_FOLDER
from recognition.data.market1501 import DISTRACTOR_ID, JUNK_ID, list_folder
from recognition.data.source import BadImagePolicy, TrainSource
from recognition.data.transforms import load_rgb, read_encoded


class Market1501TrainDataset(TrainSource):
    """The crops of `root/bounding_box_train` with labels from their person ids.

    image: (3, H, W) float32 in [-1, 1] at `image_size` (an int or (H, W); re-id uses
    (256, 128)). Raises FileNotFoundError / ValueError naming the folder or file.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        image_size: int | tuple[int, int],
        *,
        train: bool = False,
        on_bad_image: BadImagePolicy = "error",
    ) -> None:
        super().__init__(root, image_size, train=train, on_bad_image=on_bad_image)
        self.folder = self.root / TRAIN_FOLDER
        listing = list_folder(self.folder, keep_junk=False)
        keep = listing.person_ids != DISTRACTOR_ID
        keep &= listing.person_ids != JUNK_ID
        self.paths = [p for p, k in zip(listing.paths, keep, strict=True) if k]
        person_ids = listing.person_ids[keep]
        if not self.paths:
            raise ValueError(f"{self.folder}: no crops of real persons (only junk/distractors)")
        self.person_ids, labels = np.unique(person_ids, return_inverse=True)
        self.labels = labels.astype(np.int32)
        self.camera_ids = listing.camera_ids[keep]

    @property
    def num_classes(self) -> int:
        return len(self.person_ids)

    def class_name(self, label: int) -> str:
        return f"{int(self.person_ids[label]):04d}"

    def describe(self, index: int) -> str:
        return str(self.folder / self.paths[index])

    def decode(self, index: int) -> Image.Image:
        return load_rgb(self.folder / self.paths[index])

    def encoded(self, index: int) -> bytes:
        return read_encoded(self.folder / self.paths[index])
